#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod attempts;
mod bench;
mod channel;
mod claims;
mod config;
mod conn;
pub mod control;
mod error;
mod held;
mod names;
mod plan;
mod presence;
mod probe;
mod publisher;
mod settle;
mod shared;
mod source;
mod topology;
mod transport;
mod wire;

pub use crate::bench::RabbitBenchHints;
pub use crate::config::{ConsumerTimeout, QueueType, RabbitConfig, Topology, QUORUM_MAX_PREFETCH};
pub use crate::names::{GroupNames, Names, MAX_CATEGORY_AND_GROUP};
pub use crate::transport::{RabbitTransport, CAPABILITIES, PLAIN_CAPABILITIES};
pub use crate::wire::EPOCH_HEADER;
pub use lapin;
