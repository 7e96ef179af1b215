#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod batch;
mod bench;
mod config;
mod conn;
mod error;
mod names;
mod plain;
mod publisher;
mod scripts;
mod settle;
mod source;
mod transport;
mod wake;
mod wire;

pub use crate::bench::RedisBenchHints;
pub use crate::config::{Layout, RedisConfig};
pub use crate::names::Names;
pub use crate::transport::{RedisTransport, CAPABILITIES, SINGLE_CAPABILITIES};
pub use redis;
