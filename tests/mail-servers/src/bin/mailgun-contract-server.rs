//! `mailgun-contract-server`: the Mailgun API contract server as a process (see
//! `capm_mail_servers::contract`). Prints its bound address on stdout, then serves until its
//! standard input reaches end-of-file (or forever with `--ignore-stdin`).

use std::net::SocketAddr;

use capm_mail_servers::contract::{ContractConfig, serve};
use clap::Parser;
use tokio::io::AsyncReadExt as _;

/// A local stand-in for Mailgun's sending API, for tests, benchmarks and the demo.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, env = "MAILGUN_CONTRACT_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The sending domain it accepts in `/v3/{domain}/...`.
    #[arg(
        long,
        env = "MAILGUN_CONTRACT_DOMAIN",
        default_value = "mg.example.test"
    )]
    domain: String,
    /// The API key clients must send (basic auth `api:<key>`).
    #[arg(long, env = "MAILGUN_CONTRACT_API_KEY", hide_env_values = true)]
    api_key: String,
    /// A domain sending key: it may only send, and only for `--domain` (401 elsewhere).
    #[arg(long, env = "MAILGUN_CONTRACT_SENDING_KEY", hide_env_values = true)]
    sending_key: Option<String>,
    /// A read-only key (Mailgun's `Analyst` role): the events and Logs APIs only.
    #[arg(long, env = "MAILGUN_CONTRACT_READ_KEY", hide_env_values = true)]
    read_key: Option<String>,
    /// Keep running when standard input closes (for running it by hand).
    #[arg(long)]
    ignore_stdin: bool,
}

async fn stdin_closed() {
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    while let Ok(n) = stdin.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("{}", listener.local_addr()?);
    let config = ContractConfig {
        api_key: args.api_key,
        domain: args.domain,
        sending_key: args.sending_key,
        read_key: args.read_key,
    };
    if args.ignore_stdin {
        return serve(listener, &config).await;
    }
    tokio::select! {
        result = serve(listener, &config) => result,
        () = stdin_closed() => Ok(()),
    }
}
