//! The names of a category's and a consumer group's things on the broker
//! (exchanges, queues); the table in the crate's `topology` module says
//! what each one is.

use keyorder_core::{Error, Result};

use crate::config::Topology;

/// The topic exchange operator requests go through (routing key: the
/// group's base name `{category}:{group}`).
pub const CONTROL_EXCHANGE: &str = "keyorder.control";

/// The longest category and group together (bytes): `{c}:{g}.hash.1023`
/// then fits AMQP's 255-byte names.
pub const MAX_CATEGORY_AND_GROUP: usize = 255 - ":".len() - ".hash.1023".len();

fn check(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "rabbitmq: {what} `{}` is not usable: a {what} name is 1 to 200 characters of [A-Za-z0-9._-] (the \
             queue and exchange names of every (category, group) pair must differ, and `:` separates them)",
            name.chars().take(60).collect::<String>().escape_debug()
        )))
    }
}

/// The names of one category (see the table in the crate's `topology` module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    c: String,
}

impl Names {
    /// The names of `category` (1 to 200 characters of `[A-Za-z0-9._-]`).
    pub fn new(category: &str) -> Result<Self> {
        check("category", category)?;
        Ok(Names { c: category.to_owned() })
    }
    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The entry exchange publishers publish to.
    pub fn entry(&self) -> String {
        format!("{}:entry", self.c)
    }
    /// The group registry queue.
    pub fn registry(&self) -> String {
        format!("{}:groups", self.c)
    }
    /// The registry's lock queue.
    pub fn registry_lock(&self) -> String {
        format!("{}:groups-lock", self.c)
    }
    /// The names of `group` of this category.
    pub fn group(&self, group: &str) -> Result<GroupNames> {
        check("group", group)?;
        if self.c.len() + group.len() > MAX_CATEGORY_AND_GROUP {
            return Err(Error::Config(format!(
                "rabbitmq: category `{}` and group `{}` are {} bytes together: on RabbitMQ a category and a group \
                 name are at most {MAX_CATEGORY_AND_GROUP} bytes together (AMQP names are at most 255 bytes and the \
                 longest keyorder makes is `{{category}}:{{group}}.hash.1023`); shorten one of them",
                self.c,
                group,
                self.c.len() + group.len()
            )));
        }
        Ok(GroupNames {
            c: self.c.clone(),
            g: group.to_owned(),
            base: format!("{}:{group}", self.c),
        })
    }
    /// The queues of the layout before consumer groups (`{c}.sac`,
    /// `{c}.plain`, `{c}.dlq`, the first hash queue `{c}.hash.0`): a
    /// category that has any of them is refused until they are drained and
    /// deleted.
    pub fn legacy_queues(&self) -> Vec<String> {
        vec![
            format!("{}.sac", self.c),
            format!("{}.plain", self.c),
            format!("{}.dlq", self.c),
            format!("{}.hash.0", self.c),
        ]
    }
    /// The consistent-hash exchange of the layout before consumer groups.
    pub fn legacy_hash_exchange(&self) -> String {
        format!("{}.hash", self.c)
    }
    /// Hash queue `i` of the layout before consumer groups.
    pub fn legacy_hash_queue(&self, i: u16) -> String {
        format!("{}.hash.{i}", self.c)
    }
}

/// The names of one (category, group) pair (see the table in the crate's `topology` module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupNames {
    c: String,
    g: String,
    base: String,
}

impl GroupNames {
    /// The category.
    pub fn category(&self) -> &str {
        &self.c
    }
    /// The group.
    pub fn group(&self) -> &str {
        &self.g
    }
    /// `{category}:{group}`, the prefix of every name of the group (unique
    /// per pair; also the key of the group's state in a process).
    pub fn base(&self) -> &str {
        &self.base
    }
    /// The group's consistent-hash exchange.
    pub fn hash_exchange(&self) -> String {
        format!("{}.hash", self.base)
    }
    /// Queue `i` of the group's hash topology.
    pub fn hash_queue(&self, i: u16) -> String {
        format!("{}.hash.{i}", self.base)
    }
    /// The group's single-active-consumer queue.
    pub fn sac_queue(&self) -> String {
        format!("{}.sac", self.base)
    }
    /// The group's plain queue.
    pub fn plain_queue(&self) -> String {
        format!("{}.plain", self.base)
    }
    /// The group's dead-letter queue.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.base)
    }
    /// The queue every running source of the group consumes (its consumer
    /// count is the group's live members).
    pub fn members(&self) -> String {
        format!("{}.members", self.base)
    }
    /// The group's presence exchange.
    pub fn presence(&self) -> String {
        format!("{}.presence", self.base)
    }
    /// The exclusive queue a running source of the group holds for as long
    /// as its connection lives, named after its join claim's offset, its
    /// instance id and its nonce: the broker's proof that an announcement
    /// comes from a live member (the `presence` module). A fixed-length
    /// name (`keyorder.live.` and 32 hex digits of SHA-256), so a long
    /// category, group or instance id still fits.
    pub fn live(&self, started: u64, who: &str, nonce: &str) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::new()
            .chain_update(self.base.as_bytes())
            .chain_update([0])
            .chain_update(started.to_be_bytes())
            .chain_update(who.as_bytes())
            .chain_update([0])
            .chain_update(nonce.as_bytes())
            .finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("keyorder.live.{hex}")
    }

    /// The queues a topology consumes.
    pub fn queues(&self, t: Topology) -> Vec<String> {
        match t {
            Topology::Plain => vec![self.plain_queue()],
            Topology::SingleActiveConsumer => vec![self.sac_queue()],
            Topology::ConsistentHash { queues } => (0..queues).map(|i| self.hash_queue(i)).collect(),
        }
    }
}
