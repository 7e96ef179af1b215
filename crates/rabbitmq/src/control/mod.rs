//! Halted heads and hot keys across processes. A RabbitMQ halt lives in
//! the consumer that halted the key (its head stays unacknowledged on that
//! consumer's channel), and a key's held deliveries live in the consumers
//! that hold them, so an operator in another process (`keyorder head ...`,
//! `keyorder hot-keys`) asks the consumers: requests go to the topic
//! exchange [`CONTROL_EXCHANGE`] with the group's base name
//! `{category}:{group}` as routing key; every process consuming the
//! (category, group) pair (from its first source on) or holding a halt in
//! it has an exclusive queue bound there and answers on the
//! request's `reply_to` queue. `show` and `hot` gather the answers for a
//! short window; `skip`, `dlq` and `resume` run in the process that holds
//! the head and return once it answered. A request that no process is
//! bound to receive comes back unroutable at once (nobody consumes the
//! group). Keys travel in requests (as the operator typed them, or a
//! label); answers carry labels and redacted previews only.

// `ask` is the operator's side (sending a request and gathering the
// answers), `respond` the consumers' side (answering for their groups).
mod ask;
mod respond;

pub use crate::names::CONTROL_EXCHANGE;
