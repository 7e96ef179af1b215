//! The Lua scripts: every step that must be atomic at the server (publish and
//! index, acquire and reclaim, fenced read, fenced acknowledgement, park,
//! trim, reap, operator actions) is one script, so it runs as one step on the
//! Redis server, on the server's clock.
//!
//! A key reaches a script, and is stored by one (index member, halted and
//! resolved field, dead-letter index member, wake-up), as its segment
//! ([`Names::segment`](crate::Names::segment)), never raw: a script that
//! builds a name concatenates `{category}:{segment}`, as `Names` does.
//!
//! A *holder* is `{owner}:{generation}`: the lease's value, and the name of
//! the owner's consumer in the stream's group, so a consumer name always
//! carries its generation.
//!
//! The scripts are kept by what they serve: [`publish`], [`own`]ership
//! (leases, membership, trimming and reaping), [`deliver`]ing (the fenced
//! read and settling) and the [`operator`]'s verbs, each built on [`lua`]'s
//! shared pieces.

mod deliver;
mod lua;
mod operator;
mod own;
mod publish;

pub(crate) use deliver::{HALT, PARK, READ, SETTLE};
pub(crate) use operator::{GROUPS, REMOVE_GROUP, RESOLVE, SCOPES};
pub(crate) use own::{ACQUIRE, GROUP_REMOVED, JOIN_PLAIN, JOIN_STREAM, REAP, REGISTER, RELEASE_MANY, RENEW, TRIM};
pub(crate) use publish::{APPEND, APPEND_FENCED, PUBLISH, PUBLISH_FENCED};
