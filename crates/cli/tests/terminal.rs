//! The CLI respects the terminal (issue 39, part 7): a user error is one
//! line on standard error and exit code 1, never a backtrace; log colours
//! and progress bars appear only on a terminal (checked in a real one,
//! tmux), never in a pipe, never on standard output, and not under
//! `NO_COLOR` or `--json`.

use std::process::{Command, Output};
use std::time::Duration;

/// A demo that ends at once: one instance, 4 keys, 40 messages.
const SMALL_DEMO: [&str; 11] = [
    "demo",
    "--url",
    "memory://",
    "--instances",
    "1",
    "--keys",
    "4",
    "--messages",
    "40",
    "--max-handler-ms",
    "0",
];

fn keyorder(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keyorder"));
    cmd.args(args)
        .env_remove("KEYORDER_URL")
        .env_remove("NO_COLOR")
        .env_remove("KEYORDER_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the keyorder binary runs")
}

/// Exit code 1 and exactly one line on standard error, `error: ...`, with
/// no backtrace even when `RUST_BACKTRACE` asks for one.
fn assert_one_line_error(what: &str, out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{what}: exit code; stderr: {stderr:?}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{what}: one line on stderr: {stderr:?}");
    assert_eq!(stderr.lines().count(), 1, "{what}: no blank lines either: {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{what}: {stderr:?}");
    let lower = stderr.to_lowercase();
    assert!(
        !lower.contains("backtrace") && !lower.contains("caused by") && !lower.contains("panicked"),
        "{what}: {stderr:?}"
    );
    assert!(
        out.stdout.is_empty(),
        "{what}: nothing on stdout: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    lines[0].to_owned()
}

const BACKTRACE: [(&str, &str); 2] = [("RUST_BACKTRACE", "1"), ("RUST_LIB_BACKTRACE", "1")];

#[test]
fn an_unknown_url_scheme_is_one_line_and_exit_code_1() {
    let out = keyorder(
        &[
            "scopes",
            "--url",
            "nosuch://127.0.0.1:1",
            "--category",
            "c",
            "--group",
            "g",
        ],
        &BACKTRACE,
    );
    let line = assert_one_line_error("unknown scheme", &out);
    assert!(line.contains("nosuch"), "the message names the scheme: {line:?}");
}

/// A refused connection: the error and its causes on one line, joined by
/// `": "`.
#[cfg(feature = "all-adapters")]
#[test]
fn an_unreachable_broker_is_one_line_with_its_causes() {
    let out = keyorder(
        &[
            "scopes",
            "--url",
            "redis://127.0.0.1:1",
            "--category",
            "c",
            "--group",
            "g",
        ],
        &BACKTRACE,
    );
    let line = assert_one_line_error("unreachable redis", &out);
    assert!(line.contains(": "), "its causes joined: {line:?}");
    assert!(
        line.to_lowercase().contains("refused"),
        "the root cause is there: {line:?}"
    );
}

/// An unreachable Kafka broker is the same one line: librdkafka's own log
/// of each failed connection attempt does not flood standard error.
#[cfg(feature = "all-adapters")]
#[test]
fn an_unreachable_kafka_broker_is_one_line() {
    let out = keyorder(
        &[
            "scopes",
            "--url",
            "kafka://127.0.0.1:1",
            "--category",
            "c",
            "--group",
            "g",
        ],
        &BACKTRACE,
    );
    let line = assert_one_line_error("unreachable kafka", &out);
    assert!(line.contains("kafka"), "{line:?}");
}

/// A refusal of the CLI's own (no `--yes`) is the same one line.
#[test]
fn a_refusal_is_one_line_and_exit_code_1() {
    let out = keyorder(
        &["delete-queue", "--url", "memory://", "--category", "orders"],
        &BACKTRACE,
    );
    let line = assert_one_line_error("delete-queue without --yes", &out);
    assert!(line.contains("--yes"), "{line:?}");
}

/// A usage error stays clap's: its usage text and exit code 2.
#[test]
fn a_usage_error_is_clap_s_with_exit_code_2() {
    let out = keyorder(&["scopes", "--no-such-flag"], &BACKTRACE);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr:?}");
    assert!(
        stderr.contains("Usage:") && stderr.contains("--no-such-flag"),
        "{stderr:?}"
    );
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr:?}");
}

/// A command that logs and shows progress, its standard error piped: log
/// lines without one escape code and no progress bar, on either stream.
#[test]
fn a_pipe_gets_plain_logs_and_no_progress() {
    let out = keyorder(&SMALL_DEMO, &[("KEYORDER_LOG", "debug")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("DEBUG"), "the run logged: {stderr}");
    assert!(
        !out.stderr.contains(&0x1b),
        "an escape code in piped stderr: {stderr:?}"
    );
    assert!(!out.stdout.contains(&0x1b), "an escape code in stdout: {stdout:?}");
    for text in [&stderr, &stdout] {
        assert!(!text.contains("applied ["), "a progress bar in a pipe: {text:?}");
    }
    assert!(stdout.contains("violations=0 lost=0"), "{stdout}");
}

/// `--json`: the result is the last line on stdout, one JSON object.
#[test]
fn demo_json_is_one_object_on_the_last_line() {
    let out = keyorder(&[&SMALL_DEMO[..], &["--json"]].concat(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().expect("a line on stdout");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last line is JSON");
    assert_eq!(v["messages"], 40, "{v}");
    assert_eq!(v["violations"], 0, "{v}");
    assert_eq!(v["lost"], 0, "{v}");
    assert!(v["msgs_per_s"].as_f64().is_some_and(|r| r > 0.0), "{v}");
}

/// A tmux server of this test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new(tag: &str) -> Tmux {
        let socket = format!("keyorder-cli-{tag}-{}", std::process::id());
        Tmux { socket }
    }

    fn tmux(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .expect("tmux runs (apt-get install tmux)")
    }

    /// Runs `script` in a new 200x50 window; the shell then prints
    /// `__exit=<code>` and stays, so the screen can be read after the end.
    fn run(&self, script: &str) {
        let shell = format!("{script}; echo __exit=$?; exec sleep 600");
        let out = self.tmux(&["new-session", "-d", "-x", "200", "-y", "50", "sh", "-c", &shell]);
        assert!(out.status.success(), "tmux: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The screen and its scroll-back, with escape codes (`capture-pane -e`).
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.tmux(&["capture-pane", "-p", "-e", "-S", "-"]).stdout).into_owned()
    }

    /// Polls the screen until the command has ended; the screen then.
    async fn finished(&self) -> String {
        keyorder_testkit::until("the command in tmux to end", Duration::from_secs(120), async || {
            let s = self.screen();
            s.contains("__exit=").then_some(s)
        })
        .await
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

fn tmux_available() -> bool {
    Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// In a real terminal: `bench` draws its progress on the terminal
/// (standard error) while its standard output, sent to a file, holds only
/// the result; the log lines are coloured; with `NO_COLOR` they are not;
/// with `--json` no progress is drawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_gets_progress_and_colours_unless_told_otherwise() {
    assert!(tmux_available(), "tmux is needed for this test (apt-get install tmux)");
    let dir = std::env::temp_dir().join(format!("keyorder-cli-terminal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = shell_quote(env!("CARGO_BIN_EXE_keyorder"));
    let bench = "bench --url memory:// --keys 4 --messages 400 --instances 1 --probes 0 --handler-ms 1";
    let cases = [("plain", ""), ("nocolor", "NO_COLOR=1"), ("json", "")];
    for (tag, env) in cases {
        let json = if tag == "json" { " --json" } else { "" };
        let stdout = dir.join(format!("{tag}.out"));
        let tmux = Tmux::new(tag);
        tmux.run(&format!(
            "env -u NO_COLOR KEYORDER_LOG=debug {env} {bin} {bench}{json} > {}",
            shell_quote(&stdout.to_string_lossy())
        ));
        let screen = tmux.finished().await;
        let out = std::fs::read_to_string(&stdout).unwrap();
        assert!(screen.contains("__exit=0"), "{tag}: the run failed: {screen}");
        assert!(!out.contains('\u{1b}'), "{tag}: an escape code on stdout: {out:?}");
        assert!(
            !out.contains("consumed [") && !out.contains("published ["),
            "{tag}: progress on stdout: {out:?}"
        );
        assert!(
            out.contains("ratio (ordered/baseline)"),
            "{tag}: the result on stdout: {out:?}"
        );
        assert!(
            screen.contains("DEBUG"),
            "{tag}: the run logged on the terminal: {screen}"
        );
        let progress = screen.contains("consumed [") && screen.contains("400/400");
        let coloured = screen.lines().any(|l| l.contains("DEBUG") && l.contains("\u{1b}["));
        match tag {
            "plain" => {
                assert!(progress, "plain: no progress bar on the terminal: {screen}");
                assert!(coloured, "plain: no colour on the terminal: {screen:?}");
            }
            "nocolor" => {
                assert!(progress, "nocolor: no progress bar on the terminal: {screen}");
                assert!(!coloured, "nocolor: colours under NO_COLOR: {screen:?}");
            }
            _ => {
                assert!(
                    !progress && !screen.contains("consumed ["),
                    "json: progress drawn: {screen}"
                );
                let last = out.lines().last().unwrap_or_default();
                assert!(
                    serde_json::from_str::<serde_json::Value>(last).is_ok(),
                    "json: the last stdout line is JSON: {out:?}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `failover --json` on the real PostgreSQL server (its event log there
/// too): the takeover's time and the checker's verdict as the last line.
#[cfg(feature = "all-adapters")]
#[test]
fn failover_json_reports_the_takeover() {
    let url = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let out = keyorder(
        &[
            "failover",
            "--url",
            &url,
            "--keys",
            "4",
            "--ttl-ms",
            "2000",
            "--heartbeat-ms",
            "500",
            "--margin-ms",
            "600",
            "--json",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().expect("a line on stdout");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last line is JSON");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(
        (v["lost"].as_u64(), v["violations"].as_u64()),
        (Some(0), Some(0)),
        "{v}"
    );
    // The dead owner's lease (2 s) must run out before the takeover.
    let ms = v["failover_ms"].as_f64().expect("failover_ms");
    assert!((500.0..60_000.0).contains(&ms), "{v}");
    assert!(!out.stderr.contains(&0x1b), "an escape code in piped stderr");
}

/// A demo on RabbitMQ that keeps the promise logs no error: the channels
/// the adapter closes on purpose (passive checks, probes of other
/// instances' exclusive queues) are not errors, though lapin logs each at
/// ERROR.
#[test]
fn a_clean_demo_on_rabbitmq_logs_no_error() {
    let base = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let url = format!("{base}?topology=hash&queues=8");
    let out = keyorder(
        &[
            "demo",
            "--url",
            &url,
            "--instances",
            "3",
            "--keys",
            "50",
            "--messages",
            "2000",
            "--max-handler-ms",
            "1",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "exit code; stderr: {stderr}");
    assert!(
        stdout.contains("violations=0 lost=0"),
        "the demo kept the promise: {stdout}"
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(
        errors.is_empty(),
        "{} error lines on a clean run, the first: {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
}
