//! The monitoring files the project ships (config/prometheus/rules.yaml, config/grafana/'s
//! dashboard, config/metrics/'s kube-state-metrics configuration) read the way the tests check
//! them: the PromQL expressions they hold, the series names those expressions read, the series
//! names kube-state-metrics derives from the configuration.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

/// `config/`, relative to this crate.
pub fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config")
}

/// Every alert's and recording rule's (name, expression) in a Prometheus rules file.
///
/// # Errors
/// When the file cannot be read or is not a rules file.
pub fn rule_expressions(path: &Path) -> Result<Vec<(String, String)>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    let mut out = Vec::new();
    for group in file["groups"].as_array().context("no groups")? {
        for rule in group["rules"].as_array().context("a group without rules")? {
            let name = rule["alert"]
                .as_str()
                .or_else(|| rule["record"].as_str())
                .context("a rule without alert or record")?;
            let expr = rule["expr"].as_str().context("a rule without expr")?;
            out.push((name.to_owned(), expr.to_owned()));
        }
    }
    Ok(out)
}

/// Every panel target's (panel title, expression) in a Grafana dashboard, rows' panels included.
///
/// # Errors
/// When the file cannot be read or a target has no `expr`.
pub fn dashboard_queries(path: &Path) -> Result<Vec<(String, String)>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let dashboard: serde_json::Value = serde_json::from_str(&text)?;
    let mut out = Vec::new();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .context("no panels")?
        .iter()
        .collect();
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .with_context(|| format!("a target of panel {} without expr", panel["title"]))?;
            out.push((
                panel["title"].as_str().unwrap_or_default().to_owned(),
                expr.to_owned(),
            ));
        }
    }
    out.reverse();
    Ok(out)
}

/// `expr` with Grafana's built-in interval variables replaced by durations, as Grafana sends it.
pub fn grafana_expanded(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
}

/// The series names a PromQL expression reads: identifiers that are neither functions,
/// keywords, label names (in matchers or in `by`/`without`/`on`/`ignoring`/`group_*` lists) nor
/// inside strings, ranges or durations.
pub fn series_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "atan2",
        "inf",
        "nan",
        // Aggregations, which may take `by (...)` before their parentheses.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut braces, mut brackets) = (0, 0usize, 0usize);
    // Set after a label-list keyword: the next parenthesised list holds label names.
    let mut label_list_next = false;
    let mut in_label_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' && c != '`' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            '[' => brackets += 1,
            ']' => brackets = brackets.saturating_sub(1),
            '(' if label_list_next => {
                in_label_list = true;
                label_list_next = false;
            }
            ')' if in_label_list => in_label_list = false,
            c if c.is_ascii_digit() || c == '.' => {
                // Numbers and durations (5m, 1e3, 0.99).
                while i + 1 < chars.len()
                    && (chars[i + 1].is_ascii_alphanumeric() || chars[i + 1] == '.')
                {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i + 1 < chars.len()
                    && (chars[i + 1].is_ascii_alphanumeric()
                        || chars[i + 1] == '_'
                        || chars[i + 1] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..=i].iter().collect();
                let next = chars[i + 1..].iter().find(|c| !c.is_whitespace());
                if LABEL_LISTS.contains(&word.as_str()) {
                    label_list_next = true;
                } else if braces == 0
                    && brackets == 0
                    && !in_label_list
                    && next != Some(&'(')
                    && !KEYWORDS.contains(&word.as_str())
                {
                    names.insert(word);
                }
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// The series names kube-state-metrics exports for a CustomResourceStateMetrics configuration:
/// each resource's `metricNamePrefix` and each metric's `name`, joined by `_`.
///
/// # Errors
/// When the file cannot be read or is not such a configuration.
pub fn crd_metric_names(path: &Path) -> Result<BTreeSet<String>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let config: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    let mut names = BTreeSet::new();
    for resource in config["spec"]["resources"]
        .as_array()
        .context("no spec.resources")?
    {
        let prefix = resource["metricNamePrefix"]
            .as_str()
            .context("a resource without metricNamePrefix")?;
        for metric in resource["metrics"].as_array().context("no metrics")? {
            let name = metric["name"].as_str().context("a metric without name")?;
            names.insert(format!("{prefix}_{name}"));
        }
    }
    Ok(names)
}

/// The sample names in a Prometheus text exposition (`name` of each `name{...} value` line).
pub fn exposition_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// Every series name the shipped alert rules and dashboard read, with where each is read.
///
/// # Errors
/// When a file cannot be read.
pub fn shipped_series_names() -> Result<BTreeSet<(String, String)>> {
    let dir = config_dir();
    let mut out = BTreeSet::new();
    for (alert, expr) in rule_expressions(&dir.join("prometheus/rules.yaml"))? {
        for name in series_names(&expr) {
            out.insert((name, format!("alert {alert}")));
        }
    }
    for (panel, expr) in dashboard_queries(&dir.join("grafana/cluster-api-provider-mailgun.json"))?
    {
        for name in series_names(&grafana_expanded(&expr)) {
            out.insert((name, format!("panel {panel:?}")));
        }
    }
    Ok(out)
}

/// One series kube-state-metrics would export: name, labels, value.
pub type Sample = (String, std::collections::BTreeMap<String, String>, f64);

/// The series `config` (a CustomResourceStateMetrics configuration) gives `object` (a custom
/// resource as the API server returns it), following kube-state-metrics's documented rules for
/// the parts the configuration uses: resource-level `labelsFromPath`; `Gauge`, `StateSet` and
/// `Info` metrics with `path`, `labelsFromPath`, `valueFrom`, `list`, `labelName` and
/// `nilIsZero`; a list at `path` gives one series per element; values are numbers, booleans
/// (1/0) or RFC 3339 times (Unix seconds). This is not kube-state-metrics (which cannot be built
/// here): it shows that every path the configuration names resolves on real objects.
///
/// # Errors
/// When the configuration is malformed or a value cannot be read as a number.
pub fn crd_metric_samples(
    config: &serde_json::Value,
    object: &serde_json::Value,
) -> Result<Vec<Sample>> {
    use serde_json::Value;
    use std::collections::BTreeMap;

    fn at<'a>(v: &'a Value, path: &Value) -> Option<&'a Value> {
        path.as_array()
            .into_iter()
            .flatten()
            .try_fold(v, |v, key| v.get(key.as_str()?))
            .filter(|v| !v.is_null())
    }
    fn text(v: &Value) -> Option<String> {
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Bool(b) => Some(b.to_string()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }
    fn number(v: &Value) -> Result<f64> {
        Ok(match v {
            Value::Number(n) => n.as_f64().context("a number")?,
            Value::Bool(b) => f64::from(u8::from(*b)),
            Value::String(s) => match s.parse::<f64>() {
                Ok(n) => n,
                Err(_) => s
                    .parse::<jiff::Timestamp>()
                    .with_context(|| format!("{s:?} is neither a number nor a time"))?
                    .as_second() as f64,
            },
            other => anyhow::bail!("{other} is not a value"),
        })
    }
    fn labels(v: &Value, spec: &Value, into: &mut BTreeMap<String, String>) {
        for (label, path) in spec.as_object().into_iter().flatten() {
            if let Some(value) = at(v, path).and_then(text) {
                into.insert(label.clone(), value);
            }
        }
    }

    let kind = object["kind"].as_str().context("an object without kind")?;
    let mut out = Vec::new();
    for resource in config["spec"]["resources"]
        .as_array()
        .context("no resources")?
    {
        if resource["groupVersionKind"]["kind"] != kind {
            continue;
        }
        let prefix = resource["metricNamePrefix"]
            .as_str()
            .context("metricNamePrefix")?;
        let mut common = BTreeMap::new();
        labels(object, &resource["labelsFromPath"], &mut common);
        for metric in resource["metrics"].as_array().context("metrics")? {
            let name = format!("{prefix}_{}", metric["name"].as_str().context("name")?);
            let each = &metric["each"];
            let kind = each["type"].as_str().context("each.type")?;
            let spec = match kind {
                "Gauge" => &each["gauge"],
                "StateSet" => &each["stateSet"],
                "Info" => &each["info"],
                other => anyhow::bail!("{name}: type {other} is not handled"),
            };
            let found = match spec.get("path") {
                Some(path) => at(object, path),
                None => Some(object),
            };
            let elements: Vec<&Value> = match found {
                Some(Value::Array(items)) => items.iter().collect(),
                Some(v) => vec![v],
                None if kind == "Gauge" && spec["nilIsZero"] == true => {
                    out.push((name, common.clone(), 0.0));
                    continue;
                }
                None => continue,
            };
            for element in elements {
                let mut series = common.clone();
                labels(element, &spec["labelsFromPath"], &mut series);
                let value = match spec.get("valueFrom") {
                    Some(path) => at(element, path),
                    None => Some(element),
                };
                match kind {
                    "Gauge" => {
                        if let Some(v) = value {
                            out.push((name.clone(), series, number(v)?));
                        }
                    }
                    "StateSet" => {
                        let state = value.and_then(text);
                        let label = spec["labelName"].as_str().context("labelName")?;
                        for item in spec["list"].as_array().context("list")? {
                            let item = item.as_str().context("a list item")?;
                            let mut series = series.clone();
                            series.insert(label.to_owned(), item.to_owned());
                            let on = state.as_deref() == Some(item);
                            out.push((name.clone(), series, f64::from(u8::from(on))));
                        }
                    }
                    _ => out.push((name.clone(), series, 1.0)),
                }
            }
        }
    }
    Ok(out)
}

/// The value of the one series named `name` whose labels include `with`, if exactly one matches.
pub fn sample_value(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> Option<f64> {
    let mut matching = samples.iter().filter(|(n, labels, _)| {
        n == name
            && with
                .iter()
                .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
    });
    let (_, _, value) = matching.next()?;
    matching.next().is_none().then_some(*value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_names_skip_functions_labels_strings_and_durations() {
        let names = series_names(
            r#"sum by (job, le) (rate(a_total{code!~"2..", x='y'}[5m])) / on (uid) group_left (name) b:rec offset 1h > 0.5 and c"#,
        );
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            ["a_total", "b:rec", "c"]
        );
        let names =
            series_names("histogram_quantile(0.99, sum by (le) (rate(x_bucket[1m]))) - time()");
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["x_bucket"]);
    }

    #[test]
    fn exposition_names_are_the_sample_names() {
        let names = exposition_names(
            "# HELP a A.\n# TYPE a counter\na{x=\"1\"} 1\nb_bucket{le=\"+Inf\"} 2\nc 3\n",
        );
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            ["a", "b_bucket", "c"]
        );
    }

    #[test]
    fn crd_metrics_follow_the_configuration() {
        let config: serde_json::Value = serde_yaml_ng::from_str(
            &fs::read_to_string(config_dir().join("metrics/crd-metrics-config.yaml")).unwrap(),
        )
        .unwrap();
        let object = serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "MailgunMachine",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"cluster.x-k8s.io/cluster-name": "c"},
                         "annotations": {"cluster.x-k8s.io/paused": ""}},
            "spec": {"priority": "Urgent"},
            "status": {"mail": {"state": "Sent", "sentAt": "2026-01-01T00:01:00Z"},
                       "conditions": [{"type": "Provisioned", "status": "False", "lastTransitionTime": "2026-01-01T00:01:00Z"}]},
        });
        let samples = crd_metric_samples(&config, &object).unwrap();
        let value = |name: &str, with: &[(&str, &str)]| sample_value(&samples, name, with);
        assert_eq!(
            value("capi_mailgunmachine_created", &[("cluster_name", "c")]),
            Some(1_767_225_600.0)
        );
        assert_eq!(
            value("capi_mailgunmachine_status_mail_sent_at", &[]),
            Some(1_767_225_660.0)
        );
        assert_eq!(
            value(
                "capi_mailgunmachine_status_mail_state",
                &[("state", "Sent")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                "capi_mailgunmachine_status_mail_state",
                &[("state", "Pending")]
            ),
            Some(0.0)
        );
        assert_eq!(
            value("capi_mailgunmachine_status_provisioned", &[]),
            Some(0.0)
        );
        assert_eq!(
            value(
                "capi_mailgunmachine_status_condition",
                &[("type", "Provisioned"), ("status", "False")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                "capi_mailgunmachine_annotation_paused",
                &[("paused_value", "")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value("capi_mailgunmachine_info", &[("priority", "Urgent")]),
            Some(1.0)
        );
        assert!(
            !samples
                .iter()
                .any(|(n, _, _)| n.starts_with("capi_mailguncluster") || n.ends_with("_owner"))
        );
    }
}
