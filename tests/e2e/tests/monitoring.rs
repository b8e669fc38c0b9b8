//! The monitoring files the project ships, checked without a cluster: the alert rules pass
//! their `promtool test rules` unit tests; every dashboard query is valid PromQL to promtool;
//! every kube-state-metrics series the rules and the dashboard read is one that
//! config/metrics/crd-metrics-config.yaml defines. (The provider's own series they read are
//! checked against a real scrape in `end_to_end.rs`.)

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
