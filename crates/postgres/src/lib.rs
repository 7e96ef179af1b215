#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod admin;
mod batch;
mod bench;
mod config;
mod error;
mod exec;
mod names;
mod pg;
mod plain;
mod publisher;
mod schema;
mod settle;
pub mod shared;
mod source;
mod sql;
mod track;
mod transport;
mod wire;

pub use bench::PgBenchHints;
pub use config::{Layout, PgConfig, DEFAULT_SLOTS};
pub use error::{broker_error, PgCause};
pub use names::slot_of;
pub use sqlx;
pub use transport::{PgTransport, CAPABILITIES, SETTLEMENT_CONNECTIONS};
