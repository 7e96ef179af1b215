#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod assign;
pub mod bench;
pub mod capability;
pub mod client;
#[cfg(feature = "serde")]
pub mod codec;
pub mod dispatch;
pub mod error;
pub mod handler;
pub mod health;
pub mod key;
pub mod lease;
pub mod memory;
pub mod message;
pub mod redact;
mod rt;
pub mod stats;
pub mod strategy;
pub mod subscription;
pub mod trace;
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
pub use error::{BrokerError, Error, Result};
pub use handler::{Handler, HandlerError, HandlerResult, Settled, SettledHook, Settlement};
pub use health::{Health, HealthReport};
pub use key::{KeyError, KeyRule, KeyRules, OrderingKey, MAX_KEY_BYTES};
pub use lease::{LeaseConfig, LeaseState, ScopeLease};
pub use memory::MemoryTransport;
pub use message::{
    Delivery, KeySource, KeylessPolicy, Message, MessageType, CONTENT_TYPE_HEADER, KEY_HEADER, TYPE_HEADER,
};
pub use stats::{Stats, StatsSnapshot};
pub use strategy::{GlobalBackoff, PoisonPolicy, Resolved, RetryPolicy, Strategy};
pub use subscription::{RunReport, Subscription, SubscriptionBuilder};
pub use trace::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
pub use transport::{
    Admin, DeadLetter, GroupInfo, HaltedKey, HeadAction, HotKey, Inbound, PublishFence, Room, ScopeInfo, Settle,
    SourceEvent, SourceSpec, Transport, TransportPublisher, TransportSource,
};

/// What an adapter author needs and an application does not: the transport
/// traits an adapter implements, the keyed dispatcher a subscription drives,
/// leases, scope assignment and the fetch-room policy.
///
/// An application uses the crate root ([`Client`], [`Message`],
/// [`Handler`], [`Subscription`], [`Admin`] for operator verbs); the
/// facade crate `keyorder` re-exports only that face, and this module as
/// `keyorder::raw`. Everything here may change in a minor release while
/// the application face stays put.
pub mod raw {
    pub use crate::assign::assign;
    pub use crate::bench::{sets_option, with_default, BenchHints, DefaultBenchHints};
    pub use crate::dispatch::{DispatchConfig, Dispatcher, Job, Submit, Widening, ISOLATION_WAIT};
    pub use crate::lease::{lost_epoch, LeaseState, ScopeLease};
    pub use crate::transport::{
        Inbound, PublishFence, Room, Settle, SourceEvent, SourceSpec, Transport, TransportPublisher, TransportSource,
    };
}

pub use async_trait::async_trait;
pub use bytes::Bytes;
