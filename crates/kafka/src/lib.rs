#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod bench;
mod broker;
mod config;
mod control;
mod error;
mod member;
mod names;
mod owned;
mod publisher;
mod settle;
mod source;
mod state;
mod track;
mod transport;
mod wire;

pub use crate::bench::KafkaBenchHints;
pub use crate::broker::{KafkaTransport, LAYOUT_CHECK, STATE_MIN_COMPACTION_LAG_MS};
pub use crate::config::{Assignor, KafkaConfig, StartAt};
pub use crate::names::Names;
pub use crate::transport::CAPABILITIES;
pub use crate::wire::{
    murmur2, partition_for, CORRELATION_HEADER, GROUP_HEADER, ID_HEADER, ORIGIN_HEADER, REASON_HEADER,
};
pub use rdkafka;
