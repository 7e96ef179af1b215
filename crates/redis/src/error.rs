//! The one conversion of a Redis error into [`keyorder_core::Error`]
//! ([`broker`]), which names a group removed under a running member and
//! keeps ordering keys out of the text ([`scrub`]).

use keyorder_core::Error;

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
    Error::Broker(format!("redis: {}", scrub(&text)))
}

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
