#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod assign;
pub mod capability;
pub mod client;
pub mod dispatch;
pub mod error;
pub mod handler;
pub mod key;
pub mod lease;
pub mod memory;
pub mod message;
pub mod redact;
mod rt;
pub mod stats;
pub mod strategy;
pub mod subscription;
pub mod transport;

/// Switches the planted dispatcher bug on or off for the shuttle runs of
/// this thread: the schedule tests show they catch it
/// (`crates/core/tests/SHUTTLE.md`). Only in `--cfg keyorder_shuttle` builds.
#[cfg(keyorder_shuttle)]
#[doc(hidden)]
pub use rt::plant_bug;

pub use capability::Capabilities;
pub use client::{Client, Publisher};
pub use dispatch::{DispatchConfig, Dispatcher, Job, Submit, Widening};
pub use error::{Error, Result};
pub use handler::{Handler, HandlerError, HandlerResult, Settled, SettledHook, Settlement};
pub use key::{KeyError, KeyRule, KeyRules, OrderingKey, MAX_KEY_BYTES};
pub use lease::{LeaseConfig, LeaseState, ScopeLease};
pub use memory::MemoryTransport;
pub use message::{Delivery, KeySource, KeylessPolicy, Message, MessageType, KEY_HEADER, TYPE_HEADER};
pub use stats::{Stats, StatsSnapshot};
pub use strategy::{GlobalBackoff, PoisonPolicy, Resolved, RetryPolicy, Strategy};
pub use subscription::{RunReport, Subscription, SubscriptionBuilder};
pub use transport::{
    Admin, DeadLetter, GroupInfo, HaltedKey, HeadAction, HotKey, Inbound, PublishFence, ScopeInfo, Settle, SourceEvent,
    SourceSpec, Transport, TransportPublisher, TransportSource,
};

pub use async_trait::async_trait;
pub use bytes::Bytes;
