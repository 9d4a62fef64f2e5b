//! `tether-helper`: lend this machine's memory and compute to a tether host over WebSocket
//! (Linux, Windows, macOS: "swapping in other GPU hosts"). The helper itself is engine-core's
//! runner (`engine_core::helper::runner`), which the iOS library (phone-ios) runs too; this is
//! its command line.

use anyhow::{bail, Result};
use clap::Parser;

/// As `tether`'s (host-native/Cargo.toml): activation buffers are reused, not faulted in again.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tether-helper",
    version,
    about = "Lend this device's memory and compute to a tether host"
)]
struct Cli {
    #[command(flatten)]
    helper: engine_core::helper::runner::Options,
    #[arg(long)]
    threads: Option<usize>,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    engine_core::helper::runner::run(cli.helper)
}
