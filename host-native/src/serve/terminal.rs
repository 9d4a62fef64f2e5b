//! What a person at the server's terminal sees: `tracing` logs on stderr and indicatif bars
//! for the slow parts (loading weights, long prefills). Log lines are written with the bars
//! suspended, so neither tears the other; bars hide themselves when stderr is not a terminal.

use std::io::{IsTerminal, Write};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(MultiProgress::new)
}

/// Stderr, with any bar on screen lifted for the line.
#[derive(Clone, Copy)]
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        bars().suspend(|| std::io::stderr().write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Stderr {
        Stderr
    }
}

/// Logs at `level` (a `tracing` filter such as `info` or `tether=debug`); `RUST_LOG` wins.
pub fn init_logging(level: &str) -> Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => EnvFilter::try_new(env).context("RUST_LOG")?,
        _ => EnvFilter::try_new(level).with_context(|| format!("--log {level}"))?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("setting up logging: {e}"))
}

/// A spinner with the elapsed time while `f` runs (weights are memory-mapped or generated in
/// one call, so there is no finer progress to show).
pub fn spinner<T>(message: String, f: impl FnOnce() -> T) -> T {
    let bar = bars().add(ProgressBar::new_spinner());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("a valid template"),
    );
    bar.set_message(message);
    bar.enable_steady_tick(Duration::from_millis(120));
    let out = f();
    bar.finish_and_clear();
    bars().remove(&bar);
    out
}

/// A bar over a prefill of `tokens` new tokens, shown only when it takes more than one
/// segment (shorter ones are over before a bar would help). It leaves the screen when dropped,
/// however the prefill ends.
pub fn prefill_bar(tokens: usize, segment: usize) -> Bar {
    if tokens <= segment {
        return Bar(ProgressBar::hidden());
    }
    let bar = bars().add(ProgressBar::new(tokens as u64));
    bar.set_style(
        ProgressStyle::with_template("prefill [{bar:40}] {pos}/{len} tokens, {per_sec}, eta {eta}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    Bar(bar)
}

pub struct Bar(ProgressBar);

impl Bar {
    pub fn inc(&self, n: usize) {
        self.0.inc(n as u64);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
        bars().remove(&self.0);
    }
}
