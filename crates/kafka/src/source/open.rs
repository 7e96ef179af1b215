//! What a source reads when it opens: the saved partition count, and
//! another group's offsets for `start=group:<id>`.

use std::collections::HashMap;
use std::time::Duration;

use keyorder_core::Result;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};

use crate::broker::KafkaTransport;
use crate::config::base_config;
use crate::error::{create_err, kafka_err};
use crate::names::Names;
use crate::state;
use crate::track::decode;

/// The offsets `group` (a consumer group that consumed the topic before
/// keyorder, `start=group:<id>`) committed on `names`' topic, by partition.
/// Refused when it committed none there: a misspelt name would otherwise
/// replay the whole topic.
pub(super) async fn group_offsets(
    t: &KafkaTransport,
    names: &Names,
    group: &str,
    partitions: i32,
) -> Result<HashMap<i32, i64>> {
    let mut c = base_config(&t.cfg);
    c.set("group.id", group).set("enable.auto.commit", "false");
    let probe: BaseConsumer = c.create().map_err(create_err)?;
    let topic = names.topic().to_owned();
    let committed = tokio::task::spawn_blocking(move || {
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        probe.committed_offsets(tpl, Duration::from_secs(10))
    })
    .await
    .map_err(kafka_err)?
    .map_err(|e| {
        keyorder_core::Error::Broker(format!(
            "kafka: reading the committed offsets of group `{group}` (start=group:{group}): {e}"
        ))
    })?;
    let out: HashMap<i32, i64> = committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) if o >= 0 => Some((e.partition(), o)),
            _ => None,
        })
        .collect();
    if out.is_empty() {
        return Err(keyorder_core::Error::Config(format!(
            "kafka: start=group:{group}: that group has no committed offsets on topic `{}`; check the group's \
             name (`kafka-consumer-groups.sh --list`), or use start=earliest or start=latest",
            names.topic()
        )));
    }
    tracing::info!(topic = %names.topic(), partitions = out.len(), "kafka: partitions without saved progress start at another group's committed offsets");
    Ok(out)
}

/// Refuses a topic whose partition count differs from the one the group's
/// state records were written under: keys would have moved between
/// partitions. Returns the partitions without saved progress (never
/// consumed by the group).
pub(super) async fn check_partition_count(
    t: &KafkaTransport,
    names: &Names,
    group: &str,
    partitions: i32,
) -> Result<Vec<i32>> {
    let mut c = base_config(&t.cfg);
    c.set("group.id", names.group_id(group))
        .set("enable.auto.commit", "false");
    let probe: BaseConsumer = c.create().map_err(create_err)?;
    let reader = state::reader(&t.cfg).map_err(kafka_err)?;
    let producer = t.state_producer.clone();
    let (n2, g2) = (names.clone(), names.group_id(group));
    let saved = tokio::task::spawn_blocking(move || {
        let parts: Vec<i32> = (0..partitions).collect();
        state::read_saved(
            &probe,
            &reader,
            &producer,
            &n2,
            &g2,
            &parts,
            Duration::from_secs(10),
            state::Limit::none(),
        )
    })
    .await
    .map_err(kafka_err)?
    .map_err(kafka_err)?;
    let fresh = saved.iter().filter(|s| !s.known).map(|s| s.partition).collect();
    for s in saved {
        if let Some(n) = decode(s.committed, &s.meta).partitions {
            if n != partitions {
                return Err(keyorder_core::Error::Config(format!(
                    "kafka: topic `{}` has {partitions} partitions but group `{group}` committed under {n}: keys \
                     moved between partitions, so their order cannot be kept. Restore {n} partitions, or drain \
                     the group and consume with a new one",
                    names.topic()
                )));
            }
        }
    }
    Ok(fresh)
}
