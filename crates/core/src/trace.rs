//! Trace context across the broker (W3C Trace Context).
//!
//! With the feature `otel`, [`crate::Publisher::publish`] and
//! [`crate::Publisher::publish_fenced`] put the OpenTelemetry context of the
//! current `tracing` span (as `tracing-opentelemetry` sees it) in the
//! message's [`TRACEPARENT_HEADER`] and, when it is not empty,
//! [`TRACESTATE_HEADER`] headers, on every transport; the consumer's
//! `keyorder.delivery` span (level `INFO`) takes the context in those
//! headers as its parent. A message that already carries a
//! [`TRACEPARENT_HEADER`] keeps it (the outbox relay publishes the context
//! of the transaction that staged the record, not its own). A foreign
//! producer continues its trace in keyorder's consumers by sending the same
//! two headers, in the W3C format (`00-<trace id>-<span id>-<flags>`).
//!
//! Without the feature nothing is added or read, and the build has no
//! OpenTelemetry dependency; the header names are here either way.

/// The W3C `traceparent` header: version, trace id, parent span id and
/// flags of the producer's span (`00-<32 hex>-<16 hex>-<2 hex>`).
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The W3C `tracestate` header: vendor-specific trace state, sent beside
/// [`TRACEPARENT_HEADER`] when the producer's context has any.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// The headers that carry the current `tracing` span's OpenTelemetry
/// context ([`TRACEPARENT_HEADER`], and [`TRACESTATE_HEADER`] when it is
/// not empty), for a producer that builds a message's headers itself (the
/// outbox stores them with a staged record).
///
/// Empty without the feature `otel`, when no `tracing-opentelemetry`
/// layer is installed, or when the current span has no valid context (no
/// span, or one a filter disabled).
pub fn current_context() -> Vec<(&'static str, String)> {
    #[cfg(feature = "otel")]
    {
        otel::current()
    }
    #[cfg(not(feature = "otel"))]
    {
        Vec::new()
    }
}

/// Whether `headers` carry a trace context to keep: a [`TRACEPARENT_HEADER`]
/// (its name in any case) that parses as a valid W3C context. An invalid
/// one is no context: a publish replaces it with the current span's.
/// Without the feature `otel`, whether the header is there.
pub fn carries_context(headers: &std::collections::BTreeMap<String, String>) -> bool {
    #[cfg(feature = "otel")]
    {
        otel::carries(headers)
    }
    #[cfg(not(feature = "otel"))]
    {
        headers.keys().any(|k| k.eq_ignore_ascii_case(TRACEPARENT_HEADER))
    }
}

/// Replaces the trace context headers in `headers` (their names in any
/// case) with `context`, when it has any (as [`current_context`] gives it);
/// leaves them as they are otherwise.
pub fn replace_context(headers: &mut std::collections::BTreeMap<String, String>, context: Vec<(&'static str, String)>) {
    if context.is_empty() {
        return;
    }
    headers.retain(|k, _| !k.eq_ignore_ascii_case(TRACEPARENT_HEADER) && !k.eq_ignore_ascii_case(TRACESTATE_HEADER));
    for (name, value) in context {
        headers.insert(name.to_owned(), value);
    }
}

/// Makes `span` a child of the context `headers` carry (a valid
/// [`TRACEPARENT_HEADER`]); leaves it as it is otherwise, or without the
/// feature `otel`.
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub(crate) fn continue_from(span: &tracing::Span, headers: &std::collections::BTreeMap<String, String>) {
    #[cfg(feature = "otel")]
    otel::continue_from(span, headers);
}

#[cfg(feature = "otel")]
mod otel {
    use std::collections::{BTreeMap, HashMap};

    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry::Context;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{TRACEPARENT_HEADER, TRACESTATE_HEADER};

    pub(super) fn current() -> Vec<(&'static str, String)> {
        let span = tracing::Span::current();
        if span.is_disabled() {
            return Vec::new();
        }
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return Vec::new();
        }
        let mut carrier: HashMap<String, String> = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        let mut out = Vec::with_capacity(2);
        if let Some(parent) = carrier.remove(TRACEPARENT_HEADER) {
            out.push((TRACEPARENT_HEADER, parent));
            if let Some(state) = carrier.remove(TRACESTATE_HEADER).filter(|s| !s.is_empty()) {
                out.push((TRACESTATE_HEADER, state));
            }
        }
        out
    }

    /// The delivery's headers as the propagator reads them.
    struct Headers<'a>(&'a BTreeMap<String, String>);

    impl Extractor for Headers<'_> {
        /// The header named `key`, or one whose name differs only in case
        /// (a foreign producer's `Traceparent`).
        fn get(&self, key: &str) -> Option<&str> {
            self.0
                .get(key)
                .or_else(|| self.0.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)).map(|(_, v)| v))
                .map(String::as_str)
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    /// The context the headers carry, on an empty context: `extract`
    /// alone falls back to the current one (the publisher's own span,
    /// where `tracing-opentelemetry` activates it), which would pass an
    /// invalid header for a valid one.
    fn extracted(headers: &Headers<'_>) -> Context {
        TraceContextPropagator::new().extract_with_context(&Context::new(), headers)
    }

    pub(super) fn carries(headers: &BTreeMap<String, String>) -> bool {
        let h = Headers(headers);
        h.get(TRACEPARENT_HEADER).is_some() && extracted(&h).span().span_context().is_valid()
    }

    pub(super) fn continue_from(span: &tracing::Span, headers: &BTreeMap<String, String>) {
        if span.is_disabled() || Headers(headers).get(TRACEPARENT_HEADER).is_none() {
            return;
        }
        let cx = extracted(&Headers(headers));
        if cx.span().span_context().is_valid() {
            // Fails only when the span is already closed or has no
            // OpenTelemetry layer: then there is nothing to link.
            let _ = span.set_parent(cx);
        }
    }
}
