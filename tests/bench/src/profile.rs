//! Where the API server's time goes during a drain: a CPU profile taken from its
//! `/debug/pprof/profile` (the bench starts it with `--profiling=true`), read with
//! `go tool pprof -traces` and summed by the parts of the server a write passes through, plus the
//! server's own CPU seconds and mean request latency by verb from its `/metrics`.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context;
use http_body_util::BodyExt;
use kube::Client;

/// The parts of the API server a write to a custom resource passes through, each named by the
/// frames that mark it. A sample counts toward every part one of its frames belongs to, so the
/// shares overlap (CEL runs inside validation, which runs inside the handler).
const PARTS: &[(&str, &[&str])] = &[
    (
        "CEL rules",
        &[
            "github.com/google/cel-go",
            "k8s.io/apiserver/pkg/cel",
            "apiextensions-apiserver/pkg/apiserver/schema/cel",
        ],
    ),
    (
        "OpenAPI schema validation",
        &[
            "k8s.io/kube-openapi/pkg/validation",
            "apiextensions-apiserver/pkg/apiserver/validation",
        ],
    ),
    (
        "validation ratcheting",
        &["apiextensions-apiserver/pkg/apiserver/validation.(*ratchet"],
    ),
    (
        "managedFields",
        &[
            "sigs.k8s.io/structured-merge-diff",
            "k8s.io/apimachinery/pkg/util/managedfields",
            "k8s.io/apiserver/pkg/endpoints/handlers/fieldmanager",
        ],
    ),
    (
        "JSON and conversion",
        &[
            "encoding/json",
            "sigs.k8s.io/json",
            "k8s.io/apimachinery/pkg/runtime/serializer",
            "k8s.io/apimachinery/pkg/apis/meta/v1/unstructured",
            "k8s.io/apimachinery/pkg/runtime.DeepCopyJSON",
        ],
    ),
    (
        "patch application",
        &[
            "github.com/evanphx/json-patch",
            "k8s.io/apiserver/pkg/endpoints/handlers.(*patcher)",
        ],
    ),
    (
        "admission",
        &["k8s.io/apiserver/pkg/admission", "admission/plugin"],
    ),
    (
        "authentication and authorization",
        &[
            "k8s.io/apiserver/pkg/authentication",
            "k8s.io/apiserver/pkg/authorization",
            "k8s.io/apiserver/pkg/endpoints/filters.WithAuth",
            "plugin/pkg/auth/authorizer/rbac",
        ],
    ),
    (
        "etcd client",
        &[
            "go.etcd.io/etcd/client",
            "k8s.io/apiserver/pkg/storage/etcd3",
        ],
    ),
    (
        "watch cache and watchers",
        &["k8s.io/apiserver/pkg/storage/cacher"],
    ),
    (
        "TLS and HTTP",
        &["crypto/tls", "net/http", "golang.org/x/net/http2"],
    ),
    (
        "garbage collection",
        &[
            "runtime.gcBgMarkWorker",
            "runtime.gcDrain",
            "runtime.bgsweep",
            "runtime.bgscavenge",
        ],
    ),
    ("allocation", &["runtime.mallocgc"]),
];

/// A profile summed by [`PARTS`].
#[derive(Debug, Default)]
pub struct Summary {
    /// CPU seconds sampled.
    pub total: f64,
    /// Seconds of samples with a frame in each part, in [`PARTS`] order.
    pub parts: Vec<(&'static str, f64)>,
    /// The functions with the most samples of their own.
    pub top_flat: Vec<(String, f64)>,
}

/// Starts a CPU profile of the API server over the next `seconds`; the task returns its bytes.
pub fn start(client: Client, seconds: u64) -> tokio::task::JoinHandle<anyhow::Result<Vec<u8>>> {
    tokio::spawn(async move {
        let req = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
            .body(Vec::new())?;
        let response = tokio::time::timeout(
            Duration::from_secs(seconds + 30),
            client.send(req.map(kube::client::Body::from)),
        )
        .await
        .context("the profile did not come back")??;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        anyhow::ensure!(
            status.is_success(),
            "/debug/pprof/profile answered {status}: {}",
            String::from_utf8_lossy(&bytes)
        );
        Ok(bytes.to_vec())
    })
}

/// Saves `bytes` under `dir` as `<name>.pprof` and sums it; `None` (with the reason printed)
/// when `go tool pprof` cannot read it.
pub fn save_and_summarize(
    dir: &Path,
    name: &str,
    bytes: &[u8],
) -> anyhow::Result<(PathBuf, Option<Summary>)> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{name}.pprof"));
    std::fs::write(&path, bytes)?;
    let out = std::process::Command::new("go")
        .args(["tool", "pprof", "-traces"])
        .arg(&path)
        .output();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) => {
            eprintln!(
                "go tool pprof could not read {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            return Ok((path, None));
        }
        Err(e) => {
            eprintln!(
                "go tool pprof not run ({e}); the profile is in {}",
                path.display()
            );
            return Ok((path, None));
        }
    };
    Ok((path, Some(summarize(&String::from_utf8_lossy(&out.stdout)))))
}

/// A `pprof -traces` duration ("10ms", "1.20s", "500us") in seconds.
fn seconds(value: &str) -> Option<f64> {
    let (number, scale) = if let Some(v) = value.strip_suffix("ms") {
        (v, 1e-3)
    } else if let Some(v) = value.strip_suffix("us") {
        (v, 1e-6)
    } else if let Some(v) = value.strip_suffix("ns") {
        (v, 1e-9)
    } else if let Some(v) = value.strip_suffix('s') {
        (v, 1.0)
    } else {
        return None;
    };
    number.parse::<f64>().ok().map(|n| n * scale)
}

/// Sums `pprof -traces` output: each trace is a value and its leaf on one line, then its callers,
/// separated by `-----------+---` lines.
fn summarize(traces: &str) -> Summary {
    let mut summary = Summary {
        parts: PARTS.iter().map(|(name, _)| (*name, 0.0)).collect(),
        ..Summary::default()
    };
    let mut flat: BTreeMap<String, f64> = BTreeMap::new();
    for trace in traces.split("-----------+") {
        let mut lines = trace
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('-'));
        let Some(first) = lines.next() else { continue };
        let Some((value, leaf)) = first.split_once(char::is_whitespace) else {
            continue;
        };
        let Some(value) = seconds(value) else {
            continue;
        };
        let leaf = leaf.trim();
        let frames: Vec<&str> = std::iter::once(leaf).chain(lines).collect();
        summary.total += value;
        *flat.entry(leaf.to_owned()).or_default() += value;
        for ((_, marks), (_, sum)) in PARTS.iter().zip(summary.parts.iter_mut()) {
            if frames.iter().any(|f| marks.iter().any(|m| f.contains(m))) {
                *sum += value;
            }
        }
    }
    let mut top: Vec<_> = flat.into_iter().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    top.truncate(8);
    summary.top_flat = top;
    summary
}

impl Summary {
    /// Prints the parts as shares of the profile, and as CPU per object of the whole drain
    /// (`cpu_per_object`, from the server's own counter: the profile may cover only its start).
    pub fn print(&self, seconds: u64, cpu_per_object: f64) {
        println!(
            "  API server CPU profile     {:.2} s sampled over the drain's first {seconds} s; share with a frame in (and that share of the drain's CPU per object):",
            self.total,
        );
        for (name, sum) in &self.parts {
            if *sum > 0.0 {
                let share = sum / self.total;
                println!(
                    "    {name:<32} {:>5.1}%  {:>6.2} ms/object",
                    100.0 * share,
                    1000.0 * share * cpu_per_object
                );
            }
        }
        println!(
            "    top functions (self)         {}",
            self.top_flat
                .iter()
                .map(|(f, s)| format!("{} {:.1}%", short(f), 100.0 * s / self.total))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// A Go function name without its package path.
fn short(function: &str) -> &str {
    function.rsplit('/').next().unwrap_or(function)
}

/// The API server's own counters that a drain moves: CPU seconds, and the summed latency and
/// count of requests by `VERB resource[/subresource]`.
#[derive(Debug, Default, Clone)]
pub struct ServerCounters {
    /// `process_cpu_seconds_total`.
    pub cpu_seconds: f64,
    /// `apiserver_request_duration_seconds` `_sum` and `_count` by request kind.
    pub latency: BTreeMap<String, (f64, f64)>,
}

impl std::ops::Sub for ServerCounters {
    type Output = ServerCounters;
    fn sub(self, rhs: ServerCounters) -> ServerCounters {
        let mut latency = self.latency;
        for (k, (s, c)) in rhs.latency {
            let e = latency.entry(k).or_default();
            e.0 -= s;
            e.1 -= c;
        }
        latency.retain(|_, (_, c)| *c > 0.0);
        ServerCounters {
            cpu_seconds: self.cpu_seconds - rhs.cpu_seconds,
            latency,
        }
    }
}

/// Reads [`ServerCounters`] from the API server's `/metrics`.
pub async fn server_counters(client: &Client) -> anyhow::Result<ServerCounters> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await?;
    let mut counters = ServerCounters::default();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        if series == "process_cpu_seconds_total" {
            counters.cpu_seconds = value;
            continue;
        }
        let (is_sum, labels) = if let Some(l) =
            series.strip_prefix("apiserver_request_duration_seconds_sum{")
        {
            (true, l)
        } else if let Some(l) = series.strip_prefix("apiserver_request_duration_seconds_count{") {
            (false, l)
        } else {
            continue;
        };
        let verb = crate::label(labels, "verb");
        if verb == "WATCH" || verb == "CONNECT" {
            continue;
        }
        let sub = crate::label(labels, "subresource");
        let kind = format!(
            "{verb} {}{}{sub}",
            crate::label(labels, "resource"),
            if sub.is_empty() { "" } else { "/" }
        );
        let entry = counters.latency.entry(kind).or_default();
        if is_sum {
            entry.0 += value;
        } else {
            entry.1 += value;
        }
    }
    Ok(counters)
}

impl ServerCounters {
    /// Prints CPU per object and the mean latency of the request kinds that ran at least once
    /// per ten objects.
    pub fn print(&self, objects: usize, secs: f64) {
        let n = objects as f64;
        println!(
            "  API server CPU             {:.2} s ({:.2} ms per object, {:.0}% of one core over the drain)",
            self.cpu_seconds,
            1000.0 * self.cpu_seconds / n,
            100.0 * self.cpu_seconds / secs
        );
        let mut kinds: Vec<_> = self
            .latency
            .iter()
            .filter(|(_, (_, c))| *c >= n / 10.0)
            .collect();
        kinds.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        println!(
            "  API server mean latency    {}",
            kinds
                .iter()
                .map(|(k, (s, c))| format!("{k} {:.1} ms ×{c:.0}", 1000.0 * s / c))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_are_summed_by_part_and_leaf() {
        let text = "File: kube-apiserver\nType: cpu\n-----------+-------\n      20ms   runtime.memmove\n             github.com/google/cel-go/interpreter.(*x).Eval\n             k8s.io/kube-openapi/pkg/validation/validate.(*SchemaValidator).Validate\n-----------+-------\n     1.5s   crypto/tls.(*Conn).Read\n-----------+-------\n";
        let s = summarize(text);
        assert!((s.total - 1.52).abs() < 1e-9);
        let part = |name| s.parts.iter().find(|p| p.0 == name).unwrap().1;
        assert!((part("CEL rules") - 0.02).abs() < 1e-9);
        assert!((part("OpenAPI schema validation") - 0.02).abs() < 1e-9);
        assert!((part("TLS and HTTP") - 1.5).abs() < 1e-9);
        assert_eq!(part("managedFields"), 0.0);
        assert_eq!(s.top_flat[0].0, "crypto/tls.(*Conn).Read");
    }
}
