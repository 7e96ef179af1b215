//! `keyorder top`: a live view of a consumer group in the terminal, over
//! the `Admin` trait, so on every transport.
//!
//! A poller task asks the broker every `--interval` for the scopes, the
//! halted heads and the hot keys (each call bounded to [`CALL_LIMIT`]) and
//! hands the answers to the [`model::Model`]; the screen is drawn from the
//! model by [`view::render`] after every answer and every key. A failed
//! poll keeps the last answer on screen, says why in the status line and is
//! retried at the next tick (after three failures in a row, with a new
//! connection). The terminal is restored on `q`, `Esc`, `Ctrl-C`,
//! `SIGTERM`, an error and a panic (ratatui's panic hook).

mod model;
mod view;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::DefaultTerminal;
use tokio::sync::mpsc;

use model::{Model, Poll};
use view::Theme;

/// How long one `Admin` call or a connect may take before the poll counts
/// it as failed.
const CALL_LIMIT: Duration = Duration::from_secs(10);

/// Failed polls in a row after which the poller connects anew.
const RECONNECT_AFTER: u32 = 3;

#[derive(Debug, Args)]
pub(crate) struct TopArgs {
    #[command(flatten)]
    target: crate::ops::Target,
    /// Time between polls: `1s`, `500ms`, `2m` (at least 100ms).
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    interval: Duration,
    /// How many hot keys to show (0: none, and no hot-key query).
    #[arg(long, default_value_t = 5)]
    hot: usize,
    /// Print one snapshot as plain text and exit (for scripts; needs no
    /// terminal). It fails when the scopes cannot be read.
    #[arg(long)]
    once: bool,
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is no interval: write e.g. 1s, 500ms or 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("`{s}`: the unit is ms, s or m (e.g. 1s, 500ms, 2m)")),
    };
    if !(0.1..=3600.0).contains(&secs) {
        return Err(format!("`{s}`: the interval is between 100ms and 60m"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The broker as the header shows it: scheme, host and port, never a user,
/// a password, a path or an option.
fn shown_broker(url: &str) -> String {
    let Ok(u) = url::Url::parse(url) else {
        return "<unparsable URL>".into();
    };
    let mut shown = format!("{}://", u.scheme());
    if let Some(host) = u.host_str() {
        shown.push_str(host);
    }
    if let Some(port) = u.port() {
        shown.push_str(&format!(":{port}"));
    }
    keyorder::redact::text(&shown)
}

/// A `keyorder` error as the status line shows it: one line.
fn line(e: keyorder::Error) -> String {
    crate::one_line(&anyhow::Error::new(e))
}

async fn bounded<T>(call: impl std::future::Future<Output = keyorder::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(CALL_LIMIT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(line(e)),
        Err(_) => Err(format!("no answer within {}s", CALL_LIMIT.as_secs())),
    }
}

/// One poll: the three calls at once.
async fn poll(client: &keyorder::Client, category: &str, group: &str, hot: usize) -> Poll {
    let admin = client.admin();
    let (scopes, halted, hot) = tokio::join!(
        bounded(admin.scopes(category, group)),
        bounded(admin.halted(category, group)),
        async {
            if hot == 0 {
                None
            } else {
                Some(bounded(admin.hot_keys(category, group, hot)).await)
            }
        }
    );
    Poll {
        scopes: Some(scopes),
        halted: Some(halted),
        hot,
        failed: None,
    }
}

#[derive(Debug, Clone)]
struct Query {
    url: String,
    category: String,
    group: String,
    hot: usize,
}

/// Polls every `interval` until the receiver is gone; connects (again)
/// when there is no client or polls kept failing.
async fn poller(
    q: Query,
    interval: Duration,
    mut client: Option<keyorder::Client>,
    start: Instant,
    tx: mpsc::Sender<(Duration, Poll)>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = 0u32;
    loop {
        ticker.tick().await;
        if client.is_none() || failing >= RECONNECT_AFTER {
            match bounded(keyorder::connect(&q.url)).await {
                Ok(c) => {
                    client = Some(c);
                    failing = 0;
                }
                Err(e) => {
                    if tx.send((start.elapsed(), Poll::failed(e))).await.is_err() {
                        return;
                    }
                    continue;
                }
            }
        }
        let Some(c) = client.as_ref() else { continue };
        let answers = poll(c, &q.category, &q.group, q.hot).await;
        failing = match answers.scopes {
            Some(Err(_)) => failing + 1,
            _ => 0,
        };
        if tx.send((start.elapsed(), answers)).await.is_err() {
            return;
        }
    }
}

pub(crate) async fn run(a: TopArgs) -> anyhow::Result<()> {
    let stdout_is_terminal = std::io::stdout().is_terminal();
    if !a.once && !stdout_is_terminal {
        anyhow::bail!(
            "keyorder top draws on a terminal and standard output is not one: add --once to print one snapshot as text"
        );
    }
    let q = Query {
        url: a.target.url.clone(),
        category: a.target.category.clone(),
        group: a.target.group.clone(),
        hot: a.hot,
    };
    let mut model = Model::new(shown_broker(&q.url), q.category.clone(), q.group.clone(), a.interval);
    let connected = tokio::time::timeout(CALL_LIMIT, keyorder::connect(&q.url)).await;
    if a.once {
        let client =
            connected.map_err(|_| anyhow::anyhow!("connecting: no answer within {}s", CALL_LIMIT.as_secs()))??;
        let answers = poll(&client, &q.category, &q.group, q.hot).await;
        if let Some(Err(e)) = &answers.scopes {
            anyhow::bail!("reading the scopes: {e}");
        }
        model.apply(Duration::ZERO, answers);
        model.live = false;
        print!("{}", snapshot(&model, stdout_is_terminal));
        return Ok(());
    }
    // A URL or an option that cannot work ends here; a broker that does
    // not answer yet is retried on screen.
    let client = match connected {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e @ keyorder::Error::Broker(_))) => {
            model.apply(Duration::ZERO, Poll::failed(line(e)));
            None
        }
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            let why = format!("connecting: no answer within {}s", CALL_LIMIT.as_secs());
            model.apply(Duration::ZERO, Poll::failed(why));
            None
        }
    };
    let theme = Theme {
        colours: crate::colours(true, std::env::var_os("NO_COLOR").as_deref()),
    };
    live(q, a.interval, client, model, theme).await
}

/// One snapshot as plain text: the view drawn on a buffer as wide as the
/// terminal (120 columns elsewhere) and as tall as its contents need.
fn snapshot(model: &Model, terminal: bool) -> String {
    let width = terminal
        .then(|| ratatui::crossterm::terminal::size().ok())
        .flatten()
        .map_or(120, |(w, _)| w.max(60));
    // The scopes' rows, or the halted heads' (at most 60% of the body)
    // above the hot keys'; the header, the sparklines and the status line.
    let halted = ((model.halted.len() + 3) as f64 / 0.6).ceil() as usize;
    let body = (model.scopes.len() + 3)
        .max(halted)
        .max(model.halted.len() + 3 + model.hot.len() + 3)
        .max(6);
    let height = (body + 2 + 5 + 2).min(MAX_SNAPSHOT_ROWS) as u16;
    let mut terminal =
        ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, height)).expect("a test backend cannot fail");
    terminal
        .draw(|f| view::render(f, model, Theme { colours: false }))
        .expect("a test backend cannot fail");
    let mut text = view::buffer_text(terminal.backend().buffer());
    let shown = usize::from(height).saturating_sub(2 + 5 + 2 + 3);
    if model.scopes.len() > shown {
        // Said, not silently cut.
        text.push_str(&format!(
            "\n({} more scopes not shown: `keyorder scopes` lists every one)\n",
            model.scopes.len() - shown
        ));
    }
    text
}

/// The tallest `--once` snapshot, in rows.
const MAX_SNAPSHOT_ROWS: usize = 2000;

/// The terminal in raw mode on the alternate screen, restored when
/// dropped; log lines are held back meanwhile and written after.
struct Screen {
    terminal: DefaultTerminal,
    _logs: crate::progress::HoldLogs,
}

impl Screen {
    fn new() -> anyhow::Result<Screen> {
        let logs = crate::progress::HoldLogs::new();
        match ratatui::try_init() {
            Ok(terminal) => Ok(Screen { terminal, _logs: logs }),
            Err(e) => {
                ratatui::restore();
                Err(anyhow::Error::new(e).context("setting up the terminal"))
            }
        }
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.terminal.show_cursor();
        ratatui::restore();
    }
}

/// What a key does.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Quit,
    Scroll(isize),
    Jump { end: bool },
    Nothing,
}

fn action(ev: &Event) -> Action {
    let Event::Key(k) = ev else { return Action::Nothing };
    if k.kind == KeyEventKind::Release {
        return Action::Nothing;
    }
    match k.code {
        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
        KeyCode::Char('q') | KeyCode::Esc => Action::Quit,
        KeyCode::Up | KeyCode::Char('k') => Action::Scroll(-1),
        KeyCode::Down | KeyCode::Char('j') => Action::Scroll(1),
        KeyCode::PageUp => Action::Scroll(-10),
        KeyCode::PageDown => Action::Scroll(10),
        KeyCode::Home | KeyCode::Char('g') => Action::Jump { end: false },
        KeyCode::End | KeyCode::Char('G') => Action::Jump { end: true },
        _ => Action::Nothing,
    }
}

/// Reads terminal events until `stop` (checked every 100 ms) or the
/// receiver is gone.
fn read_events(tx: mpsc::Sender<std::io::Result<Event>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match event::poll(Duration::from_millis(100)) {
            Ok(false) => {}
            Ok(true) => {
                let ev = event::read();
                let failed = ev.is_err();
                if tx.blocking_send(ev).is_err() || failed {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        }
    }
}

async fn live(
    q: Query,
    interval: Duration,
    client: Option<keyorder::Client>,
    mut model: Model,
    theme: Theme,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut screen = Screen::new()?;
    let stop = Arc::new(AtomicBool::new(false));
    let (keys_tx, mut keys) = mpsc::channel(64);
    let reader = std::thread::spawn({
        let stop = stop.clone();
        move || read_events(keys_tx, stop)
    });
    let (polls_tx, mut polls) = mpsc::channel(4);
    let poller = tokio::spawn(poller(q, interval, client, start, polls_tx));
    let result = loop {
        if let Err(e) = screen.terminal.draw(|f| view::render(f, &model, theme)) {
            break Err(anyhow::Error::new(e).context("drawing"));
        }
        tokio::select! {
            ev = keys.recv() => match ev {
                Some(Ok(ev)) => match action(&ev) {
                    Action::Quit => break Ok(()),
                    Action::Scroll(rows) => model.scroll(rows),
                    Action::Jump { end } => model.jump(end),
                    Action::Nothing => {}
                },
                Some(Err(e)) => break Err(anyhow::Error::new(e).context("reading the keyboard")),
                None => break Err(anyhow::anyhow!("the keyboard reader stopped")),
            },
            Some((at, answers)) = polls.recv() => model.apply(at, answers),
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = terminate.recv() => break Ok(()),
        }
    };
    poller.abort();
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || reader.join()).await;
    drop(screen);
    result.context("keyorder top")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::crossterm::event::KeyEvent;

    fn key(code: KeyCode, modifiers: KeyModifiers) -> Event {
        Event::Key(KeyEvent::new(code, modifiers))
    }

    #[test]
    fn q_esc_and_ctrl_c_quit_arrows_and_j_k_scroll() {
        let none = KeyModifiers::NONE;
        assert_eq!(action(&key(KeyCode::Char('q'), none)), Action::Quit);
        assert_eq!(action(&key(KeyCode::Esc, none)), Action::Quit);
        assert_eq!(action(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)), Action::Quit);
        assert_eq!(action(&key(KeyCode::Char('c'), none)), Action::Nothing);
        assert_eq!(action(&key(KeyCode::Down, none)), Action::Scroll(1));
        assert_eq!(action(&key(KeyCode::Char('j'), none)), Action::Scroll(1));
        assert_eq!(action(&key(KeyCode::Up, none)), Action::Scroll(-1));
        assert_eq!(action(&key(KeyCode::Char('k'), none)), Action::Scroll(-1));
        assert_eq!(action(&key(KeyCode::End, none)), Action::Jump { end: true });
        assert_eq!(action(&Event::Resize(80, 24)), Action::Nothing);
    }

    #[test]
    fn the_broker_is_shown_without_credentials() {
        assert_eq!(shown_broker("amqp://guest:s3cret@mq:5672/%2f?x=y"), "amqp://mq:5672");
        assert_eq!(shown_broker("postgres://u:pw@db/test?sslpassword=p"), "postgres://db");
        assert_eq!(shown_broker("memory://"), "memory://");
        assert_eq!(shown_broker("not a url s3cret"), "<unparsable URL>");
    }

    #[test]
    fn intervals() {
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("2m"), Ok(Duration::from_secs(120)));
        for bad in ["", "0s", "10ms", "1h", "x", "-1s"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_snapshot_fits_every_scope() {
        let mut m = Model::new("redis://h".into(), "c".into(), "g".into(), Duration::from_secs(1));
        let scopes = (0..40)
            .map(|i| model::tests::scope(&format!("s{i:02}"), None, i, 0))
            .collect();
        m.apply(
            Duration::ZERO,
            Poll {
                scopes: Some(Ok(scopes)),
                ..Poll::default()
            },
        );
        let text = snapshot(&m, false);
        for i in 0..40 {
            assert!(text.contains(&format!("s{i:02} ")), "s{i:02} missing:\n{text}");
        }
        assert!(!text.contains('\u{1b}'));
        // Few scopes, many halted heads and hot keys: every one listed.
        let head = |i: usize| keyorder::HaltedKey {
            label: format!("k#{i:016x}"),
            preview: String::new(),
            scope: "s00".into(),
            head_id: i.to_string(),
            attempts: 1,
            reason: "r".into(),
            held: None,
        };
        let hot = |i: usize| keyorder::HotKey {
            label: format!("k#{:016x}", 1000 + i),
            backlog: 1,
        };
        m.apply(
            Duration::from_secs(1),
            Poll {
                scopes: Some(Ok(vec![model::tests::scope("s00", None, 1, 20)])),
                halted: Some(Ok((0..20).map(head).collect())),
                hot: Some(Ok((0..8).map(hot).collect())),
                failed: None,
            },
        );
        let text = snapshot(&m, false);
        for label in (0..20).map(|i| head(i).label).chain((0..8).map(|i| hot(i).label)) {
            assert!(text.contains(&label), "{label} missing:\n{text}");
        }
    }
}
