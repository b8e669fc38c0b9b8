//! Throughput of the backends against the local test servers (a benchmark, not a test).
//!
//! ```text
//! cargo run --release -p capm-mailer --example bench -- [MAILGUN_MESSAGES] [SMTP_MESSAGES] [SMTP_SENDERS]
//! ```
//! Defaults: 20000 Mailgun messages (16 concurrent senders, one shared client) and 2000 SMTP
//! messages per mode (pooled vs one connection per message, 8 concurrent senders). Needs
//! `python3` with `aiosmtpd` for the SMTP part.

use std::{
    error::Error,
    sync::Arc,
    time::{Duration, Instant},
};

use capm_mail_servers::{MailgunServer, SmtpOptions, SmtpServer, SmtpTls};
use capm_mailer::{
    Mailer, MailgunConfig, MailgunMailer, Message, SecretSource, SmtpConfig, SmtpMailer, Starttls,
};

type BoxResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

fn message(run: &str, i: usize) -> BoxResult<Message> {
    Ok(Message::builder()
        .from("Bench <bench@mg.bench.test>")
        .to("ops@example.com")
        .subject(format!("[Urgent] New Cluster bench-{i} requested"))
        .text("Hello! One cluster please.\n\nA benchmark message of typical size.")
        .message_id(format!("<{run}-{i}@bench.capm.test>"))
        .tag("cluster-request")
        .variable("cluster", format!("default/bench-{i}"))
        .build()?)
}

/// Sends `total` messages with `senders` concurrent tasks; returns (elapsed, p50, p99).
async fn run(
    mailer: Arc<dyn Mailer>,
    run: &'static str,
    total: usize,
    senders: usize,
) -> BoxResult<(Duration, Duration, Duration)> {
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..senders {
        let mailer = Arc::clone(&mailer);
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            for i in (s..total).step_by(senders) {
                let m = message(run, i)?;
                let t = Instant::now();
                mailer.send(&m).await?;
                latencies.push(t.elapsed());
            }
            BoxResult::Ok(latencies)
        });
    }
    let mut latencies = Vec::with_capacity(total);
    while let Some(result) = tasks.join_next().await {
        latencies.extend(result??);
    }
    let elapsed = start.elapsed();
    latencies.sort();
    let pct = |p: usize| latencies[(latencies.len() * p / 100).min(latencies.len() - 1)];
    Ok((elapsed, pct(50), pct(99)))
}

fn report(name: &str, total: usize, (elapsed, p50, p99): (Duration, Duration, Duration)) {
    println!(
        "{name:<48} {total:>6} msgs in {:>7.2} s = {:>8.0} msg/s  (p50 {:>6.2} ms, p99 {:>6.2} ms)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
    );
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let mut args = std::env::args().skip(1);
    let mailgun_total: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let smtp_total: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2_000);
    let smtp_senders: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(8);

    // Mailgun: one shared client (pooled keep-alive connections), 16 concurrent senders.
    let server = MailgunServer::start("key-bench", "mg.bench.test")?;
    let key_dir = tempfile::tempdir()?;
    let key_file = key_dir.path().join("key");
    std::fs::write(&key_file, "key-bench")?;
    let mut config = MailgunConfig::new("mg.bench.test", SecretSource::File(key_file));
    config.base_url = Some(server.base_url());
    let mailgun: Arc<dyn Mailer> = Arc::new(MailgunMailer::new(&config)?);
    run(Arc::clone(&mailgun), "warmup", 500, 16).await?;
    let r = run(Arc::clone(&mailgun), "mg16", mailgun_total, 16).await?;
    report("mailgun, shared client, 16 senders", mailgun_total, r);
    let single = mailgun_total / 4;
    let r = run(Arc::clone(&mailgun), "mg1", single, 1).await?;
    report("mailgun, shared client, 1 sender", single, r);
    let stored = server.messages()?.len();
    println!("contract server stored {stored} messages");

    // SMTP: pooled vs one connection per message.
    let smtp_server = SmtpServer::start(SmtpOptions {
        tls: SmtpTls::None,
        auth: None,
    })?;
    for pooled in [true, false] {
        let mut c = SmtpConfig::new(smtp_server.url());
        c.starttls = Some(Starttls::Never);
        c.pool.enabled = pooled;
        let smtp: Arc<dyn Mailer> = Arc::new(SmtpMailer::new(&c)?);
        let name = if pooled {
            "smtp-pooled"
        } else {
            "smtp-unpooled"
        };
        run(Arc::clone(&smtp), "warmup", 50, 8).await?;
        let r = run(smtp, name, smtp_total, smtp_senders).await?;
        let mode = if pooled {
            "pooled"
        } else {
            "connection per message"
        };
        report(
            &format!("smtp (aiosmtpd), {mode}, {smtp_senders} senders"),
            smtp_total,
            r,
        );
    }
    Ok(())
}
