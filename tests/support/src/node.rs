//! A node for the local control plane: a bridge network, containerd (with runc and the CNI
//! bridge plugin), kube-scheduler and a kubelet, so Deployments run as real Pods.
//!
//! # Network
//! The test owns one Linux bridge (`capm<hex>`) with a free `10.<a>.<b>.0/24`; its first address
//! is the gateway, the node's InternalIP and the address kube-apiserver listens and advertises on,
//! so the `kubernetes` Service's endpoint is reachable from Pods. Pods get the bridge's other
//! addresses from the CNI bridge plugin; the host (and kube-apiserver, which calls webhooks on
//! endpoint addresses) reaches them over the bridge. One iptables DNAT rule, limited to packets
//! entering from the bridge, sends the Service address `10.0.0.1:443` to the API server: that is
//! the whole of "kube-proxy" here (no other Service has a ClusterIP route; clients in Pods use
//! the API server, the tests reach Pods by their IPs or endpoints). Nothing leaves the machine.
//!
//! # Cleanup
//! Everything this module creates is listed in `<state dir>/teardown.sh`, written before it is
//! created and run by the control plane's cleanup (reaper or `capm-env down`) after the
//! processes are stopped: runc containers and shims, mounts under the state directory (Pod
//! network namespaces, volumes), the bridge, the iptables rule, CNI's cached results, and the
//! `ip_forward` setting the bridge plugin turns on.
//!
//! Needs root, cgroup v1 or v2, and `iptables`, `ip` (`make deps`).

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::{Api, Client};

use crate::{
    Error,
    image::{self, Image},
    process::{self, Component},
};

/// The Node's name.
pub const NODE_NAME: &str = "capm-node";
/// The `kubernetes` Service's ClusterIP (first address of `--service-cluster-ip-range`).
pub const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";

fn run(program: &str, args: &[&str]) -> Result<String, Error> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Node(format!("running {program}: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Node(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The node's network: a bridge owned by one control plane.
#[derive(Debug, Clone)]
pub struct Network {
    /// Bridge interface name.
    pub bridge: String,
    /// The bridge's address: gateway of the Pods, node IP, API server address.
    pub gateway: Ipv4Addr,
    /// The Pod subnet, `a.b.c.0/24`.
    pub subnet: String,
    /// CNI network name (host-local's and libcni's state are keyed by it).
    pub cni_name: String,
}

impl Network {
    /// Creates the bridge with a /24 that no interface of this host uses, and writes
    /// `dir/teardown.sh` first, so a failure half-way is cleaned up too.
    ///
    /// # Errors
    /// When not root, or `ip` / `iptables` fail.
    pub fn create(dir: &Path) -> Result<Self, Error> {
        let tag: u16 = rand::random();
        let used = run("ip", &["-4", "-o", "addr"])?;
        let (a, b) = (0..64)
            .map(|i| (200 + (tag as u8 % 50), ((tag >> 8) as u8).wrapping_add(i)))
            .find(|(a, b)| !used.contains(&format!(" 10.{a}.{b}.")))
            .ok_or_else(|| Error::Node("no free 10.x.y.0/24 for the Pod bridge".into()))?;
        let net = Self {
            bridge: format!("capm{tag:04x}"),
            gateway: Ipv4Addr::new(10, a, b, 1),
            subnet: format!("10.{a}.{b}.0/24"),
            cni_name: format!("capm-{tag:04x}"),
        };
        let ip_forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .map_err(|e| Error::Node(format!("reading ip_forward: {e}")))?;
        std::fs::write(
            dir.join("teardown.sh"),
            net.teardown_script(dir, ip_forward.trim()),
        )
        .map_err(Error::io("writing teardown.sh"))?;
        run("ip", &["link", "add", &net.bridge, "type", "bridge"])?;
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/24", net.gateway),
                "dev",
                &net.bridge,
            ],
        )?;
        run("ip", &["link", "set", &net.bridge, "up"])?;
        Ok(net)
    }

    fn dnat_rule(&self, api_port: u16) -> Vec<String> {
        [
            "PREROUTING",
            "-i",
            &self.bridge,
            "-p",
            "tcp",
            "-d",
            KUBERNETES_SERVICE_IP,
            "--dport",
            "443",
            "-j",
            "DNAT",
            "--to-destination",
            &format!("{}:{api_port}", self.gateway),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Routes the `kubernetes` Service (10.0.0.1:443) from Pods to the API server's port.
    ///
    /// # Errors
    /// When iptables fails.
    pub fn route_kubernetes_service(&self, api_port: u16) -> Result<(), Error> {
        let rule = self.dnat_rule(api_port);
        let mut args = vec!["-w", "-t", "nat", "-A"];
        args.extend(rule.iter().map(String::as_str));
        run("iptables", &args).map(drop)
    }

    fn teardown_script(&self, dir: &Path, ip_forward: &str) -> String {
        let d = dir.display();
        let mut s = String::from(
            "#!/usr/bin/env bash\n# Written by capm-test-support's node; run after the processes are stopped.\n",
        );
        let _ = writeln!(s, "dir='{d}'");
        // Containers outlive containerd (each has its shim): kill them through runc, which also
        // removes their cgroups, then the shims.
        let _ = writeln!(
            s,
            "runc=$(readlink -f \"$dir/bin/runc\" 2>/dev/null)\n\
             if [ -x \"$runc\" ] && [ -d \"$dir/runc\" ]; then\n\
             \x20 for ns in \"$dir\"/runc/*/; do\n\
             \x20   for id in $(\"$runc\" --root \"$ns\" list -q 2>/dev/null); do \"$runc\" --root \"$ns\" delete --force \"$id\" >/dev/null 2>&1; done\n\
             \x20 done\nfi\n\
             # The shims (parented to init once containerd stopped) name this state directory's socket.\n\
             for p in /proc/[0-9]*; do\n\
             \x20 c=$(tr '\\0' ' ' < \"$p/cmdline\" 2>/dev/null) || continue\n\
             \x20 case \"$c\" in *containerd-shim*\" -address $dir/containerd.sock\"*) kill -KILL \"${{p#/proc/}}\" 2>/dev/null;; esac\n\
             done\n\
             # Shim sockets live in /run/containerd/s whatever the state directory; a killed shim leaves its own.\n\
             for f in \"$dir\"/containerd/state/io.containerd.runtime.v2.task/*/*/bootstrap.json; do\n\
             \x20 [ -f \"$f\" ] || continue\n\
             \x20 a=$(sed -n 's|.*\"address\":\"unix://\\(/run/containerd/s/[0-9a-f]*\\)\".*|\\1|p' \"$f\")\n\
             \x20 [ -n \"$a\" ] && rm -f \"$a\"\ndone\n\
             rmdir /run/containerd/s /run/containerd 2>/dev/null\n\
             # The parent cgroup containerd puts Pods under (runc removed the Pods' own).\n\
             rmdir /sys/fs/cgroup/*/k8s.io /sys/fs/cgroup/k8s.io 2>/dev/null\n\
             sleep 0.2\n\
             # Mounts under the state directory (Pod network namespaces, volumes, shm), deepest first.\n\
             awk -v d=\"$dir/\" 'index($5, d) == 1 {{print $5}}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l \"$m\" 2>/dev/null; done"
        );
        let _ = writeln!(s, "ip link del '{}' 2>/dev/null", self.bridge);
        let _ = writeln!(
            s,
            "while iptables -w -t nat -S PREROUTING | grep -q -- '-i {b} '; do\n\
             \x20 rule=$(iptables -w -t nat -S PREROUTING | grep -m1 -- '-i {b} ' | sed 's/^-A /-D /')\n\
             \x20 eval \"iptables -w -t nat $rule\" || break\ndone",
            b = self.bridge
        );
        let _ = writeln!(
            s,
            "rm -rf /var/lib/cni/results/{n}-* /var/lib/cni/networks/{n}\n\
             # containerd also runs its own loopback network (`cni-loopback`) per sandbox; ours\n\
             # name a network namespace under the state directory.\n\
             grep -l -F \"\\\"netns\\\":\\\"$dir/\" /var/lib/cni/results/cni-loopback-* 2>/dev/null | while read -r f; do rm -f \"$f\"; done\n\
             rmdir /var/lib/cni/results /var/lib/cni/networks /var/lib/cni 2>/dev/null",
            n = self.cni_name
        );
        let _ = writeln!(s, "echo {ip_forward} > /proc/sys/net/ipv4/ip_forward");
        s.push_str("exit 0\n");
        s
    }
}

/// Where the node's binaries are and how to reach the API server.
#[derive(Debug)]
pub(crate) struct NodeStart<'a> {
    pub dir: &'a Path,
    pub bin_dir: &'a Path,
    pub net: &'a Network,
    pub kubelet_kubeconfig: &'a Path,
    pub scheduler_kubeconfig: &'a Path,
    pub deadline: Instant,
}

fn write(path: &Path, contents: &str) -> Result<(), Error> {
    std::fs::write(path, contents).map_err(Error::io("writing node files"))
}

fn containerd_config(dir: &Path, bin_dir: &Path, runc: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 3
root = "{d}/containerd/root"
state = "{d}/containerd/state"
# Plugins that would write outside the state directory or need kernel features not assumed here.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.sock.ttrpc"

# `ctr images import` unpacks through the transfer service, for the platforms listed here only.
[plugins."io.containerd.transfer.v1.local"]
  [[plugins."io.containerd.transfer.v1.local".unpack_config]]
    platform = "linux/amd64"
    snapshotter = "native"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  # Registries the containerd way: <config_path>/<host:port>/hosts.toml (see trust_registry).
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{d}/certs.d"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  # This sandbox refuses a negative oom_score_adj; runc would fail to start containers.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = false
  enable_unprivileged_icmp = false
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin}"]
    conf_dir = "{d}/cni"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d}/runc"
        SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        pause = image::PAUSE_IMAGE,
        bin = bin_dir.display(),
        runc = runc.display(),
    )
}

fn cni_config(net: &Network, dir: &Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": net.cni_name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": dir.join("cni-ipam"),
                    "ranges": [[{ "subnet": net.subnet, "gateway": net.gateway.to_string() }]],
                    "routes": [{ "dst": "0.0.0.0/0" }],
                },
            },
            { "type": "loopback" },
        ],
    })
    .to_string()
}

fn kubelet_config(dir: &Path, net: &Network, port: u16) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
localStorageCapacityIsolation: false
# No eviction and no image garbage collection: this host's disk is shared and often fuller than
# the defaults allow, and nothing could pull an evicted image again.
evictionHard: {{}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: ""
containerRuntimeEndpoint: unix://{d}/containerd.sock
address: {addr}
port: {port}
readOnlyPort: 0
# No KUBE-FIREWALL / canary chains in the host's iptables.
makeIPTablesUtilChains: false
healthzPort: 0
podLogsDir: {d}/pod-logs
serializeImagePulls: false
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
"#,
        addr = net.gateway,
    )
}

/// Starts containerd (and loads the pause image), kube-scheduler and the kubelet; returns once
/// the Node is Ready. Components are pushed to `components` as they start, so a failure stops
/// them.
pub(crate) async fn start(
    opts: &NodeStart<'_>,
    client: &Client,
    components: &mut Vec<Component>,
) -> Result<(), Error> {
    let bin = |name: &str| process::binary_in(opts.bin_dir, name);
    let (containerd, ctr, runc) = (bin("containerd")?, bin("ctr")?, bin("runc")?);
    let (kubelet, scheduler, pause) = (bin("kubelet")?, bin("kube-scheduler")?, bin("pause")?);
    for name in [
        "containerd-shim-runc-v2",
        "bridge",
        "host-local",
        "loopback",
    ] {
        bin(name)?;
    }
    let dir = opts.dir;
    // The teardown script finds runc here.
    std::os::unix::fs::symlink(opts.bin_dir, dir.join("bin"))
        .map_err(Error::io("linking the node's bin dir"))?;
    std::fs::create_dir_all(dir.join("cni")).map_err(Error::io("creating the CNI dir"))?;
    write(
        &dir.join("cni").join("10-capm.conflist"),
        &cni_config(opts.net, dir),
    )?;
    let config = dir.join("containerd.toml");
    write(&config, &containerd_config(dir, opts.bin_dir, &runc))?;

    let path = format!(
        "{}:{}",
        opts.bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new(&containerd);
    cmd.arg("--config").arg(&config).env("PATH", &path);
    components.push(Component::spawn(dir, "containerd", cmd)?);
    let socket = dir.join("containerd.sock");
    while !socket.exists() {
        still_starting(opts.deadline, components, "containerd's socket").await?;
    }

    let archive = dir.join("pause.oci.tar");
    Image::pause(&pause)?.write_oci_archive(&archive)?;
    image::import(&ctr, &socket, &archive, image::PAUSE_IMAGE)?;

    let mut cmd = Command::new(&scheduler);
    cmd.arg("--kubeconfig")
        .arg(opts.scheduler_kubeconfig)
        .args(["--leader-elect=false", "--secure-port=0", "--v=1"]);
    components.push(Component::spawn(dir, "kube-scheduler", cmd)?);

    let kubelet_dir = dir.join("kubelet");
    std::fs::create_dir_all(&kubelet_dir).map_err(Error::io("creating the kubelet dir"))?;
    let kubelet_conf = dir.join("kubelet.yaml");
    write(
        &kubelet_conf,
        &kubelet_config(dir, opts.net, process::free_port()?),
    )?;
    let mut cmd = Command::new(&kubelet);
    cmd.arg("--config")
        .arg(&kubelet_conf)
        .arg("--kubeconfig")
        .arg(opts.kubelet_kubeconfig)
        .arg("--root-dir")
        .arg(&kubelet_dir)
        .arg("--cert-dir")
        .arg(kubelet_dir.join("pki"))
        .args(["--hostname-override", NODE_NAME])
        .args(["--node-ip", &opts.net.gateway.to_string()])
        .arg("--v=1")
        .env("PATH", &path);
    components.push(Component::spawn(dir, "kubelet", cmd)?);

    let nodes: Api<NodeObject> = Api::all(client.clone());
    loop {
        let node = nodes.get_opt(NODE_NAME).await.ok().flatten();
        let ready = node
            .and_then(|n| n.status)
            .and_then(|s| s.conditions)
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if ready {
            return Ok(());
        }
        still_starting(opts.deadline, components, "the Node to be Ready").await?;
    }
}

/// One poll of a start-up wait: fails when a component has exited or the deadline has passed,
/// otherwise sleeps 100 ms.
async fn still_starting(
    deadline: Instant,
    components: &mut [Component],
    what: &str,
) -> Result<(), Error> {
    for c in components.iter_mut() {
        if let Some(status) = c.exited() {
            return Err(c.died(Some(status)));
        }
    }
    if Instant::now() > deadline {
        let tails: String = components
            .iter()
            .map(|c| format!("--- {}:\n{}\n", c.name, process::tail(&c.log, 15)))
            .collect();
        return Err(Error::Node(format!(
            "timed out waiting for {what}\n{tails}"
        )));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

/// Builds the provider's image from `binary` and loads it into the node's containerd as `name`.
///
/// # Errors
/// When the image cannot be built or `ctr` fails.
pub fn load_provider_image(
    dir: &Path,
    bin_dir: &Path,
    binary: &Path,
    name: &str,
) -> Result<String, Error> {
    let archive = dir.join("provider.oci.tar");
    let written = Image::provider(name, binary)?.write_oci_archive(&archive)?;
    let ctr = process::binary_in(bin_dir, "ctr")?;
    image::import(&ctr, &dir.join("containerd.sock"), &archive, name)?;
    let _ = std::fs::remove_file(&archive);
    Ok(written.manifest_digest)
}

/// Lets the node's containerd pull from the registry at `host` (`<ip>:<port>`) over HTTPS,
/// trusting `ca_pem`: writes `<state>/certs.d/<host>/hosts.toml` and the CA beside it, which
/// containerd reads at each pull (no restart).
///
/// # Errors
/// When the files cannot be written.
pub fn trust_registry(dir: &Path, host: &str, ca_pem: &str) -> Result<(), Error> {
    let hosts = dir.join("certs.d").join(host);
    std::fs::create_dir_all(&hosts)
        .map_err(Error::io("creating the registry's hosts directory"))?;
    let ca = hosts.join("ca.crt");
    write(&ca, ca_pem)?;
    write(
        &hosts.join("hosts.toml"),
        &format!(
            "server = \"https://{host}\"\n\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"{}\"\n",
            ca.display()
        ),
    )
}

/// `PathBuf` of the state directory's containerd socket.
pub fn containerd_socket(dir: &Path) -> PathBuf {
    dir.join("containerd.sock")
}
