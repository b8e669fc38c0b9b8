//! `capm-env`: the local control plane from a shell.
//!
//! ```text
//! capm-env up     start a detached control plane (state in .capm-env/ or --dir)
//! capm-env env    print `export KUBECONFIG=...` for it
//! capm-env down   stop it and remove its state
//! capm-env run    start one attached to this terminal; Ctrl-C stops and removes it
//! ```

use std::{path::PathBuf, process::ExitCode, time::Duration};

use capm_test_support::{ControlPlane, Options};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "A real local Kubernetes control plane for cluster-api-provider-mailgun"
)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
    /// State directory of the detached control plane.
    #[arg(long, global = true, env = "CAPM_ENV_DIR", default_value_os_t = default_dir())]
    dir: PathBuf,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a detached control plane and print how to use it.
    Up(StartArgs),
    /// Print shell exports for the detached control plane.
    Env,
    /// Stop the detached control plane and remove its state directory.
    Down,
    /// Start a control plane attached to this process; stop it with Ctrl-C.
    Run(StartArgs),
}

#[derive(clap::Args)]
struct StartArgs {
    /// API server port (default: a free port).
    #[arg(long)]
    api_port: Option<u16>,
    /// Also install the Cluster API CRDs.
    #[arg(long)]
    capi_crds: bool,
    /// Start-up timeout in seconds.
    #[arg(long, default_value_t = 90)]
    timeout: u64,
    /// Also start a node (bridge network, containerd, kube-scheduler, kubelet) so Pods run;
    /// needs root. The API server then listens on the bridge's address.
    #[arg(long)]
    node: bool,
    /// With --node: build the provider's image from this binary and load it into the node's
    /// containerd as --image.
    #[arg(long, requires = "node")]
    load_image: Option<PathBuf>,
    /// The reference the loaded image gets.
    #[arg(long, default_value = "capm.local/cluster-api-provider-mailgun:dev")]
    image: String,
}

fn default_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.capm-env")
}

fn exports(kubeconfig: &std::path::Path) -> String {
    format!(
        "export KUBECONFIG={k}\nexport CAPM_KUBECONFIG={k}",
        k = kubeconfig.display()
    )
}

async fn start(
    args: &StartArgs,
    dir: Option<PathBuf>,
    detached: bool,
) -> Result<ControlPlane, String> {
    let cp = ControlPlane::start(Options {
        dir,
        detached,
        api_port: args.api_port,
        timeout: Duration::from_secs(args.timeout),
        node: args.node,
        ..Options::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    if args.capi_crds {
        cp.install_capi_crds().await.map_err(|e| e.to_string())?;
    }
    if let Some(binary) = &args.load_image {
        let digest = cp
            .load_provider_image(binary, &args.image)
            .map_err(|e| e.to_string())?;
        eprintln!("image {}@{digest} loaded into the node", args.image);
    }
    eprintln!(
        "control plane ready at {} in {:.1} s",
        cp.server(),
        cp.started_in().as_secs_f64()
    );
    Ok(cp)
}

async fn run(args: Args) -> Result<(), String> {
    match args.command {
        Cmd::Up(start_args) => {
            let cp = start(&start_args, Some(args.dir), true).await?;
            println!("{}", exports(cp.kubeconfig()));
            // Detached: the processes keep running after this one exits.
            std::mem::forget(cp);
            Ok(())
        }
        Cmd::Env => {
            let kubeconfig = args.dir.join("kubeconfig");
            if !kubeconfig.exists() {
                return Err(capm_test_support::Error::NotRunning { dir: args.dir }.to_string());
            }
            let kubeconfig = kubeconfig.canonicalize().map_err(|e| e.to_string())?;
            println!("{}", exports(&kubeconfig));
            Ok(())
        }
        Cmd::Down => {
            ControlPlane::stop_detached(&args.dir).map_err(|e| e.to_string())?;
            eprintln!("stopped; removed {}", args.dir.display());
            Ok(())
        }
        Cmd::Run(start_args) => {
            let cp = start(&start_args, None, false).await?;
            println!("{}", exports(cp.kubeconfig()));
            eprintln!("press Ctrl-C to stop");
            tokio::signal::ctrl_c().await.map_err(|e| e.to_string())?;
            cp.stop();
            eprintln!("stopped");
            Ok(())
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("capm-env: {e}");
            ExitCode::FAILURE
        }
    }
}
