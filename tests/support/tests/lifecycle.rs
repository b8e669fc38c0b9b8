//! Start-up failures are explained, and nothing outlives the environment.
#![allow(clippy::unwrap_used)] // test helpers: a failed unwrap is a failed test

use std::{
    io::{BufRead, BufReader},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use capm_test_support::{ControlPlane, Error, Options, process};

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

fn pids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("pids"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Waits up to 20 s for every pid to end and `dir` to disappear.
fn assert_cleaned_up(dir: &Path, pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while (dir.exists() || pids.iter().any(|p| alive(*p))) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!dir.exists(), "{} was left behind", dir.display());
    let survivors: Vec<_> = pids.iter().filter(|p| alive(**p)).collect();
    assert!(
        survivors.is_empty(),
        "processes left running: {survivors:?}"
    );
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix(name)
        .tempdir()
        .unwrap()
        .keep();
    std::fs::remove_dir(&dir).unwrap();
    dir
}

#[tokio::test]
async fn missing_binary_says_how_to_build_it() {
    let empty = tempfile::tempdir().unwrap();
    let err = ControlPlane::start(Options {
        bin_dir: Some(empty.path().to_owned()),
        ..Options::default()
    })
    .await
    .expect_err("no binaries");
    assert!(
        matches!(err, Error::BinaryMissing { ref name, .. } if name == "etcd"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("make tools") && msg.contains(&empty.path().display().to_string()),
        "{msg}"
    );
}

#[tokio::test]
async fn taken_port_is_named() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let err = ControlPlane::start(Options {
        api_port: Some(port),
        ..Options::default()
    })
    .await
    .expect_err("port taken");
    assert!(
        matches!(err, Error::PortInUse { port: p, .. } if p == port),
        "{err:?}"
    );
    assert!(err.to_string().contains(&format!("port {port}")), "{err}");
}

#[tokio::test]
async fn component_dying_at_start_reports_its_log_and_cleans_up() {
    // A bin dir whose etcd fails at once; the real API server and controller manager beside it.
    let bins = tempfile::tempdir().unwrap();
    let fake_etcd = bins.path().join("etcd");
    std::fs::write(
        &fake_etcd,
        "#!/bin/sh\necho 'etcd: cannot open data dir: disk on fire' >&2\nexit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &fake_etcd,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    for real in ["kube-apiserver", "kube-controller-manager"] {
        std::os::unix::fs::symlink(process::binary(real).unwrap(), bins.path().join(real)).unwrap();
    }
    let dir = scratch_dir("capm-dying-");
    let err = ControlPlane::start(Options {
        bin_dir: Some(bins.path().to_owned()),
        dir: Some(dir.clone()),
        ..Options::default()
    })
    .await
    .expect_err("etcd dies");
    match &err {
        Error::ComponentExited { name, log_tail, .. } => {
            assert_eq!(name, "etcd");
            assert!(log_tail.contains("disk on fire"), "{log_tail}");
        }
        other => panic!("expected ComponentExited, got {other:?}"),
    }
    assert!(err.to_string().contains("exit status: 3"), "{err}");
    assert_cleaned_up(&dir, &[]);
}

#[test]
fn killed_owner_leaves_nothing_behind() {
    // `capm-env run` owns an attached control plane; SIGKILL gives it no chance to clean up.
    let mut child = Command::new(env!("CARGO_BIN_EXE_capm-env"))
        .arg("run")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let kubeconfig = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("export KUBECONFIG=").map(PathBuf::from))
        .expect("capm-env run prints the kubeconfig");
    let dir = kubeconfig.parent().unwrap().to_owned();
    let started = pids(&dir);
    assert!(
        started.len() >= 3,
        "etcd, kube-apiserver and kube-controller-manager: {started:?}"
    );
    assert!(started.iter().all(|p| alive(*p)));

    child.kill().unwrap();
    child.wait().unwrap();
    assert_cleaned_up(&dir, &started);
}

#[tokio::test]
async fn stop_removes_everything() {
    let cp = ControlPlane::start(Options::default()).await.unwrap();
    let dir = cp.dir().unwrap().to_owned();
    let started = pids(&dir);
    assert!(cp.client().await.unwrap().apiserver_version().await.is_ok());
    cp.stop();
    assert_cleaned_up(&dir, &started);
}

#[test]
fn detached_up_env_down() {
    let dir = scratch_dir("capm-detached-");
    let bin = env!("CARGO_BIN_EXE_capm-env");
    let up = Command::new(bin)
        .args(["up", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let started = pids(&dir);
    let env = Command::new(bin)
        .args(["env", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let env = String::from_utf8_lossy(&env.stdout);
    assert!(
        env.contains(&format!(
            "export KUBECONFIG={}",
            dir.join("kubeconfig").display()
        )),
        "{env}"
    );

    let again = Command::new(bin)
        .args(["up", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already runs"));

    let down = Command::new(bin)
        .args(["down", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert_cleaned_up(&dir, &started);
    let down = Command::new(bin)
        .args(["down", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!down.status.success());
    assert!(String::from_utf8_lossy(&down.stderr).contains("no control plane runs"));
}

#[tokio::test]
async fn apiserver_restart_keeps_the_data_and_the_reaper_stops_the_new_process() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, PostParams};

    let cp = ControlPlane::start(Options::default()).await.unwrap();
    let dir = cp.dir().unwrap().to_owned();
    let client = cp.client().await.unwrap();
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut map = ConfigMap::default();
    map.metadata.name = Some("kept".into());
    maps.create(&PostParams::default(), &map).await.unwrap();
    let before = pids(&dir);

    cp.restart_apiserver(Duration::from_secs(90)).await.unwrap();
    let after = pids(&dir);
    assert_eq!(
        after.len(),
        before.len() + 1,
        "the new kube-apiserver is recorded"
    );
    let replaced: Vec<_> = before.iter().filter(|p| !alive(**p)).collect();
    assert_eq!(
        replaced.len(),
        1,
        "exactly the old kube-apiserver is gone: {before:?}"
    );
    // The same client (same address, same certificates) reads what etcd kept.
    assert!(maps.get_opt("kept").await.unwrap().is_some());

    cp.stop();
    assert_cleaned_up(&dir, &after);
}
