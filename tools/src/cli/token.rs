//! `ramjet token`: the read-only HTTP credential derived from `RAMJET_API_KEY`.

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A daemon's HTTP address (host:port): also print the dashboard URL that carries the
    /// credential (opening it sets a cookie; the token then leaves the address bar).
    #[arg(long)]
    pub url: Option<String>,
}

/// Prints the token (one line, for scripts and Prometheus' `bearer_token_file`).
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Some(key) = ramjet_transport::wire::ApiKey::from_env() else {
        anyhow::bail!("RAMJET_API_KEY is not set: the HTTP credential is derived from it");
    };
    let t = key.http_token();
    println!("{t}");
    if let Some(u) = a.url {
        eprintln!(
            "dashboard: http://{}/?token={t}",
            u.trim_start_matches("http://").trim_end_matches('/')
        );
    }
    Ok(ExitCode::SUCCESS)
}
