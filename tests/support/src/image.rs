//! Container images built without a container engine: a root file system as one uncompressed
//! tar layer, an OCI image config and manifest, packed as an OCI image layout archive that
//! `ctr images import` loads into containerd.
//!
//! The output is reproducible: entries are sorted by path, every timestamp is zero, owners are
//! numeric and the JSON documents have sorted keys, so the same inputs give the same digests.
//!
//! Two images are defined here: the provider's ([`Image::provider`], what the `Dockerfile`
//! describes, with the glibc files the release binary loads instead of a distroless base) and the
//! Pod sandbox's pause image ([`Image::pause`], the statically linked `pause` that
//! `hack/tools/build.sh` compiles from the kubernetes module's `pause.c`).
//!
//! Not for general use: no compression, one layer, one platform (linux/amd64).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use ring::digest::{SHA256, digest};
use serde_json::json;

use crate::Error;

/// The provider image's user: distroless's `nonroot`, which the chart's securityContext expects.
pub const NONROOT: u32 = 65532;
/// The pause image's user, as upstream's pause image sets it.
pub const PAUSE_USER: u32 = 65535;
/// The pause image's reference: the sandbox image containerd is configured with.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.2";
/// Where the provider's binary lives in its image (the Dockerfile's `COPY ... /manager`).
pub const PROVIDER_ENTRYPOINT: &str = "/manager";
/// The system CA bundle's path, in the image and on the Debian host it is taken from.
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// What a tar entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file with these contents.
    File(Vec<u8>),
}

/// One entry of the root file system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Absolute path in the image.
    pub path: String,
    /// Permission bits (e.g. `0o755`).
    pub mode: u32,
    /// Numeric owner.
    pub uid: u32,
    /// Numeric group.
    pub gid: u32,
    /// Directory or file.
    pub kind: Kind,
}

impl Entry {
    fn file(path: &str, mode: u32, contents: Vec<u8>) -> Self {
        Self {
            path: path.to_owned(),
            mode,
            uid: 0,
            gid: 0,
            kind: Kind::File(contents),
        }
    }

    fn dir(path: &str, mode: u32, owner: u32) -> Self {
        Self {
            path: path.to_owned(),
            mode,
            uid: owner,
            gid: owner,
            kind: Kind::Dir,
        }
    }
}

/// An image: its reference, its process settings and its files.
#[derive(Debug, Clone)]
pub struct Image {
    /// Reference it is imported under (`repository:tag`).
    pub name: String,
    /// The process to run.
    pub entrypoint: Vec<String>,
    /// `uid:gid`.
    pub user: String,
    /// Environment variables, `NAME=value`.
    pub env: Vec<String>,
    /// The root file system (parent directories are added when missing).
    pub entries: Vec<Entry>,
}

/// The result of [`Image::write_oci_archive`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `sha256:<hex>` of the image manifest (what containerd reports as the image's digest).
    pub manifest_digest: String,
    /// Size of the archive in bytes.
    pub size: usize,
}

fn sha256(bytes: &[u8]) -> String {
    let d = digest(&SHA256, bytes);
    let mut s = String::from("sha256:");
    for b in d.as_ref() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path)
        .map_err(|source| Error::Image(format!("reading {}: {source}", path.display())))
}

/// The shared objects the dynamic binary `binary` loads, as `ldd` lists them (the interpreter
/// included), by the path the loader looks them up under.
///
/// # Errors
/// When `ldd` fails or names a library it cannot find.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, Error> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|source| Error::Image(format!("running ldd: {source}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(Error::Image(format!(
            "ldd {} failed: {}{}",
            binary.display(),
            text,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.contains("not found") {
            return Err(Error::Image(format!("ldd {}: {line}", binary.display())));
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file.
        let path = match line.split_once("=> ") {
            Some((_, rest)) => rest.split(' ').next().unwrap_or(""),
            None => line.split(' ').next().unwrap_or(""),
        };
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    libs.sort();
    libs.dedup();
    Ok(libs)
}

impl Image {
    /// The provider's image: `binary` as `/manager`, the glibc shared objects it loads (taken
    /// from this Debian host), the system CA bundle (Mailgun's TLS is verified against it), an
    /// `/etc/passwd` with `nonroot` (65532), a sticky `/tmp`; no shell, runs as 65532.
    ///
    /// # Errors
    /// When the binary, a library or the CA bundle cannot be read.
    pub fn provider(name: &str, binary: &Path) -> Result<Self, Error> {
        let mut entries = vec![
            Entry::file(PROVIDER_ENTRYPOINT, 0o755, read(binary)?),
            Entry::file(CA_BUNDLE, 0o644, read(Path::new(CA_BUNDLE))?),
            Entry::file(
                "/etc/passwd",
                0o644,
                format!(
                    "root:x:0:0:root:/root:/sbin/nologin\n\
                     nonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n"
                )
                .into_bytes(),
            ),
            Entry::file(
                "/etc/group",
                0o644,
                format!("root:x:0:\nnonroot:x:{NONROOT}:\n").into_bytes(),
            ),
            Entry::dir("/tmp", 0o1777, 0),
            Entry::dir("/home/nonroot", 0o700, NONROOT),
        ];
        for lib in shared_libraries(binary)? {
            let path = lib.to_string_lossy().into_owned();
            entries.push(Entry::file(&path, 0o755, read(&lib)?));
        }
        Ok(Self {
            name: name.to_owned(),
            entrypoint: vec![PROVIDER_ENTRYPOINT.to_owned()],
            user: format!("{NONROOT}:{NONROOT}"),
            env: vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
                format!("SSL_CERT_FILE={CA_BUNDLE}"),
            ],
            entries,
        })
    }

    /// The Pod sandbox image: the static `pause` binary alone, as upstream's.
    ///
    /// # Errors
    /// When the binary cannot be read.
    pub fn pause(binary: &Path) -> Result<Self, Error> {
        Ok(Self {
            name: PAUSE_IMAGE.to_owned(),
            entrypoint: vec!["/pause".to_owned()],
            user: format!("{PAUSE_USER}:{PAUSE_USER}"),
            env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
            entries: vec![Entry::file("/pause", 0o755, read(binary)?)],
        })
    }

    /// The root file system, parents added, sorted by path (a directory before its contents).
    fn tree(&self) -> Result<Vec<Entry>, Error> {
        let mut by_path: BTreeMap<String, Entry> = BTreeMap::new();
        for e in &self.entries {
            let rel = e.path.trim_start_matches('/');
            if rel.is_empty()
                || rel
                    .split('/')
                    .any(|c| c.is_empty() || c == "." || c == "..")
            {
                return Err(Error::Image(format!("bad path in image: {:?}", e.path)));
            }
            let mut parent = String::new();
            let comps: Vec<&str> = rel.split('/').collect();
            for c in &comps[..comps.len() - 1] {
                parent.push_str(c);
                parent.push('/');
                by_path
                    .entry(parent.clone())
                    .or_insert_with(|| Entry::dir(&parent, 0o755, 0));
            }
            let key = match e.kind {
                Kind::Dir => format!("{rel}/"),
                Kind::File(_) => rel.to_owned(),
            };
            by_path.insert(
                key.clone(),
                Entry {
                    path: key,
                    ..e.clone()
                },
            );
        }
        Ok(by_path.into_values().collect())
    }

    /// The layer: an uncompressed tar of the tree.
    ///
    /// # Errors
    /// A bad path, or one too long for a plain tar header.
    pub fn layer(&self) -> Result<Vec<u8>, Error> {
        let mut tar = Vec::new();
        for e in self.tree()? {
            match &e.kind {
                Kind::Dir => tar_entry(&mut tar, &e.path, e.mode, e.uid, e.gid, b'5', &[])?,
                Kind::File(c) => tar_entry(&mut tar, &e.path, e.mode, e.uid, e.gid, b'0', c)?,
            }
        }
        tar.extend_from_slice(&[0; 1024]);
        Ok(tar)
    }

    /// The OCI image layout archive (`oci-layout`, `index.json`, `blobs/sha256/...`).
    ///
    /// # Errors
    /// As [`Self::layer`].
    pub fn oci_archive(&self) -> Result<(Vec<u8>, String), Error> {
        let layer = self.layer()?;
        let layer_digest = sha256(&layer);
        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": self.user,
                "Entrypoint": self.entrypoint,
                "Env": self.env,
                "WorkingDir": "/",
            },
            "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
        });
        let config = serde_json::to_vec(&config).map_err(|e| Error::Image(e.to_string()))?;
        let config_digest = sha256(&config);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer.len(),
            }],
        });
        let manifest = serde_json::to_vec(&manifest).map_err(|e| Error::Image(e.to_string()))?;
        let manifest_digest = sha256(&manifest);
        let tag = self
            .name
            .rsplit_once(':')
            .map(|(_, t)| t)
            .unwrap_or("latest");
        let index = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest.len(),
                "platform": { "architecture": "amd64", "os": "linux" },
                "annotations": {
                    "io.containerd.image.name": self.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        });
        let index = serde_json::to_vec(&index).map_err(|e| Error::Image(e.to_string()))?;

        let mut blobs: BTreeMap<String, &[u8]> = BTreeMap::new();
        for (d, b) in [
            (&layer_digest, &layer[..]),
            (&config_digest, &config[..]),
            (&manifest_digest, &manifest[..]),
        ] {
            blobs.insert(format!("blobs/sha256/{}", &d["sha256:".len()..]), b);
        }
        let mut out = Vec::new();
        tar_entry(&mut out, "blobs/", 0o755, 0, 0, b'5', &[])?;
        tar_entry(&mut out, "blobs/sha256/", 0o755, 0, 0, b'5', &[])?;
        for (path, bytes) in &blobs {
            tar_entry(&mut out, path, 0o644, 0, 0, b'0', bytes)?;
        }
        tar_entry(&mut out, "index.json", 0o644, 0, 0, b'0', &index)?;
        tar_entry(
            &mut out,
            "oci-layout",
            0o644,
            0,
            0,
            b'0',
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )?;
        out.extend_from_slice(&[0; 1024]);
        Ok((out, manifest_digest))
    }

    /// Writes [`Self::oci_archive`] to `path`.
    ///
    /// # Errors
    /// As [`Self::oci_archive`], or when the file cannot be written.
    pub fn write_oci_archive(&self, path: &Path) -> Result<Written, Error> {
        let (bytes, manifest_digest) = self.oci_archive()?;
        std::fs::write(path, &bytes)
            .map_err(|source| Error::Image(format!("writing {}: {source}", path.display())))?;
        Ok(Written {
            manifest_digest,
            size: bytes.len(),
        })
    }
}

/// Appends one ustar entry (header, contents, padding) to `tar`.
fn tar_entry(
    tar: &mut Vec<u8>,
    path: &str,
    mode: u32,
    uid: u32,
    gid: u32,
    typeflag: u8,
    contents: &[u8],
) -> Result<(), Error> {
    let mut h = [0u8; 512];
    let (prefix, name) = if path.len() <= 100 {
        ("", path)
    } else {
        // ustar splits a long path at a '/' into prefix (<= 155) and name (<= 100).
        let trimmed = path.trim_end_matches('/');
        let at = trimmed
            .char_indices()
            .filter(|&(i, c)| c == '/' && i <= 155 && path.len() - i - 1 <= 100)
            .map(|(i, _)| i)
            .next()
            .ok_or_else(|| Error::Image(format!("path too long for a tar header: {path}")))?;
        (&path[..at], &path[at + 1..])
    };
    h[..name.len()].copy_from_slice(name.as_bytes());
    let octal = |field: &mut [u8], value: u64| {
        let s = format!("{value:0width$o}", width = field.len() - 1);
        field[..s.len()].copy_from_slice(s.as_bytes());
    };
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], u64::from(uid));
    octal(&mut h[116..124], u64::from(gid));
    octal(&mut h[124..136], contents.len() as u64);
    octal(&mut h[136..148], 0);
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    tar.extend_from_slice(&h);
    tar.extend_from_slice(contents);
    let pad = (512 - contents.len() % 512) % 512;
    tar.extend(std::iter::repeat_n(0, pad));
    Ok(())
}

/// Imports an OCI archive into containerd's `k8s.io` namespace (the one the CRI plugin uses),
/// unpacked for the `native` snapshotter, and pins it so the kubelet's image garbage collection
/// leaves it alone (nothing can pull it again).
///
/// # Errors
/// When `ctr` fails.
pub fn import(ctr: &Path, address: &Path, archive: &Path, name: &str) -> Result<(), Error> {
    let run = |args: &[&str]| -> Result<(), Error> {
        let out = Command::new(ctr)
            .arg("--address")
            .arg(address)
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .map_err(|source| Error::Image(format!("running ctr: {source}")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::Image(format!(
                "ctr {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    };
    let archive = archive.to_string_lossy();
    run(&[
        "images",
        "import",
        "--snapshotter",
        "native",
        "--platform",
        "linux/amd64",
        &archive,
    ])?;
    run(&["images", "label", name, "io.cri-containerd.pinned=pinned"])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Image {
        Image {
            name: "example.test/sample:1".into(),
            entrypoint: vec!["/bin/x".into()],
            user: "1:1".into(),
            env: vec![],
            entries: vec![
                Entry::file("/usr/local/bin/x", 0o755, b"hello".to_vec()),
                Entry::file("/etc/a", 0o644, vec![b'a'; 700]),
            ],
        }
    }

    #[test]
    fn the_archive_is_reproducible_and_lists_parents_first() -> Result<(), Error> {
        let (a, da) = sample().oci_archive()?;
        let (b, db) = sample().oci_archive()?;
        assert_eq!(a, b);
        assert_eq!(da, db);
        let paths: Vec<String> = sample().tree()?.into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            [
                "etc/",
                "etc/a",
                "usr/",
                "usr/local/",
                "usr/local/bin/",
                "usr/local/bin/x"
            ]
        );
        let layer = sample().layer()?;
        assert_eq!(layer.len() % 512, 0);
        Ok(())
    }

    #[test]
    fn tar_headers_carry_a_valid_checksum() -> Result<(), Error> {
        let mut tar = Vec::new();
        tar_entry(&mut tar, "etc/a", 0o644, 7, 8, b'0', b"abc")?;
        let h = &tar[..512];
        let stored = u32::from_str_radix(
            std::str::from_utf8(&h[148..154]).map_err(|e| Error::Image(e.to_string()))?,
            8,
        )
        .map_err(|e| Error::Image(e.to_string()))?;
        let sum: u32 = h
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u32::from(b)
                }
            })
            .sum();
        assert_eq!(stored, sum);
        assert_eq!(&tar[512..515], b"abc");
        assert_eq!(tar.len(), 1024);
        Ok(())
    }

    /// The Dockerfile's final stage and [`Image::provider`] describe the same image: entrypoint,
    /// user, where the binary is, a distroless base that brings CA certificates and `nonroot`.
    #[test]
    fn the_dockerfile_describes_the_same_image() -> Result<(), Error> {
        let dockerfile =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Dockerfile"))
                .map_err(|e| Error::Image(e.to_string()))?;
        let last_stage = dockerfile
            .rsplit_once("\nFROM ")
            .map(|(_, s)| s)
            .ok_or_else(|| Error::Image("no final stage in the Dockerfile".into()))?;
        let line = |word: &str| {
            last_stage
                .lines()
                .find(|l| l.starts_with(word))
                .map(|l| l[word.len()..].trim().to_owned())
                .unwrap_or_default()
        };
        // A stand-in binary: the test checks the layout, not the provider's build.
        let binary = Path::new("/bin/true");
        let image = Image::provider("example.test/p:1", binary)?;
        assert!(last_stage.starts_with("gcr.io/distroless/cc-debian12:nonroot"));
        assert_eq!(line("USER "), image.user);
        let entrypoint: Vec<String> = serde_json::from_str(&line("ENTRYPOINT "))
            .map_err(|e| Error::Image(format!("ENTRYPOINT is not exec form: {e}")))?;
        assert_eq!(entrypoint, image.entrypoint);
        let copy = line("COPY ");
        assert!(copy.ends_with(&format!(" {PROVIDER_ENTRYPOINT}")), "{copy}");
        let paths: Vec<&str> = image.entries.iter().map(|e| e.path.as_str()).collect();
        for wanted in [PROVIDER_ENTRYPOINT, CA_BUNDLE, "/etc/passwd", "/tmp"] {
            assert!(paths.contains(&wanted), "{wanted} missing from {paths:?}");
        }
        assert!(
            paths.iter().any(|p| p.contains("libc.so")),
            "glibc missing: {paths:?}"
        );
        assert!(
            !paths.iter().any(|p| p.ends_with("/sh")),
            "a shell: {paths:?}"
        );
        Ok(())
    }
}
