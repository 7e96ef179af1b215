//! `Names`: the names of a category's things on the broker (its topic, the
//! Kafka consumer group of a keyorder group, the state, dead-letter and
//! control topics, a partition's scope).

use keyorder_core::{Error, Result};

/// A category's topic names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    topic: String,
}

impl Names {
    /// Validates the category as a Kafka topic name.
    pub fn new(category: &str) -> Result<Self> {
        let ok = !category.is_empty()
            && category.len() <= 200
            && category != "."
            && category != ".."
            && category
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !ok {
            return Err(Error::Config(format!(
                "category `{}` is not a Kafka topic name: use 1-200 of [A-Za-z0-9._-]",
                keyorder_core::key::redact(category)
            )));
        }
        Ok(Names {
            topic: category.to_owned(),
        })
    }
    /// The category's topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
    /// The Kafka consumer group of keyorder group `group` on this topic:
    /// `<group>.<topic>`, so subscriptions to different categories never
    /// rebalance each other.
    pub fn group_id(&self, group: &str) -> String {
        format!("{group}.{}", self.topic)
    }
    /// Its state topic: each partition's saved progress (see the README).
    pub fn state(&self) -> String {
        format!("{}.keyorder-state", self.topic)
    }
    /// Its dead-letter topic.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.topic)
    }
    /// Its operator control topic (one partition; see `control`).
    pub(crate) fn control(&self) -> String {
        format!("{}.keyorder-control", self.topic)
    }
    /// The scope (the lease's name) of its partition `partition`:
    /// `<topic>/<partition>`.
    pub(crate) fn scope(&self, partition: i32) -> String {
        format!("{}/{partition}", self.topic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn category_names_must_be_topic_names() {
        assert!(Names::new("orders.v1_x-y").is_ok());
        for bad in ["", "a b", "a/b", "..", "ä"] {
            assert!(Names::new(bad).is_err(), "{bad}");
        }
    }
}
