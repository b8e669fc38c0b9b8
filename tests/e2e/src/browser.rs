//! The fulfilment page in a real browser: Debian's headless Chromium driven by Playwright for
//! Python (`tests/e2e/browser/fulfil_page.py`), and the checks the page's tests make of what each
//! page said and what the provider recorded.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::events::v1::Event;
use kube::{Api, Client, api::ListParams};
use serde_json::Value;

/// A program Debian installs at `default` (the variable `env` overrides), from `package`.
///
/// # Errors
/// When it is not installed.
pub fn debian_program(env: &str, default: &str, package: &str) -> Result<PathBuf> {
    let path = std::env::var_os(env).map_or_else(|| PathBuf::from(default), PathBuf::from);
    ensure!(
        path.exists(),
        "{} not found: `apt-get install {package}` (make deps does)",
        path.display()
    );
    Ok(path)
}

/// Debian's chromium (`CAPM_CHROMIUM` overrides).
///
/// # Errors
/// When it is not installed.
pub fn chromium() -> Result<PathBuf> {
    debian_program("CAPM_CHROMIUM", "/usr/bin/chromium", "chromium")
}

/// The page's hidden form token.
///
/// # Errors
/// When the page has none.
pub fn form_token(page: &str) -> Result<String> {
    let (_, rest) = page
        .split_once("name=\"form-token\" value=\"")
        .with_context(|| format!("no form token on the page: {page}"))?;
    Ok(rest.split('"').next().unwrap_or_default().to_owned())
}

/// The note of the `FulfilledThroughLink` Event about the object `name` in `namespace`, once
/// the provider has recorded it (within 30 s).
///
/// # Errors
/// When none is recorded in time.
pub async fn fulfilled_event(admin: &Client, namespace: &str, name: &str) -> Result<String> {
    link_event(admin, namespace, name, "FulfilledThroughLink").await
}

/// The note of the Event with `reason` (`FulfilledThroughLink`, or `AnsweredThroughLink` for a
/// repair request's answer) about the object `name` in `namespace`, once recorded (within 30 s).
///
/// # Errors
/// When none is recorded in time.
pub async fn link_event(
    admin: &Client,
    namespace: &str,
    name: &str,
    reason: &str,
) -> Result<String> {
    let events: Api<Event> = Api::namespaced(admin.clone(), namespace);
    crate::eventually(
        Duration::from_secs(30),
        &format!("the {reason} Event"),
        || {
            let events = events.clone();
            async move {
                Ok(events
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                    })
                    .and_then(|e| e.note))
            }
        },
    )
    .await
}

/// The fulfilment link in a mail's text.
///
/// # Errors
/// When the text has none.
pub fn link_in(body: &str) -> Result<String> {
    body.lines()
        .map(str::trim)
        .find(|l| l.starts_with("http") && l.contains("/fulfil/"))
        .map(str::to_owned)
        .with_context(|| format!("no fulfilment link in the mail:\n{body}"))
}

/// What the browser does with one link.
#[derive(Debug, Clone, Copy)]
pub struct Visit<'a> {
    /// The mailed link.
    pub link: &'a str,
    /// Where the screenshots go.
    pub screenshots: &'a Path,
    /// The screenshots' name prefix.
    pub prefix: &'a str,
    /// (label, value): fields filled by their accessible label.
    pub fill: &'a [(&'a str, &'a str)],
    /// (select id, option): choices made.
    pub select: &'a [(&'a str, &'a str)],
    /// An altered link, opened last.
    pub refused: Option<&'a str>,
    /// (host, `address:port`): the browser reaches the link's host there, a TLS proxy whose
    /// test certificate it accepts (Chromium trusts an NSS database, not a CA file; the tests
    /// check the certificate with curl `--cacert`).
    pub proxy: Option<(&'a str, &'a str)>,
}

/// The browser opens the link, fills the form, submits it and opens the link again: what each
/// page said, as JSON (keys `request`, `submitted`, `again`, and `refused` when asked).
///
/// # Errors
/// When the browser cannot be run or its report cannot be read.
pub fn browse(visit: &Visit<'_>) -> Result<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("browser/fulfil_page.py");
    fs::create_dir_all(visit.screenshots)?;
    let mut cmd = Command::new("python3");
    cmd.arg(&script)
        .arg("--chromium")
        .arg(chromium()?)
        .args(["--link", visit.link, "--prefix", visit.prefix])
        .arg("--screenshots")
        .arg(visit.screenshots);
    for (label, value) in visit.fill {
        cmd.arg("--fill").arg(format!("{label}={value}"));
    }
    for (id, option) in visit.select {
        cmd.arg("--select").arg(format!("{id}={option}"));
    }
    if let Some(refused) = visit.refused {
        cmd.args(["--refused", refused]);
    }
    if let Some((host, target)) = visit.proxy {
        cmd.arg("--map-host")
            .arg(format!("{host}={target}"))
            .arg("--ignore-https-errors");
    }
    let out = crate::run(&mut cmd, "the browser")?;
    serde_json::from_str(&out).with_context(|| format!("the browser's report: {out}"))
}

/// The page state `key` of a browser report has `h1` and contains every `texts`.
///
/// # Errors
/// When it does not.
pub fn page_says(report: &Value, key: &str, h1: &str, texts: &[&str]) -> Result<()> {
    let state = &report[key];
    ensure!(state["h1"] == h1, "{key}: heading {}: {state}", state["h1"]);
    let text = state["text"].as_str().unwrap_or_default();
    for want in texts {
        ensure!(
            text.contains(want),
            "{key}: {want:?} not on the page:\n{text}"
        );
    }
    Ok(())
}

/// Uses a mailed fulfilment `link` as a browser would, with curl: opens it (the page's cookie
/// lands in a jar in `dir`), then posts the form's `fields` with its token from the page's own
/// Origin `page`. Returns the answer's status and body.
///
/// # Errors
/// When curl fails or the link does not open.
pub fn fulfil_through_link(
    dir: &std::path::Path,
    page: &str,
    link: &str,
    fields: &[(&str, &str)],
) -> Result<(u16, String)> {
    let jar = dir.join(format!("jar-{}", fields.len()));
    let curl = |extra: &[&str]| -> Result<(u16, String)> {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "30",
                "-o",
                "-",
                "-w",
                "\n%{http_code}",
                "-c",
            ])
            .arg(&jar)
            .arg("-b")
            .arg(&jar)
            .args(extra)
            .arg(link)
            .output()
            .context("running curl")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').context("curl's output")?;
        Ok((code.trim().parse().context("the status")?, body.to_owned()))
    };
    let (status, form) = curl(&[])?;
    ensure!(status == 200, "opening the link: HTTP {status}:\n{form}");
    let token = form_token(&form)?;
    let mut body: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
    body.push(format!("form-token={token}"));
    let origin = format!("Origin: {page}");
    curl(&[
        "-H",
        &origin,
        "-H",
        "Content-Type: application/x-www-form-urlencoded",
        "--data-binary",
        &body.join("&"),
    ])
}
