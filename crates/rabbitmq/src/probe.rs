//! The broker's version, from the server properties of its
//! `connection.start` (the AMQP client keeps none): a TCP handshake that
//! reads the first frame and hangs up.
//!
//! It decides how an ordered consumer keeps RabbitMQ's `consumer_timeout`
//! from redelivering a halted head: from 3.11.15 on a consumer sets its own
//! (`x-consumer-timeout`); before, the broker's setting must be stated.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The first RabbitMQ release with per-consumer `x-consumer-timeout`.
pub(crate) const PER_CONSUMER_TIMEOUT_SINCE: (u32, u32, u32) = (3, 11, 15);

/// The largest `connection.start` frame read (RabbitMQ's is under 1 KiB).
const MAX_FRAME: usize = 64 * 1024;

/// The `version` server property of the broker at `host:port`, or `None`
/// when it cannot be read (no answer in 5 s, not AMQP 0-9-1, no such
/// property).
pub(crate) async fn server_version(host: &str, port: u16) -> Option<String> {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = TcpStream::connect((host, port)).await.ok()?;
        s.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        let mut head = [0u8; 7];
        s.read_exact(&mut head).await.ok()?;
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        if head[0] != 1 || size > MAX_FRAME {
            return None;
        }
        let mut payload = vec![0u8; size];
        s.read_exact(&mut payload).await.ok()?;
        version_of_start(&payload)
    })
    .await
    .ok()
    .flatten()
}

/// The `version` property of a `connection.start` method payload.
pub(crate) fn version_of_start(payload: &[u8]) -> Option<String> {
    // class 10, method 10, version-major, version-minor, server-properties.
    if payload.get(..4)? != [0, 10, 0, 10] {
        return None;
    }
    let mut r = Reader(payload.get(6..)?);
    let table = r.take_long()?;
    let mut t = Reader(table);
    while !t.0.is_empty() {
        let name_len = *t.take(1)?.first()? as usize;
        let name = t.take(name_len)?;
        let kind = *t.take(1)?.first()?;
        if name == b"version" && kind == b'S' {
            return String::from_utf8(t.take_long()?.to_vec()).ok();
        }
        t.skip_value(kind)?;
    }
    None
}

/// Whether a broker of `version` takes `x-consumer-timeout` per consumer.
pub(crate) fn per_consumer_timeout(version: &str) -> bool {
    parse_version(version).is_some_and(|v| v >= PER_CONSUMER_TIMEOUT_SINCE)
}

/// `major.minor.patch`, ignoring a pre-release or build suffix.
fn parse_version(version: &str) -> Option<(u32, u32, u32)> {
    let mut parts = version.split('.').map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// A bounds-checked cursor over field-table bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    /// A 32-bit length and that many bytes.
    fn take_long(&mut self) -> Option<&'a [u8]> {
        let len = self.take(4)?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        self.take(len)
    }

    fn skip_value(&mut self, kind: u8) -> Option<()> {
        let fixed = match kind {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'S' | b'x' | b'A' | b'F' => return self.take_long().map(|_| ()),
            _ => return None,
        };
        self.take(fixed).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(bytes: &[u8]) -> Vec<u8> {
        let mut v = (bytes.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(bytes);
        v
    }

    fn entry(name: &str, kind: u8, value: &[u8]) -> Vec<u8> {
        let mut v = vec![name.len() as u8];
        v.extend_from_slice(name.as_bytes());
        v.push(kind);
        v.extend_from_slice(value);
        v
    }

    fn start(props: &[Vec<u8>]) -> Vec<u8> {
        let mut p = vec![0, 10, 0, 10, 0, 9];
        p.extend(long(&props.concat()));
        p.extend(long(b"PLAIN AMQPLAIN"));
        p.extend(long(b"en_US"));
        p
    }

    #[test]
    fn reads_the_version_after_other_properties() {
        let caps = [entry("publisher_confirms", b't', &[1]), entry("x", b'l', &[0; 8])].concat();
        let payload = start(&[
            entry("capabilities", b'F', &long(&caps)),
            entry("cluster_name", b'S', &long(b"rabbit@host")),
            entry("copyright", b'S', &long(b"(c)")),
            entry("version", b'S', &long(b"3.10.8")),
        ]);
        assert_eq!(version_of_start(&payload).as_deref(), Some("3.10.8"));
    }

    #[test]
    fn bad_input_is_none_not_a_panic() {
        let good = start(&[entry("version", b'S', &long(b"3.12.1"))]);
        for cut in 0..good.len() {
            let _ = version_of_start(&good[..cut]);
        }
        // The table cut short (the mechanisms and locales follow it: 27 bytes).
        assert_eq!(version_of_start(&good[..good.len() - 29]), None);
        assert_eq!(version_of_start(&start(&[entry("v", b'?', &[])])), None);
        assert_eq!(version_of_start(&[0, 10, 0, 11, 0, 9, 0, 0, 0, 0]), None);
    }

    #[test]
    fn per_consumer_timeouts_from_3_11_15() {
        for (v, yes) in [
            ("3.10.8", false),
            ("3.11.14", false),
            ("3.11.15", true),
            ("3.12.0", true),
            ("3.13.0-rc.2", true),
            ("4.0.5", true),
            ("4", true),
            ("garbage", false),
        ] {
            assert_eq!(per_consumer_timeout(v), yes, "{v}");
        }
    }
}
