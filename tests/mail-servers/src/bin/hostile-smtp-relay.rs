//! `hostile-smtp-relay`: the hostile SMTP relay as a process (see
//! `capm_mail_servers::hostile_smtp`). Prints its bound address on stdout, then takes one
//! command per line on standard input, each answered with one line on stdout (`mode <name>`,
//! `drip <ms>`, `stats`; see `Relay::command`), and exits when standard input reaches
//! end-of-file (or serves forever with `--ignore-stdin`).

use std::net::SocketAddr;

use capm_mail_servers::hostile_smtp::Relay;
use clap::Parser;
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// A relay in front of a real SMTP server that passes connections through or misbehaves on
/// request, for tests.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The real SMTP server that `pass` mode forwards to.
    #[arg(long)]
    upstream: SocketAddr,
    /// Keep running when standard input closes (for running it by hand; no commands then).
    #[arg(long)]
    ignore_stdin: bool,
}

/// Answers commands from standard input until it closes.
async fn commands(relay: &Relay) {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        println!("{}", relay.command(&line));
    }
}

// One thread: the relay's memory and CPU stay small while it floods a client.
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("{}", listener.local_addr()?);
    let relay = Relay::new(args.upstream);
    if args.ignore_stdin {
        relay.serve(listener).await;
        return Ok(());
    }
    tokio::select! {
        () = relay.serve(listener) => {}
        () = commands(&relay) => {}
    }
    Ok(())
}
