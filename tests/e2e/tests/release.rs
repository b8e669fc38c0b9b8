//! `make release` against a real registry (issue 36): the CNCF distribution registry on loopback
//! with TLS, `hack/release.sh` pushing this build's image and chart with a cosign key, and what a
//! user then checks with the real clients: the image by tag and by digest (the archive's own),
//! the chart from `oci://` with that digest pinned, the clusterctl assets pinned to it, the
//! CycloneDX SBOM, SHA256SUMS, and every signature (image, chart, SBOM attestation, checksums)
//! verifying with the release's public key and not with another.
//!
//! The Pods test (`pods.rs`, root) installs from such a registry onto a node.

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result, ensure};
use base64::Engine as _;
use capm_e2e::{
    provider_binary,
    release::{CHART, Registry, key_pair, release},
    run,
};

/// Runs `cmd`, returns whether it succeeded and its combined output.
fn outcome(cmd: &mut Command) -> Result<(bool, String)> {
    let out = cmd.output()?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn release_pushes_a_signed_image_and_chart_to_a_registry() -> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let registry = Registry::start(dir).await?;
    let home = dir.join("client");
    let (key, _) = key_pair(&registry, &dir.join("keys"))?;
    let out = dir.join("out");
    let released = release(&registry, "capm", &provider_binary()?, &out, Some(&key))?;
    registry.check_alive()?;
    let version = &released.version;
    ensure!(version == env!("CARGO_PKG_VERSION"), "version {version}");
    let repository = format!("{}/capm/cluster-api-provider-mailgun", registry.host);
    ensure!(
        released.image == format!("{repository}@{}", released.image_digest),
        "{}",
        released.image
    );

    // The image: the tag and the digest name the same manifest; its config is the provider's.
    let crane = |args: &[&str]| -> Result<String> {
        let mut cmd = registry.client("crane", &home)?;
        cmd.args(args);
        run(&mut cmd, &format!("crane {}", args.join(" ")))
    };
    let by_tag = crane(&["digest", &format!("{repository}:{version}")])?;
    ensure!(
        by_tag.trim() == released.image_digest,
        "tag {version} is {by_tag}"
    );
    let config: serde_json::Value = serde_json::from_str(&crane(&["config", &released.image])?)?;
    ensure!(
        config["config"]["User"] == "65532:65532"
            && config["config"]["Entrypoint"] == serde_json::json!(["/manager"]),
        "the image's config: {config}"
    );

    // The chart from the registry renders a Deployment of the image by digest.
    let helm = |args: &[&str]| -> Result<String> {
        let mut cmd = registry.client("helm", &home)?;
        cmd.args(args);
        run(&mut cmd, &format!("helm {}", args.join(" ")))
    };
    ensure!(
        released.chart == format!("oci://{}/capm/charts/{CHART}", registry.host),
        "{}",
        released.chart
    );
    let rendered = helm(&[
        "template",
        "capm",
        &released.chart,
        "--version",
        version,
        "--set",
        "mail.recipient=ops@example.com",
        "--set",
        "mail.mailgun.domain=mg.example.com",
        "--set",
        "mail.mailgun.apiKeySecret.name=key",
    ])?;
    ensure!(
        rendered.contains(&format!("image: \"{}\"", released.image)),
        "the chart's Deployment does not run {}",
        released.image
    );
    let shown = helm(&["show", "chart", &released.chart, "--version", version])?;
    ensure!(
        shown.contains(&format!("version: {version}"))
            && shown.contains(&format!("appVersion: {version}")),
        "{shown}"
    );

    // out/: the clusterctl assets pinned to the same image, the SBOM, the checksums.
    let components = fs::read_to_string(out.join("infrastructure-components.yaml"))?;
    ensure!(
        components.contains(&format!("image: {}", released.image)),
        "infrastructure-components.yaml does not run {}",
        released.image
    );
    let page = fs::read_to_string(out.join("fulfilment-page-components.yaml"))?;
    ensure!(
        page.contains(&format!("image: {}", released.image)),
        "fulfilment-page-components.yaml does not run {}",
        released.image
    );
    let sbom_file = out.join(format!("{CHART}-{version}.cdx.json"));
    let sbom: serde_json::Value = serde_json::from_str(&fs::read_to_string(&sbom_file)?)?;
    let names: Vec<&str> = sbom["components"]
        .as_array()
        .context("the SBOM has no components")?
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    ensure!(
        sbom["bomFormat"] == "CycloneDX"
            && ["kube", "tokio", "rustls", "capm-mailer"]
                .iter()
                .all(|c| names.contains(c)),
        "the SBOM's components: {names:?}"
    );
    let lock = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock"))?;
    for c in sbom["components"].as_array().into_iter().flatten() {
        if let (Some(name), Some(v)) = (c["name"].as_str(), c["version"].as_str()) {
            ensure!(
                lock.contains(&format!("name = \"{name}\"\nversion = \"{v}\"")),
                "the SBOM's {name} {v} is not in Cargo.lock"
            );
        }
    }
    let sums = run(
        Command::new("sha256sum")
            .args(["-c", "SHA256SUMS"])
            .current_dir(&out),
        "sha256sum -c SHA256SUMS",
    )?;
    for asset in [
        "infrastructure-components.yaml",
        "fulfilment-page-components.yaml",
        "metadata.yaml",
        "cluster-template.yaml",
        "cluster-template-clusterclass.yaml",
        "clusterclass-mailgun.yaml",
        &format!("{CHART}-{version}.tgz"),
        &format!("{CHART}-{version}.cdx.json"),
        "release.txt",
    ] {
        ensure!(
            sums.contains(&format!("{asset}: OK")),
            "SHA256SUMS does not cover {asset}:\n{sums}"
        );
    }

    // The signatures verify with the release's public key, and not with another key.
    let public = out.join("cosign.pub");
    let (_, other) = key_pair(&registry, &dir.join("other-keys"))?;
    let chart_ref = format!(
        "{}/capm/charts/{CHART}@{}",
        registry.host, released.chart_digest
    );
    for key in [&public, &other] {
        let expect = key == &public;
        let key = key.to_string_lossy();
        let checks: [(&str, Vec<&str>); 4] = [
            (
                "image",
                vec![
                    "verify",
                    "--key",
                    &key,
                    "--insecure-ignore-tlog=true",
                    &released.image,
                ],
            ),
            (
                "chart",
                vec![
                    "verify",
                    "--key",
                    &key,
                    "--insecure-ignore-tlog=true",
                    &chart_ref,
                ],
            ),
            (
                "SBOM attestation",
                vec![
                    "verify-attestation",
                    "--type",
                    "cyclonedx",
                    "--key",
                    &key,
                    "--insecure-ignore-tlog=true",
                    &released.image,
                ],
            ),
            (
                "SHA256SUMS",
                vec![
                    "verify-blob",
                    "--key",
                    &key,
                    "--insecure-ignore-tlog=true",
                    "--signature",
                    "SHA256SUMS.sig",
                    "SHA256SUMS",
                ],
            ),
        ];
        for (what, args) in checks {
            let mut cmd = registry.client("cosign", &home)?;
            cmd.current_dir(&out).args(&args);
            let (ok, output) = outcome(&mut cmd)?;
            ensure!(
                ok == expect,
                "the {what} signature {} with {key}:\n{output}",
                if expect {
                    "does not verify"
                } else {
                    "verifies"
                }
            );
        }
    }
    // The attestation carries the SBOM written to out/.
    let mut cmd = registry.client("cosign", &home)?;
    cmd.args([
        "verify-attestation",
        "--type",
        "cyclonedx",
        "--key",
        &public.to_string_lossy(),
        "--insecure-ignore-tlog=true",
        &released.image,
    ]);
    let attested = run(&mut cmd, "cosign verify-attestation")?;
    let envelope: serde_json::Value = serde_json::from_str(
        attested
            .lines()
            .find(|l| l.starts_with('{'))
            .context("no attestation printed")?,
    )?;
    let statement = base64::engine::general_purpose::STANDARD
        .decode(envelope["payload"].as_str().context("no payload")?)?;
    let statement: serde_json::Value = serde_json::from_slice(&statement)?;
    ensure!(
        statement["predicate"]["components"] == sbom["components"],
        "the attested SBOM is not out/'s"
    );
    registry.check_alive()?;
    Ok(())
}
