//! Draws a [`Model`] on a ratatui frame: a header with the totals, the
//! scopes table, the halted heads and the hot keys (by their labels), the
//! lag and net-drain sparklines, and a status line.
//!
//! Everything a broker or a handler said (scope and owner names, halt
//! reasons, errors) goes through [`keyorder::redact::text`] first: no
//! control character reaches the terminal. Keys appear only as their
//! labels (`k#...`), never as values or previews.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, RenderDirection, Row, Sparkline, Table, TableState, Wrap};
use ratatui::Frame;

use keyorder::redact::text;

use super::model::Model;

/// Colours, or none (`NO_COLOR`): then only bold and reverse video.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Theme {
    pub(crate) colours: bool,
}

impl Theme {
    fn fg(self, c: Color) -> Style {
        if self.colours {
            Style::new().fg(c)
        } else {
            Style::new()
        }
    }
    fn title(self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }
    fn halted(self) -> Style {
        self.fg(Color::Red)
    }
    fn error(self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }
    fn ok(self) -> Style {
        self.fg(Color::Green)
    }
    fn dim(self) -> Style {
        if self.colours {
            Style::new().add_modifier(Modifier::DIM)
        } else {
            Style::new()
        }
    }
}

/// Draws the whole view.
pub(crate) fn render(frame: &mut Frame<'_>, model: &Model, theme: Theme) {
    // The status line takes a second row for an error.
    let status_h = if model.errors.is_empty() { 1 } else { 2 };
    let [header, body, sparks, status] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(6),
        Constraint::Length(5),
        Constraint::Length(status_h),
    ])
    .areas(frame.area());
    render_header(frame, header, model, theme);
    // The scopes table as wide as its rows need, between half and 60% of
    // the width.
    let w = Widths::of(model);
    let needed = w
        .scope
        .saturating_add(w.owner)
        .saturating_add(w.generation + w.lag + 6 + 4 + 2);
    let most = (u32::from(body.width) * 6 / 10) as u16;
    let left_w = needed.max(body.width / 2).min(most);
    let [left, right] = Layout::horizontal([Constraint::Length(left_w), Constraint::Fill(1)]).areas(body);
    render_scopes(frame, left, model, theme);
    // The halted heads as tall as they need, up to 60%; the hot keys below.
    let most = (u32::from(right.height) * 6 / 10) as u16;
    let halted_h = u16::try_from(model.halted.len() + 3)
        .unwrap_or(u16::MAX)
        .clamp(4, most.max(4));
    let [halted, hot] = Layout::vertical([Constraint::Length(halted_h), Constraint::Fill(1)]).areas(right);
    render_halted(frame, halted, model, theme);
    render_hot(frame, hot, model, theme);
    render_sparks(frame, sparks, model, theme);
    render_status(frame, status, model, theme);
}

fn render_header(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let every = format!("every {}", seconds(model.interval.as_secs_f64()));
    let first = Line::from(vec![
        Span::styled("keyorder top", theme.title()),
        Span::raw(format!(
            "  {}  category {}  group {}  ",
            model.broker,
            text(&model.category),
            text(&model.group)
        )),
        Span::styled(every, theme.dim()),
    ]);
    let halted = model.halted_keys();
    let change = match model.lag_change {
        Some(c) => format!("{c:+.1}/s"),
        None => "-".into(),
    };
    let second = Line::from(vec![
        Span::raw(format!(
            "scopes {} (owned {}, unowned {})  lag {}  lag change {change}  ",
            model.scopes.len(),
            model.owned(),
            model.scopes.len() - model.owned(),
            model.total_lag(),
        )),
        Span::styled(
            format!("halted keys {halted}"),
            if halted > 0 { theme.halted() } else { Style::new() },
        ),
    ]);
    frame.render_widget(Paragraph::new(vec![first, second]), area);
}

/// A scope's name as shown: without the `<category>/` that every scope of
/// the category starts with (the header names the category).
fn short(model: &Model, scope: &str) -> String {
    let prefix = format!("{}/", model.category);
    text(scope.strip_prefix(&prefix).unwrap_or(scope))
}

/// The scopes table's column widths: their longest value or title.
struct Widths {
    scope: u16,
    owner: u16,
    generation: u16,
    lag: u16,
}

impl Widths {
    fn of(model: &Model) -> Widths {
        let w =
            |values: &mut dyn Iterator<Item = usize>, title: usize| values.max().unwrap_or(0).clamp(title, 200) as u16;
        let digits = |n: u64| n.to_string().len();
        Widths {
            scope: w(
                &mut model.scopes.iter().map(|s| short(model, &s.scope).chars().count()),
                5,
            ),
            owner: w(
                &mut model
                    .scopes
                    .iter()
                    .map(|s| s.owner.as_deref().map_or(1, |o| text(o).chars().count())),
                5,
            ),
            generation: w(&mut model.scopes.iter().map(|s| digits(s.generation)), 3),
            lag: w(&mut model.scopes.iter().map(|s| digits(s.lag)), 3),
        }
    }
}

fn render_scopes(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let w = Widths::of(model);
    let rows = model.scopes.iter().map(|s| {
        let row = Row::new(vec![
            short(model, &s.scope),
            s.owner.as_deref().map_or_else(|| "-".into(), text),
            s.generation.to_string(),
            s.lag.to_string(),
            s.halted.to_string(),
        ]);
        if s.halted > 0 {
            row.style(theme.halted())
        } else {
            row
        }
    });
    let shown = if model.scopes.is_empty() {
        "none yet".to_owned()
    } else {
        format!("row {} of {}", model.selected + 1, model.scopes.len())
    };
    let table = Table::new(
        rows,
        [
            Constraint::Length(w.scope),
            Constraint::Fill(1),
            Constraint::Length(w.generation),
            Constraint::Length(w.lag),
            Constraint::Length(6),
        ],
    )
    .header(Row::new(["scope", "owner", "gen", "lag", "halted"]).style(Style::new().add_modifier(Modifier::BOLD)))
    .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
    .block(
        Block::new()
            .borders(Borders::ALL)
            .title(Span::styled(" scopes: halted first, then by lag ", theme.title()))
            .title_bottom(Line::from(format!(" {shown} ")).right_aligned()),
    );
    let mut state = TableState::new().with_selected((!model.scopes.is_empty()).then_some(model.selected));
    frame.render_stateful_widget(table, area, &mut state);
}

fn render_halted(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let rows = model.halted.iter().map(|h| {
        Row::new(vec![
            // keyorder's own label: `k#` and a hash, never the key.
            h.label.clone(),
            short(model, &h.scope),
            h.attempts.to_string(),
            h.held.map_or_else(|| "-".into(), |n| n.to_string()),
            text(&h.reason),
        ])
        .style(theme.halted())
    });
    let table = Table::new(
        rows,
        [
            Constraint::Length(18),
            Constraint::Fill(1),
            Constraint::Length(8),
            Constraint::Length(4),
            Constraint::Fill(2),
        ],
    )
    .header(Row::new(["key", "scope", "attempts", "held", "reason"]).style(Style::new().add_modifier(Modifier::BOLD)))
    .block(Block::new().borders(Borders::ALL).title(Span::styled(
        format!(" halted heads ({}) ", model.halted.len()),
        theme.title(),
    )));
    frame.render_widget(table, area);
}

fn render_hot(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let total = model.total_lag().max(1);
    let rows = model.hot.iter().map(|h| {
        Row::new(vec![
            h.label.clone(),
            h.backlog.to_string(),
            format!("{:.1}%", (100.0 * h.backlog as f64 / total as f64).min(100.0)),
        ])
    });
    let backlog_w = model
        .hot
        .iter()
        .map(|h| h.backlog.to_string().len())
        .max()
        .unwrap_or(0)
        .max(7) as u16;
    let table = Table::new(
        rows,
        [
            Constraint::Length(18),
            Constraint::Length(backlog_w),
            Constraint::Length(6),
        ],
    )
    .header(Row::new(["key", "backlog", "of lag"]).style(Style::new().add_modifier(Modifier::BOLD)))
    .block(
        Block::new()
            .borders(Borders::ALL)
            .title(Span::styled(" hot keys ", theme.title())),
    );
    frame.render_widget(table, area);
}

fn render_sparks(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let [lag, drain] = Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let now_lag = model.lag_history.back().copied().unwrap_or(0);
    let max_lag = model.lag_history.iter().copied().max().unwrap_or(0);
    spark(
        frame,
        lag,
        format!(" total lag: now {now_lag}, max {max_lag} "),
        &model.lag_history,
        theme.fg(Color::Yellow),
        theme,
    );
    let now_drain = model.drain_history.back().copied().unwrap_or(0);
    spark(
        frame,
        drain,
        format!(" net drain/s (fall in lag): now {now_drain} "),
        &model.drain_history,
        theme.fg(Color::Green),
        theme,
    );
}

fn spark(
    frame: &mut Frame<'_>,
    area: Rect,
    title: String,
    data: &std::collections::VecDeque<u64>,
    style: Style,
    theme: Theme,
) {
    let block = Block::new()
        .borders(Borders::ALL)
        .title(Span::styled(title, theme.title()));
    let width = block.inner(area).width as usize;
    // Newest at the right edge.
    let points: Vec<u64> = data.iter().rev().take(width).copied().collect();
    frame.render_widget(
        Sparkline::default()
            .block(block)
            .data(points)
            .direction(RenderDirection::RightToLeft)
            .style(style),
        area,
    );
}

fn render_status(frame: &mut Frame<'_>, area: Rect, model: &Model, theme: Theme) {
    let state = if model.errors.is_empty() {
        let polls = if model.polls == 1 { "poll" } else { "polls" };
        Span::styled(format!("ok: {} {polls} answered", model.polls), theme.ok())
    } else {
        let stale = match model.stale_for {
            Some(d) => format!(", showing the answer of {} ago", seconds(d.as_secs_f64())),
            None => String::new(),
        };
        Span::styled(
            format!(
                "error ({} in a row, retrying every {}{stale}): {}",
                model.failing,
                seconds(model.interval.as_secs_f64()),
                text(&model.errors.join("; "))
            ),
            theme.error(),
        )
    };
    let keys = Span::styled(
        if model.live {
            "   q quit, arrows or j/k scroll"
        } else {
            ""
        },
        theme.dim(),
    );
    frame.render_widget(
        Paragraph::new(Line::from(vec![state, keys])).wrap(Wrap { trim: false }),
        area,
    );
}

/// `1s`, `0.5s`, `2.3s`.
fn seconds(s: f64) -> String {
    if (s - s.round()).abs() < 0.05 {
        format!("{}s", s.round())
    } else {
        format!("{s:.1}s")
    }
}

/// The buffer's text, a line per row, trailing blanks cut: what `--once`
/// prints and the tests read.
pub(crate) fn buffer_text(buf: &ratatui::buffer::Buffer) -> String {
    let area = buf.area;
    let mut out = String::new();
    for y in area.top()..area.bottom() {
        let mut line = String::new();
        for x in area.left()..area.right() {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use keyorder::{HaltedKey, HotKey};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    use super::super::model::tests::scope;
    use super::super::model::{Model, Poll};
    use super::*;

    fn drawn(model: &Model, theme: Theme, w: u16, h: u16) -> ratatui::buffer::Buffer {
        let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
        terminal.draw(|f| render(f, model, theme)).unwrap();
        terminal.backend().buffer().clone()
    }

    fn model() -> Model {
        let mut m = Model::new(
            "postgres://db:5432".into(),
            "orders".into(),
            "billing".into(),
            Duration::from_secs(1),
        );
        let poll = |lag: u64| Poll {
            scopes: Some(Ok(vec![
                scope("orders.0", Some("inst-1"), lag, 0),
                scope("orders.1\u{1b}[2J", Some("inst-2"), 2, 1),
                scope("orders.2", None, 0, 0),
            ])),
            halted: Some(Ok(vec![HaltedKey {
                label: "k#00112233aabbccdd".into(),
                preview: "secr…".into(),
                scope: "orders.1".into(),
                head_id: "7".into(),
                attempts: 3,
                reason: "bad\npayload".into(),
                held: Some(1),
            }])),
            hot: Some(Ok(vec![HotKey {
                label: "k#0000000000000abc".into(),
                backlog: 9,
            }])),
            failed: None,
        };
        m.apply(Duration::ZERO, poll(40));
        m.apply(Duration::from_secs(1), poll(30));
        m
    }

    #[test]
    fn the_view_shows_totals_scopes_halted_heads_and_hot_keys() {
        let screen = buffer_text(&drawn(&model(), Theme { colours: true }, 140, 30));
        for want in [
            "postgres://db:5432",
            "category orders",
            "group billing",
            "scopes 3 (owned 2, unowned 1)",
            "lag 32",
            "lag change -10.0/s",
            "halted keys 1",
            "inst-1",
            "k#00112233aabbccdd",
            "k#0000000000000abc",
            "total lag: now 32, max 42",
            "net drain/s",
            "now 10",
            "ok: 2 polls answered",
        ] {
            assert!(screen.contains(want), "{want:?} missing from\n{screen}");
        }
        // Halted first: orders.1 is the first row under the header.
        let rows: Vec<&str> = screen.lines().filter(|l| l.contains("│orders.")).collect();
        assert!(rows[0].contains("orders.1"), "{screen}");
        assert!(!screen.contains("secr"), "a key preview was shown:\n{screen}");
        assert!(
            !screen.contains('\u{1b}') && screen.contains("\\u{1b}[2J"),
            "a scope name's escape reached the screen:\n{screen}"
        );
        assert!(screen.contains("bad\\npayload"), "{screen}");
    }

    #[test]
    fn no_colour_under_no_color() {
        let coloured = drawn(&model(), Theme { colours: true }, 140, 30);
        assert!(coloured.content.iter().any(|c| c.fg != Color::Reset));
        let plain = drawn(&model(), Theme { colours: false }, 140, 30);
        assert!(
            plain
                .content
                .iter()
                .all(|c| c.fg == Color::Reset && c.bg == Color::Reset),
            "a colour under NO_COLOR"
        );
    }

    #[test]
    fn a_failing_broker_shows_in_the_status_line() {
        let mut m = model();
        m.apply(
            Duration::from_secs(4),
            Poll::failed("connecting to redis://h:1: connection refused".into()),
        );
        let screen = buffer_text(&drawn(&m, Theme { colours: false }, 160, 30));
        let status = screen
            .lines()
            .rev()
            .find(|l| l.starts_with("error"))
            .unwrap_or_default();
        assert!(
            status.contains("error (1 in a row, retrying every 1s, showing the answer of 3s ago): connecting to redis://h:1: connection refused"),
            "{screen}"
        );
        assert!(screen.contains("orders.0"), "the last answer stays shown:\n{screen}");
    }

    #[test]
    fn a_small_terminal_does_not_panic() {
        for (w, h) in [(1, 1), (20, 5), (80, 12), (0, 0)] {
            let _ = drawn(&model(), Theme { colours: true }, w, h);
        }
    }
}
