//! Writes the provider's or the pause container image as an OCI image layout archive, without a
//! container engine (see `capm_test_support::image`).
//!
//! ```text
//! capm-image provider --binary target/release/cluster-api-provider-mailgun --name <ref> -o provider.oci.tar
//! capm-image pause --binary bin/pause -o pause.oci.tar
//! ```
//! Prints the manifest digest. `ctr images import` loads the archive.

use std::path::PathBuf;

use capm_test_support::image::Image;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Build a container image as an OCI layout archive, without a container engine")]
struct Args {
    #[command(subcommand)]
    image: Which,
}

#[derive(Subcommand)]
enum Which {
    /// The provider: the release binary as /manager, glibc, CA certificates, user 65532.
    Provider {
        /// The provider binary (a release build).
        #[arg(long)]
        binary: PathBuf,
        /// The image reference (repository:tag) it is imported under.
        #[arg(long)]
        name: String,
        /// The archive to write.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// The Pod sandbox image (registry.k8s.io/pause) from the static pause binary.
    Pause {
        /// The pause binary (`make tools` builds bin/pause).
        #[arg(long)]
        binary: PathBuf,
        /// The archive to write.
        #[arg(short, long)]
        output: PathBuf,
    },
}

fn main() -> Result<(), capm_test_support::Error> {
    let (image, output) = match Args::parse().image {
        Which::Provider {
            binary,
            name,
            output,
        } => (Image::provider(&name, &binary)?, output),
        Which::Pause { binary, output } => (Image::pause(&binary)?, output),
    };
    let written = image.write_oci_archive(&output)?;
    println!(
        "{} {} ({} bytes) -> {}",
        image.name,
        written.manifest_digest,
        written.size,
        output.display()
    );
    Ok(())
}
