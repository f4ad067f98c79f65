use clap::Parser;
use mamba3::cli::{Cli, Command};

fn main() {
    mamba3::timeline::begin();
    let cli = Cli::parse();
    // Commands that print behave like other command-line tools when the reader of their
    // output goes away (`mamba3 inspect | head`): they end quietly. The server keeps Rust's
    // default (writes to a closed socket fail with an error instead).
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_) | Command::BenchServe(_)) {
        // SAFETY: setting a signal's disposition to its default before any threads start.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if let Err(e) = mamba3::cli::run(cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
