//! Operator actions over the admin view.

use clap::{Args, ValueEnum};
use keyorder::redact::{quoted, text};
use keyorder::HeadAction;

/// Which transport, category and group.
#[derive(Debug, Args)]
pub(crate) struct Target {
    /// The transport URL (memory://, redis://, amqp://, kafka://, postgres://).
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL", default_value = "memory://")]
    pub(crate) url: String,
    /// The category.
    #[arg(long)]
    pub(crate) category: String,
    /// The consumer group.
    #[arg(long)]
    pub(crate) group: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum HeadVerb {
    /// List halted keys with their heads.
    Show,
    /// Acknowledge the head without processing (logged) and release the key.
    Skip,
    /// Move the head to the dead-letter destination and release the key.
    Dlq,
    /// Reset the head's attempts and run it again.
    Resume,
}

#[derive(Debug, Args)]
pub(crate) struct HeadArgs {
    /// What to do.
    #[arg(value_enum)]
    verb: HeadVerb,
    #[command(flatten)]
    target: Target,
    /// The halted key: its value, or its label (`k#...`) as `head show` prints it.
    #[arg(long, required_if_eq_any([("verb", "skip"), ("verb", "dlq"), ("verb", "resume")]))]
    key: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct HotKeysArgs {
    #[command(flatten)]
    target: Target,
    /// How many keys to list.
    #[arg(long, default_value_t = 10)]
    limit: usize,
}

pub(crate) async fn scopes(t: Target) -> anyhow::Result<()> {
    let client = keyorder::connect(&t.url).await?;
    let scopes = client.admin().scopes(&t.category, &t.group).await?;
    println!(
        "{:<32} {:<38} {:>10} {:>10} {:>7}",
        "scope", "owner", "generation", "lag", "halted"
    );
    for s in scopes {
        println!(
            "{:<32} {:<38} {:>10} {:>10} {:>7}",
            text(&s.scope),
            text(s.owner.as_deref().unwrap_or("-")),
            s.generation,
            s.lag,
            s.halted
        );
    }
    Ok(())
}

pub(crate) async fn head(a: HeadArgs) -> anyhow::Result<()> {
    let client = keyorder::connect(&a.target.url).await?;
    let admin = client.admin();
    let (category, group) = (&a.target.category, &a.target.group);
    let action = match a.verb {
        HeadVerb::Show => {
            let halted = admin.halted(category, group).await?;
            if halted.is_empty() {
                println!("no halted keys");
            }
            for h in halted {
                let held = h.held.map_or_else(String::new, |n| format!(" held={n}"));
                println!(
                    "{} {} scope={} head={} attempts={}{held} reason={}",
                    // Label and preview are keyorder's own, already escaped.
                    h.label,
                    h.preview,
                    quoted(&h.scope),
                    quoted(&h.head_id),
                    h.attempts,
                    quoted(&h.reason)
                );
            }
            return Ok(());
        }
        HeadVerb::Skip => HeadAction::Skip,
        HeadVerb::Dlq => HeadAction::DeadLetter,
        HeadVerb::Resume => HeadAction::Resume,
    };
    let key = a.key.expect("clap requires --key for this verb");
    admin.resolve(category, group, &key, action).await?;
    println!("{action:?}: done");
    Ok(())
}

pub(crate) async fn hot_keys(a: HotKeysArgs) -> anyhow::Result<()> {
    let client = keyorder::connect(&a.target.url).await?;
    let hot = client
        .admin()
        .hot_keys(&a.target.category, &a.target.group, a.limit)
        .await?;
    let total: u64 = hot.iter().map(|h| h.backlog).sum();
    for h in hot {
        println!(
            "{} backlog={} share={:.1}%",
            h.label,
            h.backlog,
            100.0 * h.backlog as f64 / total.max(1) as f64
        );
    }
    Ok(())
}

pub(crate) async fn dead_letters(t: Target) -> anyhow::Result<()> {
    let client = keyorder::connect(&t.url).await?;
    for d in client.admin().dead_letters(&t.category, &t.group).await? {
        println!("id={} {} reason={}", quoted(&d.id), d.label, quoted(&d.reason));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum GroupsVerb {
    /// List the category's consumer groups with their live members.
    List,
    /// Remove a stopped group (refused while it has live members); retention
    /// and trimming then no longer wait for it.
    Remove,
}

#[derive(Debug, Args)]
pub(crate) struct GroupsArgs {
    /// What to do.
    #[arg(value_enum)]
    verb: GroupsVerb,
    /// The transport URL (memory://, redis://, amqp://, kafka://, postgres://).
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL", default_value = "memory://")]
    url: String,
    /// The category.
    #[arg(long)]
    category: String,
    /// The group to remove.
    #[arg(long, required_if_eq("verb", "remove"))]
    group: Option<String>,
    /// Confirms a removal: the group's positions, pending messages and
    /// halted keys are deleted.
    #[arg(long)]
    yes: bool,
}

pub(crate) async fn groups(a: GroupsArgs) -> anyhow::Result<()> {
    let client = keyorder::connect(&a.url).await?;
    let admin = client.admin();
    match a.verb {
        GroupsVerb::List => {
            let groups = admin.groups(&a.category).await?;
            if groups.is_empty() {
                println!("no consumer groups");
            }
            for g in groups {
                println!("{} live_members={}", g.name.escape_debug(), g.live_members);
            }
        }
        GroupsVerb::Remove => {
            let group = a.group.expect("clap requires --group for remove");
            if !a.yes {
                anyhow::bail!(
                    "groups remove deletes what the broker keeps for group `{}` of `{}` (positions, pending \
                     messages, halted keys): add --yes to confirm",
                    group.escape_debug(),
                    a.category.escape_debug()
                );
            }
            admin.remove_group(&a.category, &group).await?;
            println!("removed group {}", group.escape_debug());
        }
    }
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct DeleteQueueArgs {
    /// The transport URL (postgres:// or amqp://).
    #[arg(long, hide_env_values = true, env = "KEYORDER_URL")]
    url: String,
    /// The category (queue) to delete.
    #[arg(long)]
    category: String,
    /// Confirms it: the category's messages, positions, halted keys and dead
    /// letters are deleted for every consumer group.
    #[arg(long)]
    yes: bool,
}

/// Deletes a category and everything kept for it through the transport's
/// `Admin::delete_category`: PostgreSQL and RabbitMQ delete what keyorder
/// keeps (refused while a group has a live member); Redis and Kafka say
/// what to delete with the broker's own tools.
pub(crate) async fn delete_queue(a: DeleteQueueArgs) -> anyhow::Result<()> {
    if !a.yes {
        anyhow::bail!(
            "delete-queue deletes `{}` with all its messages, positions and dead letters for every group: \
             add --yes to confirm",
            a.category
        );
    }
    let client = keyorder::connect(&a.url).await?;
    let gone = client.admin().delete_category(&a.category).await?;
    println!("deleted `{}`: {gone}", a.category);
    Ok(())
}
