//! Keeping secrets and forged text out of logs, errors, `Debug` output and
//! terminals.
//!
//! * [`url()`]: a connection URL with its password and every query value
//!   replaced (query options may hold secrets: `sslpassword=`,
//!   `rdkafka.sasl.password=`), for `Debug` and messages.
//! * [`text()`]: a string from the broker or a message (an id, a reason, a
//!   header) escaped so that no control character, escape sequence or line
//!   break in it reaches a log line or an operator's terminal as such.
//!
//! ```
//! use keyorder_core::redact;
//!
//! let shown = redact::url("amqps://app:s3cret@mq.internal:5671/prod?sslpassword=hunter2");
//! assert!(!shown.contains("s3cret") && !shown.contains("hunter2"));
//! assert_eq!(shown, "amqps://app:***@mq.internal:5671/prod?sslpassword=***");
//!
//! assert_eq!(redact::text("id\n\u{1b}]8;;evil\u{7}"), "id\\n\\u{1b}]8;;evil\\u{7}");
//! ```

/// `raw` with its password and every query value replaced by `***`; a
/// value that is no URL is replaced as a whole (it may be one with a
/// secret that failed to parse).
pub fn url(raw: &str) -> String {
    let Ok(mut parsed) = ::url::Url::parse(raw) else {
        return "<unparsable URL>".to_owned();
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("***"));
    }
    if parsed.query().is_some() {
        let keys: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
        let mut pairs = parsed.query_pairs_mut();
        pairs.clear();
        for k in keys {
            pairs.append_pair(&k, "***");
        }
        drop(pairs);
    }
    // `***` is left unescaped in what is shown.
    parsed.to_string().replace("%2A%2A%2A", "***")
}

/// `value` with every control character (C0, DEL, C1: ESC, CR, LF, BEL...),
/// line separator and bidirectional mark written as an escape (`\n`,
/// `\u{1b}`), and backslashes and double quotes escaped, so the result is
/// one line that cannot move a terminal's cursor, set its title, reorder
/// what is shown, or, printed between double quotes, end its field and
/// forge another. Other characters are kept.
pub fn text(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c if c.is_control() => out.extend(c.escape_default()),
            // Bidirectional controls and marks reorder what a terminal
            // shows; line and paragraph separators break a line.
            '\u{61c}'
            | '\u{200e}'
            | '\u{200f}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}' => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    out
}

/// [`text`] between double quotes: a field value of one line that nothing
/// in it can end early.
pub fn quoted(value: &str) -> String {
    format!("\"{}\"", text(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_hides_password_and_option_values() {
        for (raw, secret) in [
            ("postgres://u:pw1@h:5432/db?sslpassword=pw2&schema=x", ["pw1", "pw2"]),
            ("redis://:pw1@h:6379/0?x=pw2", ["pw1", "pw2"]),
            ("kafka://h:9092?rdkafka.sasl.password=pw1&rdkafka.x=pw2", ["pw1", "pw2"]),
        ] {
            let shown = url(raw);
            for s in secret {
                assert!(!shown.contains(s), "{shown}");
            }
        }
        assert_eq!(url("not a url pw1"), "<unparsable URL>");
        assert_eq!(url("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn text_is_one_inert_line() {
        let shown = text("a\r\nb\u{1b}[2J\u{9b}c\u{7}\\\u{202e}\u{2028}\u{200f}");
        assert!(
            !shown
                .chars()
                .any(|c| c.is_control() || matches!(c, '\u{202e}' | '\u{2028}' | '\u{200f}')),
            "{shown:?}"
        );
        assert_eq!(text("plain ключ"), "plain ключ");
        // A quoted field cannot be ended early to forge another.
        assert_eq!(quoted("m-1\" reason=\"ok"), "\"m-1\\\" reason=\\\"ok\"");
    }
}
