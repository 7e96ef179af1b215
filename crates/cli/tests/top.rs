//! `keyorder top` in a real terminal (tmux) against a running subscription
//! on each real broker (issue 39, part 5): a subscription whose handler
//! fails one key as poison with the `Halt` policy runs in this process; the
//! view, started in tmux, must show every scope the broker reports with its
//! owner, the total lag the broker reports, and the halted key by its label
//! (never its value); the arrow keys scroll; `q` ends it with the terminal
//! restored (the alternate screen left, the line discipline back). The
//! colours go under `NO_COLOR`; with no terminal it refuses in one line, and
//! `--once` prints one plain snapshot. A missing broker fails the test.
//!
//! With `KEYORDER_TOP_SCREENSHOT=DIR` each broker's screen is written to
//! `DIR/<broker>.txt` (the README's screenshot comes from there).

#![cfg(feature = "all-adapters")]

use std::process::{Command, Output};
use std::time::Duration;

use keyorder::{Delivery, HandlerError, HandlerResult, KeySource, Message, OrderingKey, PoisonPolicy, RetryPolicy};
use keyorder_testkit::brokers::Broker;
use keyorder_testkit::until;

const DEADLINE: Duration = Duration::from_secs(90);

/// The key the handler fails: its value must never reach the screen.
const POISONED: &str = "customer-7731-secret";

/// A tmux server of this test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new(tag: &str) -> Tmux {
        Tmux {
            socket: format!("keyorder-top-{tag}-{}", std::process::id()),
        }
    }

    fn tmux(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .expect("tmux runs (apt-get install tmux; scripts/services installs it)")
    }

    /// Runs `script` in a new 200x50 window; when it ends the shell prints
    /// `__exit=<code>` and the terminal's line settings (`__stty=...`), and
    /// stays, so the screen can be read after the end.
    fn run(&self, script: &str) {
        let shell = format!(
            "{script}; echo __exit=$?; echo \"__stty=$(stty -a | tr ' ;' '\\n\\n' | grep -x -e '-*icanon' -e '-*echo' | tr '\\n' ,)\"; exec sleep 600"
        );
        let out = self.tmux(&["new-session", "-d", "-x", "200", "-y", "50", "sh", "-c", &shell]);
        assert!(out.status.success(), "tmux: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The visible screen as text.
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.tmux(&["capture-pane", "-p"]).stdout).into_owned()
    }

    /// The visible screen with its escape codes (`capture-pane -e`).
    fn screen_with_codes(&self) -> String {
        String::from_utf8_lossy(&self.tmux(&["capture-pane", "-p", "-e"]).stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let out = self.tmux(&[&["send-keys"][..], keys].concat());
        assert!(out.status.success(), "tmux: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn resize(&self, width: u16, height: u16) {
        let out = self.tmux(&["resize-window", "-x", &width.to_string(), "-y", &height.to_string()]);
        assert!(out.status.success(), "tmux: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Whether the pane is on the alternate screen.
    fn alternate(&self) -> bool {
        let out = self.tmux(&["display-message", "-p", "#{alternate_on}"]);
        String::from_utf8_lossy(&out.stdout).trim() == "1"
    }

    /// Polls the screen until `what` holds of it; the screen then.
    async fn wait(&self, what: &str, cond: impl Fn(&str) -> Result<(), String>) -> String {
        until(what, DEADLINE, async || {
            let s = self.screen();
            cond(&s)
                .map(|()| s.clone())
                .map_err(|e| format!("{e}; the screen:\n{s}"))
        })
        .await
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The answered polls the status line counts (`ok: 3 polls answered`).
fn polls(screen: &str) -> u64 {
    screen
        .lines()
        .find_map(|l| l.split("ok: ").nth(1)?.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Whether `screen` (from `capture-pane -e`) sets a foreground or
/// background colour anywhere (SGR 30-38, 40-48, 90-97, 100-107; 39 and 49
/// are the terminal's own colours).
fn has_colour(screen: &str) -> bool {
    screen.split("\u{1b}[").skip(1).any(|seq| {
        let Some(end) = seq.find('m') else { return false };
        let params = &seq[..end];
        params.chars().all(|c| c.is_ascii_digit() || c == ';')
            && params
                .split(';')
                .any(|p| matches!(p.parse::<u32>(), Ok(30..=38 | 40..=48 | 90..=97 | 100..=107)))
    })
}

/// The scopes and the halted key as another process's `Admin` reports
/// them once the view has something steady to show: one halted key, and
/// the same total lag (above 0) for a second.
async fn settled(admin: &dyn keyorder::Admin, category: &str) -> (Vec<keyorder::ScopeInfo>, keyorder::HaltedKey) {
    let mut since: Option<(u64, tokio::time::Instant)> = None;
    until(
        &format!("{category}: a halted key and a steady lag"),
        DEADLINE,
        async || {
            let halted = admin.halted(category, "g").await.map_err(|e| e.to_string())?;
            let scopes = admin.scopes(category, "g").await.map_err(|e| e.to_string())?;
            let lag: u64 = scopes.iter().map(|s| s.lag).sum();
            if halted.len() != 1 || lag == 0 {
                since = None;
                return Err(format!("halted {halted:?}, lag {lag}"));
            }
            match since {
                Some((l, t)) if l == lag && t.elapsed() >= Duration::from_secs(1) => Ok((scopes, halted[0].clone())),
                Some((l, _)) if l == lag => Err(format!("lag {lag}, steady for less than 1s")),
                _ => {
                    since = Some((lag, tokio::time::Instant::now()));
                    Err(format!("lag {lag}, just changed"))
                }
            }
        },
    )
    .await
}

async fn top_on(broker: Broker, url: &str) {
    let name = broker.name();
    let client = broker.require(url, keyorder::connect(url)).await;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let category = format!("top-{name}-{}-{}", std::process::id(), nanos % 1_000_000_000);
    let subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .poison(PoisonPolicy::Halt)
        .retry(RetryPolicy {
            max_attempts: 1,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        })
        .build()
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let stats = subscription.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(subscription.run(
        |d: Delivery| async move {
            if d.key().is_some_and(|k| k.as_str() == POISONED) {
                return Err(HandlerError::poison("refused by the test"));
            }
            HandlerResult::Ok(())
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let publisher = client.publisher(&category).await.unwrap();
    for i in 0..3 {
        for key in ["a", "b", "c", POISONED] {
            publisher
                .publish(Message::new(format!("{key}-{i}")).with_key(key).unwrap())
                .await
                .unwrap();
        }
    }
    until(&format!("{name}: 9 applied, 1 halted"), DEADLINE, async || {
        let s = stats.snapshot();
        (s.applied >= 9 && s.halted_now == 1)
            .then_some(())
            .ok_or_else(|| format!("{s:?}"))
    })
    .await;
    // More of the halted key: behind its head they are lag on every broker
    // (on RabbitMQ, once they overflow the consumers' prefetch window).
    for i in 3..43 {
        publisher
            .publish(Message::new(format!("held-{i}")).with_key(POISONED).unwrap())
            .await
            .unwrap();
    }
    // What another process sees, as `keyorder top` does.
    let observer = broker.require(url, keyorder::connect(url)).await;
    let (scopes, halted) = settled(observer.admin().as_ref(), &category).await;
    let lag: u64 = scopes.iter().map(|s| s.lag).sum();
    let label = OrderingKey::new(POISONED).unwrap().label();
    // A scope's row: the table's left border, then its name without the
    // `<category>/` every scope of the category starts with.
    let prefix = format!("{category}/");
    let row = |scope: &str| format!("│{} ", scope.strip_prefix(&prefix).unwrap_or(scope));
    let bin = env!("CARGO_BIN_EXE_keyorder");
    let args = [
        "top",
        "--url",
        url,
        "--category",
        &category,
        "--group",
        "g",
        "--interval",
        "300ms",
    ];
    let command = |env: &str| {
        let args: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
        format!(
            "env -u NO_COLOR -u KEYORDER_URL {env} {} {}",
            shell_quote(bin),
            args.join(" ")
        )
    };

    // The live view.
    let tmux = Tmux::new(name);
    tmux.run(&command(""));
    let screen = tmux
        .wait(&format!("{name}: the scopes, the halted key and the lag"), |s| {
            for want in [
                label.as_str(),
                &format!("scopes {} ", scopes.len()),
                &format!("lag {lag} "),
                "halted keys 1",
                "halted heads (1)",
                // A steady lag: no change between polls.
                "lag change +0.0/s",
                "net drain/s (fall in lag): now 0 ",
            ] {
                if !s.contains(want) {
                    return Err(format!("no {want:?}"));
                }
            }
            // The label in the halted heads' first row and the hot keys'
            // first row (on Redis a scope is named by its key's label too).
            let lines: Vec<&str> = s.lines().collect();
            for pane in ["halted heads (1)", " hot keys "] {
                let first = lines
                    .iter()
                    .position(|l| l.contains(pane))
                    .and_then(|top| lines.get(top + 2));
                if !first.is_some_and(|l| l.contains(&format!("││{label} "))) {
                    return Err(format!("{label} is not the first row of {pane:?}"));
                }
            }
            if polls(s) < 3 {
                return Err("fewer than 3 polls answered".into());
            }
            for scope in &scopes {
                let owner = scope.owner.as_deref().unwrap_or("-");
                if !s
                    .lines()
                    .any(|l| l.starts_with(&row(&scope.scope)) && l.contains(owner))
                {
                    return Err(format!("no row for {} owned by {owner}", scope.scope));
                }
            }
            Ok(())
        })
        .await;
    assert!(tmux.alternate(), "{name}: the view is not on the alternate screen");
    assert!(
        !screen.contains(POISONED),
        "{name}: the key's value is on the screen:\n{screen}"
    );
    assert_eq!(halted.label, label, "{name}: the broker's label");
    let first_row = screen
        .lines()
        .find(|l| scopes.iter().any(|s| l.starts_with(&row(&s.scope))))
        .unwrap();
    assert!(
        first_row.starts_with(&row(&halted.scope)),
        "{name}: the halted scope is not the first row:\n{screen}"
    );
    assert!(
        has_colour(&tmux.screen_with_codes()),
        "{name}: no colour on the terminal"
    );
    if let Ok(dir) = std::env::var("KEYORDER_TOP_SCREENSHOT") {
        // At a README's width, after a few more polls.
        tmux.resize(100, 17);
        let at = polls(&screen) + 5;
        let shot = tmux
            .wait(&format!("{name}: the screenshot"), |s| {
                (polls(s) >= at && s.lines().all(|l| l.chars().count() <= 100))
                    .then_some(())
                    .ok_or_else(|| "not redrawn yet".into())
            })
            .await;
        let shot: Vec<&str> = shot.lines().map(str::trim_end).collect();
        std::fs::write(
            std::path::Path::new(&dir).join(format!("{name}.txt")),
            shot.join("\n").trim_end(),
        )
        .unwrap();
        tmux.resize(200, 50);
    }
    // Scrolling: the last row, then one up.
    let n = scopes.len();
    tmux.keys(&["End"]);
    tmux.wait(&format!("{name}: End selects the last row"), |s| {
        s.contains(&format!("row {n} of {n}"))
            .then_some(())
            .ok_or_else(|| "not on the last row".into())
    })
    .await;
    if n > 1 {
        tmux.keys(&["k"]);
        tmux.wait(&format!("{name}: k moves up"), |s| {
            s.contains(&format!("row {} of {n}", n - 1))
                .then_some(())
                .ok_or_else(|| "not one row up".into())
        })
        .await;
    }
    tmux.keys(&["q"]);
    let after = tmux
        .wait(&format!("{name}: q ends the view"), |s| {
            s.contains("__stty=")
                .then_some(())
                .ok_or_else(|| "still running".into())
        })
        .await;
    assert!(after.contains("__exit=0"), "{name}: top failed:\n{after}");
    assert!(!tmux.alternate(), "{name}: still on the alternate screen");
    assert!(
        after.contains("__stty=icanon,echo,"),
        "{name}: the terminal was left raw:\n{after}"
    );
    assert!(
        !after.contains("halted heads"),
        "{name}: the view was left on the screen:\n{after}"
    );
    drop(tmux);

    // NO_COLOR: the same view without a colour; Esc ends it.
    let plain = Tmux::new(&format!("{name}-nocolor"));
    plain.run(&command("NO_COLOR=1"));
    plain
        .wait(&format!("{name}: the view under NO_COLOR"), |s| {
            s.contains(&label).then_some(()).ok_or_else(|| "no label".into())
        })
        .await;
    let codes = plain.screen_with_codes();
    assert!(!has_colour(&codes), "{name}: a colour under NO_COLOR:\n{codes:?}");
    plain.keys(&["Escape"]);
    let after = plain
        .wait(&format!("{name}: Esc ends the view"), |s| {
            s.contains("__stty=")
                .then_some(())
                .ok_or_else(|| "still running".into())
        })
        .await;
    assert!(after.contains("__exit=0"), "{name}: top failed:\n{after}");
    drop(plain);

    // No terminal: one line and exit code 1; `--once` prints a snapshot.
    let piped = |extra: &[&str]| {
        let (bin, args, extra) = (
            bin.to_owned(),
            args.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            extra.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        );
        tokio::task::spawn_blocking(move || {
            Command::new(bin)
                .args(args)
                .args(extra)
                .env_remove("KEYORDER_URL")
                .output()
                .expect("the keyorder binary runs")
        })
    };
    let refused = piped(&[]).await.unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{name}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{name}: {stderr}");
    assert!(stderr.contains("--once"), "{name}: {stderr}");
    let once = piped(&["--once"]).await.unwrap();
    let text = String::from_utf8_lossy(&once.stdout);
    assert!(
        once.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&once.stderr)
    );
    assert!(
        text.contains(&label) && text.contains("halted keys 1") && text.contains(&format!("lag {lag} ")),
        "{name}: --once:\n{text}"
    );
    assert!(
        !text.contains('\u{1b}') && !text.contains(POISONED),
        "{name}: --once:\n{text:?}"
    );

    let _ = stop.send(());
    run.await.unwrap().unwrap_or_else(|e| panic!("{name}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let url = format!("{}?migrate=true&slots=4", Broker::Postgres.url());
    top_on(Broker::Postgres, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    top_on(Broker::Redis, &Broker::Redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    let url = format!(
        "{}?topology=hash&queues=2&queue_type=classic&expires_ms=600000&consumer_timeout_ms=3600000",
        Broker::RabbitMq.url()
    );
    top_on(Broker::RabbitMq, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    let url = format!("kafka://{}?partitions=2&fetch_wait_ms=10", Broker::Kafka.url());
    top_on(Broker::Kafka, &url).await;
}

/// Runs `top` with `url` in `tmux`; `q` ends it later.
fn start_top(tmux: &Tmux, url: &str, category: &str) {
    tmux.run(&format!(
        "env -u KEYORDER_URL {} top --url {} --category {} --group g --interval 300ms",
        shell_quote(env!("CARGO_BIN_EXE_keyorder")),
        shell_quote(url),
        shell_quote(category)
    ));
}

/// `key` (`q`, `C-c`), then the exit code 0 and a restored terminal.
async fn quit(tmux: &Tmux, key: &str, what: &str) {
    tmux.keys(&[key]);
    let after = tmux
        .wait(&format!("{what}: {key} ends the view"), |s| {
            s.contains("__stty=")
                .then_some(())
                .ok_or_else(|| "still running".into())
        })
        .await;
    assert!(after.contains("__exit=0"), "{what}: top failed:\n{after}");
    assert!(after.contains("__stty=icanon,echo,"), "{what}: left raw:\n{after}");
    assert!(!tmux.alternate(), "{what}: still on the alternate screen");
}

/// A broker that does not answer when the view starts: the view starts
/// anyway, says why in its status line and keeps retrying; Ctrl-C ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_retried_on_screen() {
    let tmux = Tmux::new("unreachable");
    start_top(&tmux, "redis://127.0.0.1:1", "c");
    let screen = tmux
        .wait("the error, retried", |s| {
            let retried = s.lines().any(|l| {
                l.starts_with("error (")
                    && l.contains("in a row, retrying every 0.3s)")
                    && !l.starts_with("error (1 in a row")
                    && !l.starts_with("error (2 in a row")
            });
            retried.then_some(()).ok_or_else(|| "not retried 3 times".into())
        })
        .await;
    assert!(
        screen.to_lowercase().contains("refused"),
        "the cause is shown:\n{screen}"
    );
    quit(&tmux, "C-c", "unreachable").await;
}

/// A broker lost while the view runs (PostgreSQL behind a fault proxy that
/// resets the connections and then forwards nothing): the last answer stays
/// on screen with the error and its age, and once the broker is back the
/// view is current again; it never exits on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_broker_shows_in_the_status_line_and_the_view_recovers() {
    let url = format!("{}?migrate=true&slots=4", Broker::Postgres.url());
    let client = Broker::Postgres.require(&url, keyorder::connect(&url)).await;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let category = format!("top-lost-{}-{}", std::process::id(), nanos % 1_000_000_000);
    let subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        subscription.run(|_d: Delivery| async move { HandlerResult::Ok(()) }, async move {
            let _ = stopped.await;
        }),
    );
    let mut via = url::Url::parse(&url).unwrap();
    let upstream = format!("{}:{}", via.host_str().unwrap(), via.port().unwrap_or(5432));
    let upstream = tokio::net::lookup_host(&upstream).await.unwrap().next().unwrap();
    let proxy = keyorder_testkit::proxy::FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream)
        .await
        .unwrap();
    via.set_host(Some("127.0.0.1")).unwrap();
    via.set_port(Some(proxy.addr().port())).unwrap();

    let tmux = Tmux::new("lost");
    start_top(&tmux, via.as_str(), &category);
    let owned = |s: &str| s.contains("scopes 4 (owned 4, unowned 0)");
    tmux.wait("the scopes through the proxy", |s| {
        (owned(s) && polls(s) >= 1)
            .then_some(())
            .ok_or_else(|| "no scopes yet".into())
    })
    .await;
    proxy.blackhole(true);
    proxy.cut();
    let lost = tmux
        .wait("the lost broker in the status line", |s| {
            (s.contains("error (") && s.contains("showing the answer of") && owned(s))
                .then_some(())
                .ok_or_else(|| "no error with the last answer".into())
        })
        .await;
    assert!(tmux.alternate(), "the view exited:\n{lost}");
    proxy.blackhole(false);
    tmux.wait("the view current again", |s| {
        (s.lines().any(|l| l.starts_with("ok: ")) && owned(s))
            .then_some(())
            .ok_or_else(|| "still failing".into())
    })
    .await;
    quit(&tmux, "q", "lost broker").await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}
