//! The fulfilment page behind a real reverse proxy (issue 54): Debian's `nginx`, started by this
//! test, in front of the page as an Ingress controller would be: TLS for `capm.example.com`
//! (a test CA), configured as `--fulfilment-trusted-proxies` says (the proxy reaches the page
//! from 127.0.0.2, the only trusted address; it appends the peer it saw to `X-Forwarded-For` and
//! keeps no access log of `/fulfil/`). The provider's public URL is written as a user might,
//! `HTTPS://Capm.Example.com:443`: the links and the page's origin check use its normal form.
//!
//! A headless Chromium fulfils a cluster's mailed link through the proxy (its own POST, with
//! `Origin` and `Sec-Fetch-Site` as a browser sends them, is accepted): the Event and the log
//! line name the browser's address (127.0.0.1), never the proxy's. Then the forgeries: a client
//! that sends its own `X-Forwarded-For` through the proxy is still the address the proxy saw; a
//! client that reaches the page directly with a forged `X-Forwarded-For` is the peer it is, in the
//! Event and in the rate limits (a made-up address per request does not buy a fresh budget).
//!
//! Real parts: a control plane of its own, the Cluster API core manager, the provider from this
//! build, a Mailgun contract server, nginx, Chromium.

use std::{
    fs,
    net::TcpStream,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    Proc,
    browser::{self, Visit, form_token, fulfilled_event, link_in, page_says},
    create_cluster_pair, dynamic_api, eventually, free_port, mailgun_mails, provider_binary,
    start_capi_manager,
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{
    ControlPlane, Options, install_crds,
    pki::{CertPair, CertificateAuthority},
    provider::Launch,
};
use kube::Client;
use serde_json::{Value, json};

const NS: &str = "proxied";
const DOMAIN: &str = "mg.proxied.example.com";
const API_KEY: &str = "key-reverse-proxy-e2e-not-logged";
const RECIPIENT: &str = "datacentre-team@example.com";
/// The links' key (32 bytes, base64).
const KEY: &str = "cmV2ZXJzZS1wcm94eS1lMmUta2V5LW9mLXRoaXJ0eTI=";
/// The proxy's own address towards the page: the only trusted one.
const PROXY: &str = "127.0.0.2";
/// The browser's address, as the proxy sees it.
const BROWSER: &str = "127.0.0.1";
/// A client that reaches the page directly, around the proxy.
const DIRECT: &str = "127.0.0.3";
/// A client that spends its budget on made-up links, each request under another forged address.
const SPENDER: &str = "127.0.0.4";
/// Submissions one address may make at once: the page's limiter's `POSTS_PER_ADDRESS`
/// (`cmd/src/fulfil/limiter.rs`), its burst.
const POSTS_PER_ADDRESS: usize = 30;
/// The public URL as the operator wrote it, and its normal form (the links' base).
const PUBLIC_AS_WRITTEN: &str = "HTTPS://Capm.Example.com:443";
const PUBLIC: &str = "https://capm.example.com";
const PUBLIC_HOST: &str = "capm.example.com";
/// An address no one here has: what forgers claim to be.
const FORGED: &str = "203.0.113.50";

/// Debian's nginx (`CAPM_NGINX` overrides).
fn nginx_binary() -> Result<PathBuf> {
    browser::debian_program("CAPM_NGINX", "/usr/sbin/nginx", "nginx-light")
}

/// nginx in one process (no master, so stopping it stops all of it) on `port`, TLS for
/// [`PUBLIC_HOST`] with `cert`, proxying `/fulfil/` to the page on `page_port` from [`PROXY`].
fn start_nginx(dir: &Path, port: u16, page_port: u16, cert: &CertPair) -> Result<Proc> {
    let prefix = dir.join("nginx");
    fs::create_dir_all(prefix.join("logs"))?;
    fs::write(prefix.join("tls.crt"), &cert.cert_pem)?;
    fs::write(prefix.join("tls.key"), &cert.key_pem)?;
    let root = fs::metadata(&prefix)?.uid() == 0;
    let p = prefix.display();
    let conf = format!(
        "{user}master_process off;
daemon off;
pid {p}/nginx.pid;
error_log {p}/logs/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {p}/logs/access.log;
    client_body_temp_path {p}/client_body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    server {{
        listen 127.0.0.1:{port} ssl;
        server_name {PUBLIC_HOST};
        ssl_certificate {p}/tls.crt;
        ssl_certificate_key {p}/tls.key;
        location /fulfil/ {{
            access_log off;
            proxy_pass http://127.0.0.1:{page_port};
            proxy_bind {PROXY};
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
        }}
        location / {{ return 404; }}
    }}
}}
",
        user = if root { "user root;\n" } else { "" },
    );
    let conf_file = prefix.join("nginx.conf");
    fs::write(&conf_file, conf)?;
    let mut cmd = Command::new(nginx_binary()?);
    cmd.arg("-p")
        .arg(&prefix)
        .arg("-e")
        .arg(prefix.join("logs/startup.log"))
        .arg("-c")
        .arg(&conf_file);
    let proc = Proc::spawn("nginx", cmd, dir.join("nginx.log"))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        proc.check_alive().with_context(|| {
            fs::read_to_string(prefix.join("logs/error.log")).unwrap_or_default()
        })?;
        ensure!(
            std::time::Instant::now() < deadline,
            "nginx does not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(proc)
}

/// The request mail's link for the MailgunCluster `name`.
async fn mailed_link(mailgun: &MailgunServer, provider: &Proc, name: &str) -> Result<String> {
    let body = eventually(
        Duration::from_secs(120),
        &format!("the request mail of {name}"),
        || async {
            provider.check_alive()?;
            Ok(mailgun_mails(mailgun)?
                .into_iter()
                .find(|(m, _)| m.subject.contains(&format!("New Cluster {name} requested")))
                .map(|(_, body)| body))
        },
    )
    .await?;
    link_in(&body)
}

/// A field of a JSON log line, wherever the format nests it.
fn field<'a>(line: &'a Value, key: &str) -> Option<&'a Value> {
    match line {
        Value::Object(map) => map
            .get(key)
            .or_else(|| map.values().find_map(|v| field(v, key))),
        Value::Array(items) => items.iter().find_map(|v| field(v, key)),
        _ => None,
    }
}

/// The client of the provider's `Fulfilled through a link` line about `name`.
fn logged_client(log: &str, name: &str) -> Result<String> {
    log.lines()
        .filter(|l| l.contains("Fulfilled through a link"))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| field(l, "name").and_then(Value::as_str) == Some(name))
        .and_then(|l| {
            field(&l, "client")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .with_context(|| format!("no `Fulfilled through a link` line for {name}"))
}

/// How curl reaches the public host: the proxy's address and the test CA.
struct Reach<'a> {
    proxy_port: u16,
    ca: &'a Path,
}

/// curl from `from` (a loopback address of this host), with the cookies in `jar` and `headers`;
/// the status and the body. [`PUBLIC_HOST`] is the proxy, its certificate checked against the
/// test CA.
fn curl(
    reach: &Reach<'_>,
    from: &str,
    url: &str,
    jar: &Path,
    headers: &[String],
    form: Option<&str>,
) -> Result<(u16, String)> {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "30", "-o", "-", "-w", "\n%{http_code}"])
        .args(["--interface", from])
        .arg("--connect-to")
        .arg(format!("{PUBLIC_HOST}:443:127.0.0.1:{}", reach.proxy_port))
        .arg("--cacert")
        .arg(reach.ca)
        .arg("-c")
        .arg(jar)
        .arg("-b")
        .arg(jar);
    for h in headers {
        cmd.args(["-H", h]);
    }
    if let Some(form) = form {
        cmd.args(["-H", "Content-Type: application/x-www-form-urlencoded"])
            .args(["--data-binary", form]);
    }
    let out = capm_e2e::run(cmd.arg(url), "curl")?;
    let (body, code) = out.rsplit_once('\n').context("curl's output")?;
    Ok((code.trim().parse().context("status code")?, body.to_owned()))
}

/// Opens `link` and submits the cluster form as `from` with `headers` on both requests: the
/// submission's status and body.
fn fulfil_with_curl(
    reach: &Reach<'_>,
    dir: &Path,
    from: &str,
    link: &str,
    headers: &[String],
    host: &str,
) -> Result<(u16, String)> {
    let jar = dir.join(format!("cookies-{from}-{host}"));
    let (status, page) = curl(reach, from, link, &jar, headers, None)?;
    ensure!(status == 200, "opening {link} as {from}: {status}\n{page}");
    let token = form_token(&page)?;
    curl(
        reach,
        from,
        link,
        &jar,
        headers,
        Some(&format!("host={host}&port=6443&form-token={token}")),
    )
}

/// A client at `from` fulfils the MailgunCluster `name` through `link`, claiming to be
/// [`FORGED`] in `X-Forwarded-For`.
struct Forgery<'a> {
    name: &'a str,
    from: &'a str,
    link: &'a str,
    /// What the forgery is, for the failure message.
    what: &'a str,
}

impl Forgery<'_> {
    /// The fulfilment is recorded, and its Event and log line name `from`, never [`FORGED`].
    async fn is_not_believed(
        &self,
        admin: &Client,
        provider: &Proc,
        reach: &Reach<'_>,
        dir: &Path,
    ) -> Result<()> {
        let forged = vec![format!("X-Forwarded-For: {FORGED}")];
        let host = format!("api.{}.example.com", self.name);
        let (status, body) = fulfil_with_curl(reach, dir, self.from, self.link, &forged, &host)?;
        ensure!(status == 200, "{status}: {body}");
        let note = fulfilled_event(admin, NS, self.name).await?;
        ensure!(
            note.starts_with(&format!("From {}:", self.from)) && !note.contains(FORGED),
            "{} was believed: {note}",
            self.what
        );
        let client = logged_client(&provider.log(), self.name)?;
        ensure!(
            client == self.from,
            "the log line names {client}, not {}",
            self.from
        );
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_page_behind_nginx_names_the_browser_and_ignores_forged_forwarded_for() -> Result<()> {
    browser::chromium()?;
    nginx_binary()?;
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    install_crds(&admin, &capm_api::crd::crds()?).await?;
    let capi = start_capi_manager(cp.kubeconfig(), dir)?;
    cp.adopt(capi.pid())?;
    capm_e2e::create_namespace(&admin, NS, false).await?;
    let mailgun = MailgunServer::start(API_KEY, DOMAIN)?;

    let page_port = free_port()?;
    let proxy_port = free_port()?;
    let ca = CertificateAuthority::new("reverse-proxy-e2e-ca")?;
    let ca_file = dir.join("ca.crt");
    fs::write(&ca_file, ca.cert_pem())?;
    let cert = ca.serving_cert(PUBLIC_HOST, &[PUBLIC_HOST], &[])?;
    let nginx = start_nginx(dir, proxy_port, page_port, &cert)?;
    cp.adopt(nginx.pid())?;

    let keys = dir.join("fulfilment-keys");
    fs::write(&keys, KEY)?;
    let config = dir.join("config.json");
    fs::write(
        &config,
        json!({"mailer": {"mailgun": {
            "domain": DOMAIN, "baseUrl": mailgun.base_url(), "apiKey": {"env": "MAILGUN_API_KEY"},
        }}})
        .to_string(),
    )?;
    let launch = Launch::new(provider_binary()?, cp.kubeconfig())
        .on_free_ports()?
        .0
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("MAIL_RECIPIENT", RECIPIENT)
        .env("MAILGUN_API_KEY", API_KEY)
        .args(["--namespace", NS, "--log-format", "json"])
        .args(["--webhook-port", "0", "--leader-elect=false"])
        .args(["--message-id-domain", DOMAIN, "--shutdown-timeout", "5s"])
        .arg("--config")
        .arg(&config)
        .args(["--fulfilment-url", PUBLIC_AS_WRITTEN])
        .arg("--fulfilment-keys-file")
        .arg(&keys)
        .args([
            "--fulfilment-bind-address",
            &format!("127.0.0.1:{page_port}"),
        ])
        .args(["--fulfilment-trusted-proxies", PROXY]);
    let provider = Proc::spawn("provider", launch.command(), dir.join("provider.log"))?;
    cp.adopt(provider.pid())?;

    let reach = Reach {
        proxy_port,
        ca: &ca_file,
    };
    let result = story(&admin, &mailgun, &provider, dir, page_port, &reach).await;
    if let Err(e) = &result {
        capm_e2e::report_failure(
            e,
            dir,
            &["provider.log", "nginx.log", "nginx/logs/error.log"],
            40,
        );
    }
    drop(nginx);
    result
}

async fn story(
    admin: &Client,
    mailgun: &MailgunServer,
    provider: &Proc,
    dir: &Path,
    page_port: u16,
    reach: &Reach<'_>,
) -> Result<()> {
    for name in ["browsed", "spoofed", "direct"] {
        create_cluster_pair(admin, NS, name, "web-admin@example.com").await?;
    }

    // The browser, through the proxy.
    let link = mailed_link(mailgun, provider, "browsed").await?;
    ensure!(link.starts_with(&format!("{PUBLIC}/fulfil/")), "{link}");
    let target = format!("127.0.0.1:{}", reach.proxy_port);
    let report = browser::browse(&Visit {
        link: &link,
        screenshots: &dir.join("screenshots"),
        prefix: "proxied",
        fill: &[
            ("Control plane host", "api.browsed.example.com"),
            ("Control plane port", "6443"),
        ],
        select: &[],
        refused: None,
        proxy: Some((PUBLIC_HOST, &target)),
    })?;
    ensure!(report["request"]["status"] == 200, "{report}");
    page_says(
        &report,
        "submitted",
        "Recorded",
        &["api.browsed.example.com:6443"],
    )?;
    let note = fulfilled_event(admin, NS, "browsed").await?;
    ensure!(
        note.starts_with(&format!("From {BROWSER}:")) && !note.contains(PROXY),
        "the Event names the proxy, not the browser: {note}"
    );
    let client = logged_client(&provider.log(), "browsed")?;
    ensure!(
        client == BROWSER,
        "the log line names {client}, not the browser"
    );

    // A client that sends its own X-Forwarded-For through the proxy: the proxy appends the peer
    // it saw, and that (the first untrusted entry from the right) is the client.
    let link = mailed_link(mailgun, provider, "spoofed").await?;
    let spoofed = Forgery {
        name: "spoofed",
        from: BROWSER,
        link: &link,
        what: "a forged X-Forwarded-For through the proxy",
    };
    spoofed.is_not_believed(admin, provider, reach, dir).await?;

    // A client around the proxy, straight to the page, with a forged X-Forwarded-For: it is the
    // peer it is.
    let link = mailed_link(mailgun, provider, "direct").await?;
    let direct = link.replacen(PUBLIC, &format!("http://127.0.0.1:{page_port}"), 1);
    ensure!(direct != link, "{link}");
    let direct = Forgery {
        name: "direct",
        from: DIRECT,
        link: &direct,
        what: "a forged X-Forwarded-For from an untrusted peer",
    };
    direct.is_not_believed(admin, provider, reach, dir).await?;

    // The same peer, a made-up link and another forged address (each in another /24) per
    // request: were the header believed, every request would have a fresh budget.
    let made_up = format!(
        "http://127.0.0.1:{page_port}/fulfil/{}",
        "A".repeat(link.rsplit('/').next().unwrap_or_default().len())
    );
    let jar = dir.join("cookies-spender");
    let mut statuses = Vec::new();
    for i in 0..POSTS_PER_ADDRESS + 10 {
        let header = vec![format!("X-Forwarded-For: 198.51.{i}.7")];
        let (status, _) = curl(
            reach,
            SPENDER,
            &made_up,
            &jar,
            &header,
            Some("host=h&port=1&form-token=x"),
        )?;
        statuses.push(status);
    }
    let refused = statuses.iter().filter(|s| **s == 429).count();
    // (GCRA gives one submission back every 20 s: the last ten, sent within seconds, are refused
    // but for at most one.)
    ensure!(
        refused >= 9 && statuses[..POSTS_PER_ADDRESS].iter().all(|s| *s != 429),
        "forged addresses bought fresh budgets: {statuses:?}"
    );

    // The proxy kept no access log of the links.
    let access = fs::read_to_string(dir.join("nginx/logs/access.log")).unwrap_or_default();
    ensure!(
        !access.contains("/fulfil/"),
        "the proxy logged a link:\n{access}"
    );

    // Every object fulfilled: the endpoints as submitted.
    let clusters = dynamic_api(
        admin,
        NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunCluster",
    );
    for name in ["browsed", "spoofed", "direct"] {
        let host = clusters.get(name).await?.data["spec"]["controlPlaneEndpoint"]["host"].clone();
        ensure!(host == format!("api.{name}.example.com"), "{name}: {host}");
    }
    Ok(())
}
