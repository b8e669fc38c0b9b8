//! The monitoring files the project ships (config/prometheus/rules.yaml, config/grafana/'s
//! dashboard, config/metrics/'s kube-state-metrics configuration) read the way the tests check
//! them: the PromQL expressions they hold, the series names those expressions read, the series
//! names the kube-state-metrics configuration declares; and the samples of a real scrape.

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

/// One sample of a Prometheus text exposition: name, labels, value.
pub type Sample = (String, std::collections::BTreeMap<String, String>, f64);

/// The samples of a Prometheus text exposition (`name{label="value",...} value [timestamp]`
/// lines; label values unescaped).
///
/// # Errors
/// When a sample line is malformed.
pub fn parse_exposition(exposition: &str) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in exposition.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || format!("a malformed sample line: {line:?}");
        let name_end = line.find(['{', ' ']).with_context(bad)?;
        let name = line[..name_end].to_owned();
        let mut labels = std::collections::BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            let mut key = String::new();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '}' if key.is_empty() => {
                        end = Some(i);
                        break;
                    }
                    ',' | ' ' if key.is_empty() => {}
                    '=' => {
                        let Some((_, '"')) = chars.next() else {
                            anyhow::bail!(bad());
                        };
                        let mut value = String::new();
                        loop {
                            match chars.next().with_context(bad)? {
                                (_, '\\') => match chars.next().with_context(bad)?.1 {
                                    'n' => value.push('\n'),
                                    other => value.push(other),
                                },
                                (_, '"') => break,
                                (_, other) => value.push(other),
                            }
                        }
                        labels.insert(std::mem::take(&mut key), value);
                    }
                    other => key.push(other),
                }
            }
            rest = &body[end.with_context(bad)? + 1..];
        }
        let value = rest.split_whitespace().next().with_context(bad)?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().with_context(bad)?,
        };
        out.push((name, labels, value));
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
    fn exposition_samples_keep_labels_and_values() {
        let samples = parse_exposition(
            "# HELP a A.\n# TYPE a gauge\na{x=\"1\",y=\"q\\\"uote\"} 1.5\nb 2 1700000000000\nc{} +Inf\n",
        )
        .unwrap();
        assert_eq!(sample_value(&samples, "a", &[("y", "q\"uote")]), Some(1.5));
        assert_eq!(sample_value(&samples, "a", &[("x", "2")]), None);
        assert_eq!(sample_value(&samples, "b", &[]), Some(2.0));
        assert_eq!(sample_value(&samples, "c", &[]), Some(f64::INFINITY));
        assert!(parse_exposition("d{x=1} 1").is_err());
    }
}
