//! The one conversion of a Redis error into [`keyorder_core::Error`]
//! ([`broker`]), which names a group removed under a running member, says
//! whether retrying can help (the driver's own retry advice: a dropped
//! connection, a timeout, `LOADING`, `TRYAGAIN` are temporary; a script's
//! refusal, a wrong type or a failed authentication are not), keeps the
//! driver's error as the source, and keeps ordering keys out of the text
//! and the source ([`scrub`]). The orphan rule rules out `impl From<RedisError>
//! for Error` here (both are foreign), so this function is the one conversion.

use keyorder_core::{BrokerError, Error};

use crate::scripts;

pub(crate) fn broker(e: redis::RedisError) -> Error {
    let text = e.to_string();
    if text.contains(scripts::GROUP_REMOVED) {
        return Error::Config(
            "redis: this member's consumer group was removed by an operator (`keyorder groups remove`) while it ran; \
             it stops: subscribe again to start the group afresh"
                .into(),
        );
    }
    Error::Broker(with_cause(BrokerError::new(format!("redis: {}", scrub(&text))), e))
}

/// `b` with the driver's error `e` as its source and `e`'s answer to
/// whether retrying can help (the driver's own retry advice: a dropped
/// connection, a timeout, `LOADING`, `TRYAGAIN` are temporary; a script's
/// refusal, a wrong type, a failed authentication are not). Where `e`'s
/// text names a key (user data), the source is the scrubbed text instead,
/// never the driver's error, whose text and `Debug` carry the key.
pub(crate) fn with_cause(b: BrokerError, e: redis::RedisError) -> BrokerError {
    // `BUSY` (a script running), `OOM`, `MISCONF` (a failed save) and
    // `LOADING` clear on their own; redis-rs gives no retry advice for the
    // first three (extension errors).
    let clears = matches!(e.code(), Some("BUSY" | "OOM" | "MISCONF" | "LOADING"));
    let temporary = clears
        || (!matches!(e.retry_method(), redis::RetryMethod::NoRetry)
            && !matches!(e.kind(), redis::ErrorKind::AuthenticationFailed));
    let text = e.to_string();
    let scrubbed = scrub(&text);
    let b = b.with_temporary(temporary);
    if scrubbed == text {
        b.caused_by(e)
    } else {
        b.caused_by(Scrubbed(scrubbed))
    }
}

/// A Redis error whose text named a key, with the key replaced by its label
/// ([`scrub`]): what [`broker`] keeps as the source instead of the driver's
/// error.
#[derive(Debug)]
struct Scrubbed(String);

impl std::fmt::Display for Scrubbed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Scrubbed {}

/// Redis names keys in its error texts in single quotes (`No such key
/// '{c}:{k}'`); a key name carries an ordering key, which is user data and
/// may itself hold quotes, so everything from the first quote to the last
/// is replaced by one label before the text reaches a log or an [`Error`].
pub(crate) fn scrub(text: &str) -> String {
    let Some(first) = text.find('\'') else {
        return text.to_owned();
    };
    let last = text.rfind('\'').filter(|&l| l > first).unwrap_or(text.len());
    let inner = &text[first + 1..last];
    let rest = text.get(last + 1..).unwrap_or("");
    format!("{}'{}'{rest}", &text[..first], keyorder_core::key::label(inner))
}

#[cfg(test)]
mod scrub_tests {
    #[test]
    fn quoted_names_in_redis_errors_become_labels() {
        let text = "NOGROUP No such key 'orders:customer-42' or consumer group 'g' in XREADGROUP";
        let out = super::scrub(text);
        assert!(!out.contains("customer-42"), "{out}");
        assert!(
            out.starts_with("NOGROUP No such key 'k#") && out.ends_with("' in XREADGROUP"),
            "{out}"
        );
        assert_eq!(super::scrub("no quotes"), "no quotes");
        // A key holding quotes leaks nothing either.
        let out = super::scrub("No such key 'c:x'SECRET-4711' or consumer group 'g' in XREADGROUP");
        assert!(!out.contains("SECRET"), "{out}");
        let out = super::scrub("one 'SECRET quote");
        assert!(!out.contains("SECRET"), "{out}");
    }
}
