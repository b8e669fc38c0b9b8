//! The monitoring files the project ships, checked without a cluster: the alert rules pass
//! their `promtool test rules` unit tests (with the Cluster API core manager's series beside the
//! provider's); every alert has its runbook section and reads the provider's series through its
//! job and namespace; every dashboard query is valid PromQL to promtool and filters by the
//! dashboard's variables; every kube-state-metrics series the rules and the dashboard read is one
//! that config/metrics/crd-metrics-config.yaml defines. (The provider's own series they read are
//! checked against a real scrape in `end_to_end.rs`; kube-state-metrics's and the alerts on
//! real series in `kube_state_metrics.rs`.)

use std::fmt::Write as _;

use anyhow::{Result, ensure};
use capm_e2e::{
    monitoring::{
        config_dir, crd_metric_names, dashboard_queries, grafana_expanded, shipped_series_names,
    },
    promtool,
};

#[test]
fn alert_rules_pass_their_promtool_unit_tests() -> Result<()> {
    let dir = config_dir().join("prometheus");
    let rules = dir.join("rules.yaml");
    let (ok, out) = promtool(&["check", "rules", &rules.to_string_lossy()])?;
    ensure!(ok, "promtool check rules:\n{out}");
    let (ok, out) = promtool(&[
        "test",
        "rules",
        &dir.join("rules_test.yaml").to_string_lossy(),
    ])?;
    println!("promtool test rules config/prometheus/rules_test.yaml:\n{out}");
    ensure!(ok && out.contains("SUCCESS"), "promtool test rules:\n{out}");
    Ok(())
}

#[test]
fn every_dashboard_query_parses() -> Result<()> {
    // promtool parses expressions only inside rules files: one recording rule per query.
    let queries =
        dashboard_queries(&config_dir().join("grafana/cluster-api-provider-mailgun.json"))?;
    ensure!(queries.len() >= 10, "only {} queries", queries.len());
    let mut rules = String::from("groups:\n  - name: dashboard-queries\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let expr = serde_json::to_string(&grafana_expanded(expr))?;
        writeln!(
            rules,
            "      - record: dashboard:query_{i}\n        expr: {expr}"
        )?;
    }
    let file = tempfile::Builder::new().suffix(".yaml").tempfile()?;
    std::fs::write(file.path(), &rules)?;
    let (ok, out) = promtool(&["check", "rules", &file.path().to_string_lossy()])?;
    ensure!(
        ok && out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "promtool check rules on the dashboard's queries:\n{out}\n{rules}"
    );
    Ok(())
}

#[test]
fn kube_state_metrics_series_read_are_defined_by_the_configuration() -> Result<()> {
    let defined = crd_metric_names(&config_dir().join("metrics/crd-metrics-config.yaml"))?;
    for kind in ["mailguncluster", "mailgunmachine"] {
        for metric in [
            "info",
            "created",
            "annotation_paused",
            "status_condition",
            "status_condition_last_transition_time",
            "owner",
            "status_mail_state",
            "status_mail_sent_at",
            "status_provisioned",
        ] {
            let name = format!("capi_{kind}_{metric}");
            ensure!(
                defined.contains(&name),
                "{name} is not defined: {defined:?}"
            );
        }
    }
    let read = shipped_series_names()?;
    let undefined: Vec<_> = read
        .iter()
        .filter(|(name, _)| name.starts_with("capi_") && !defined.contains(name))
        .collect();
    ensure!(
        undefined.is_empty(),
        "read but not defined in crd-metrics-config.yaml: {undefined:?}"
    );
    ensure!(
        read.iter().any(|(name, _)| name.starts_with("capi_")),
        "nothing read from kube-state-metrics: {read:?}"
    );
    Ok(())
}

#[test]
fn every_alert_has_a_runbook_section_and_selects_the_providers_series() -> Result<()> {
    let dir = config_dir().join("prometheus");
    let text = std::fs::read_to_string(dir.join("rules.yaml"))?;
    let file: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    let runbooks = std::fs::read_to_string(config_dir().join("../docs/runbooks.md"))?;
    // GitHub's anchors of `## Name` headings: the name in lower case.
    let anchors: Vec<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_lowercase())
        .collect();
    let mut alerts = Vec::new();
    for rule in file["groups"][0]["rules"].as_array().into_iter().flatten() {
        let alert = rule["alert"].as_str().unwrap_or_default();
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_default();
        let (page, anchor) = url.split_once('#').unwrap_or_default();
        ensure!(
            page.ends_with("/docs/runbooks.md") && anchor == alert.to_lowercase(),
            "{alert}: runbook_url {url:?}"
        );
        ensure!(
            anchors.contains(&anchor.to_owned()),
            "{alert}: docs/runbooks.md has no section {anchor:?} (sections: {anchors:?})"
        );
        // Every series the provider exports is read with the provider's job and namespace;
        // kube-state-metrics's capi_mailgun* names are ours alone.
        let expr = rule["expr"].as_str().unwrap_or_default();
        for name in capm_e2e::monitoring::series_names(expr) {
            if name.starts_with("capi_mailgun") {
                continue;
            }
            let selected = format!(
                "{name}{{job=\"capm-controller-manager-metrics\", namespace=\"capm-system\""
            );
            ensure!(
                expr.matches(&name as &str).count() == expr.matches(&selected as &str).count(),
                "{alert}: {name} read without the provider's selector: {expr}"
            );
        }
        alerts.push(alert.to_owned());
    }
    ensure!(
        alerts.len() == anchors.len() && alerts.contains(&"CapmTargetDown".to_owned()),
        "alerts {alerts:?}, runbook sections {anchors:?}"
    );
    Ok(())
}

#[test]
fn every_dashboard_panel_filters_by_the_variables() -> Result<()> {
    let path = config_dir().join("grafana/cluster-api-provider-mailgun.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for v in ["datasource", "cluster", "job", "namespace"] {
        ensure!(variables.contains(&v), "no variable {v}: {variables:?}");
    }
    for (panel, expr) in dashboard_queries(&path)? {
        for name in capm_e2e::monitoring::series_names(&grafana_expanded(&expr)) {
            // kube-state-metrics's series carry its job and their objects' namespaces: filtered
            // by cluster only.
            let wanted = if name.starts_with("capi_mailgun") {
                format!("{name}{{cluster=~\"$cluster\"")
            } else {
                format!("{name}{{job=~\"$job\", namespace=~\"$namespace\", cluster=~\"$cluster\"")
            };
            ensure!(
                expr.matches(&name as &str).count() == expr.matches(&wanted as &str).count(),
                "panel {panel:?}: {name} not filtered by the variables: {expr}"
            );
        }
    }
    Ok(())
}
