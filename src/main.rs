use clap::Parser;

fn main() {
    let cli = mamba3::cli::Cli::parse();
    if let Err(e) = mamba3::cli::run(cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
