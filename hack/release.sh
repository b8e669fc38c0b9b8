#!/usr/bin/env bash
# Publishes a release (`make release VERSION=x.y.z REGISTRY=host[:port]/path [COSIGN_KEY=...]`):
#
#   1. the image: this build's provider (release profile) as an OCI image (capm-image, the
#      builder `make image` uses), pushed with crane to $REGISTRY/cluster-api-provider-mailgun,
#      tag $VERSION; the registry's digest must be the archive's own (the build is
#      reproducible, so the digest names exactly these bytes);
#   2. the chart: packaged as cluster-api-provider-mailgun-$VERSION.tgz with the image pinned by
#      that digest (values.yaml `image.digest`), pushed with `helm push` to oci://$REGISTRY/charts;
#   3. out/ (or $OUT): the clusterctl assets (hack/release-manifests.sh, the components pinned to
#      the same digest), the chart archive, a CycloneDX SBOM of the provider's crates
#      (cargo-cyclonedx, from Cargo.lock), SHA256SUMS of all of them, and release.txt (the
#      references by digest);
#   4. with COSIGN_KEY (a cosign key pair's private key; COSIGN_PASSWORD its password, may be
#      empty): cosign signatures of the image and the chart in the registry, the SBOM attached to
#      the image as a signed CycloneDX attestation, SHA256SUMS.sig and cosign.pub in out/. Nothing
#      is uploaded to a transparency log (`--tlog-upload=false`): verify with
#      `cosign verify --key cosign.pub --insecure-ignore-tlog=true`.
#
# Credentials for the registry are the clients' own (`crane auth login`, `helm registry login`;
# cosign reads crane's). A registry with a private CA: export SSL_CERT_FILE=<its CA bundle>.
# For tests: CAPM_RELEASE_IMAGE_ARCHIVE=<an OCI archive capm-image wrote> releases that image
# instead of building one (the Pods test releases its debug build this way).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/bin
out=${OUT:-$root/out}
version=${VERSION:-}
registry=${REGISTRY:-}
cosign_key=${COSIGN_KEY:-}
die() { echo "release: $*" >&2; exit 1; }
step() { echo "==> $*"; }

[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "VERSION=x.y.z (no leading v), got '$version'"
[[ $registry =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] || die "REGISTRY=host[:port][/path], got '$registry'"
for tool in helm crane; do [ -x "$bin/$tool" ] || die "bin/$tool missing: run \`hack/tools/build.sh helm crane cosign\`"; done
[ -z "$cosign_key" ] || [ -x "$bin/cosign" ] || die "bin/cosign missing: run \`hack/tools/build.sh cosign\`"
cargo cyclonedx --version >/dev/null 2>&1 || die "cargo-cyclonedx missing (the SBOM): run \`make deps-release\`"
[ -z "$cosign_key" ] || [ -f "$cosign_key" ] || die "COSIGN_KEY=$cosign_key: no such file"
workspace_version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$root/Cargo.toml")
[ "$version" = "$workspace_version" ] \
  || die "VERSION=$version but the workspace is $workspace_version: bump [workspace.package] version in Cargo.toml first"
# clusterctl refuses a release whose series metadata.yaml does not list.
python3 - "$root/metadata.yaml" "$version" <<'EOF' || die "metadata.yaml has no release series for $version"
import sys, yaml
major, minor, _ = (int(p) for p in sys.argv[2].split("."))
series = yaml.safe_load(open(sys.argv[1]))["releaseSeries"]
sys.exit(0 if any(s["major"] == major and s["minor"] == minor for s in series) else 1)
EOF

image_repo=$registry/cluster-api-provider-mailgun
chart_name=cluster-api-provider-mailgun
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

step "image $image_repo:$version"
archive=${CAPM_RELEASE_IMAGE_ARCHIVE:-}
if [ -z "$archive" ]; then
  cargo build --release -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun
  archive=$out/provider.oci.tar
  cargo run -q -p capm-test-support --bin capm-image -- provider \
    --binary "${CARGO_TARGET_DIR:-$root/target}/release/cluster-api-provider-mailgun" \
    --name "$image_repo:$version" -o "$archive"
fi
mkdir "$work/layout"
tar -xf "$archive" -C "$work/layout"
digest=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["manifests"]; assert len(m)==1, m; print(m[0]["digest"])' "$work/layout/index.json")
"$bin/crane" push "$work/layout" "$image_repo:$version" >"$work/crane.log" 2>&1 \
  || { cat "$work/crane.log" >&2; die "crane push failed"; }
pushed=$("$bin/crane" digest "$image_repo:$version")
[ "$pushed" = "$digest" ] || die "the registry has $pushed for $image_repo:$version, the archive $digest"
"$bin/crane" manifest "$image_repo@$digest" >/dev/null
echo "    pushed $image_repo@$digest"

step "chart oci://$registry/charts/$chart_name:$version (image pinned by digest)"
cp -r "$root/charts/$chart_name" "$work/chart"
python3 - "$work/chart/values.yaml" "$image_repo" "$version" "$digest" <<'EOF'
import re, sys
path, repository, tag, digest = sys.argv[1:]
text = open(path).read()
# Line edits keep values.yaml's comments (its documentation); each must match exactly once.
for pattern, value in (
    (r"(?m)^(  repository: ).*$", repository),
    (r'(?m)^(  tag: )"".*$', f'"{tag}"'),
    (r'(?m)^(  digest: )"".*$', f'"{digest}"'),
):
    text, n = re.subn(pattern, lambda m: m.group(1) + value, text)
    if n != 1:
        sys.exit(f"values.yaml: {pattern} matched {n} lines, not one")
open(path, "w").write(text)
EOF
"$bin/helm" lint --strict "$work/chart" --set mail.recipient=ops@example.com \
  --set mail.mailgun.domain=mg.example.com --set mail.mailgun.apiKeySecret.name=k >/dev/null
"$bin/helm" package "$work/chart" --version "$version" --app-version "$version" -d "$out" >/dev/null
chart_tgz=$out/$chart_name-$version.tgz
push_out=$("$bin/helm" push "$chart_tgz" "oci://$registry/charts" 2>&1) || die "helm push failed: $push_out"
chart_digest=$(sed -n 's/^Digest: //p' <<<"$push_out")
[[ $chart_digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "no digest in helm push's output: $push_out"
echo "    pushed oci://$registry/charts/$chart_name:$version@$chart_digest"

step "clusterctl assets"
CAPM_IMAGE_REPOSITORY=$image_repo CAPM_IMAGE_DIGEST=$digest "$root/hack/release-manifests.sh" "$out"

step "SBOM (CycloneDX, the provider's crates from Cargo.lock)"
sbom=$out/$chart_name-$version.cdx.json
# cargo-cyclonedx writes one file beside every workspace member's Cargo.toml; the provider's
# (cmd/) is kept, the others removed. Its crate list comes from `cargo metadata`, which resolves
# features for the whole workspace: a crate only tests enable (mockall, through capm-mailer's
# `mock` feature) is listed too, so the SBOM errs on the side of too much.
name=capm-release-sbom-$$
cargo cyclonedx --manifest-path "$root/cmd/Cargo.toml" --format json --spec-version 1.5 \
  --override-filename "$name" -q
mv "$root/cmd/$name.json" "$sbom"
find "$root" -path "$root/target" -prune -o -name "$name.json" -type f -exec rm -f {} +
python3 - "$sbom" <<'EOF'
import json, sys
bom = json.load(open(sys.argv[1]))
names = {c["name"] for c in bom.get("components", [])}
for crate in ("kube", "tokio", "capm-mailer"):
    if crate not in names:
        sys.exit(f"the SBOM lists no {crate}")
print(f"    {len(names)} components")
EOF

assets=(infrastructure-components.yaml fulfilment-page-components.yaml metadata.yaml cluster-template.yaml
  cluster-template-clusterclass.yaml clusterclass-mailgun.yaml
  "$chart_name-$version.tgz" "$chart_name-$version.cdx.json")
cat > "$out/release.txt" <<EOF
version: $version
image: $image_repo@$digest
image-tag: $image_repo:$version
chart: oci://$registry/charts/$chart_name
chart-version: $version
chart-digest: $chart_digest
EOF
assets+=(release.txt)
(cd "$out" && sha256sum "${assets[@]}" > SHA256SUMS)
step "SHA256SUMS: ${#assets[@]} files"

if [ -n "$cosign_key" ]; then
  step "signing with $cosign_key (no transparency log upload)"
  export COSIGN_PASSWORD=${COSIGN_PASSWORD:-}
  # Each step's output is shown only when it fails (cosign is chatty on success).
  cosign() {
    local log=$work/cosign.log
    "$bin/cosign" "$@" >"$log" 2>&1 || { cat "$log" >&2; die "cosign $1 failed"; }
  }
  cosign sign --key "$cosign_key" --tlog-upload=false --yes "$image_repo@$digest"
  cosign sign --key "$cosign_key" --tlog-upload=false --yes "$registry/charts/$chart_name@$chart_digest"
  cosign attest --key "$cosign_key" --tlog-upload=false --yes --type cyclonedx \
    --predicate "$sbom" "$image_repo@$digest"
  cosign sign-blob --key "$cosign_key" --tlog-upload=false --yes \
    --output-signature "$out/SHA256SUMS.sig" "$out/SHA256SUMS"
  "$bin/cosign" public-key --key "$cosign_key" > "$out/cosign.pub"
  chmod 644 "$out/SHA256SUMS.sig" "$out/cosign.pub"
  cosign verify --key "$out/cosign.pub" --insecure-ignore-tlog=true "$image_repo@$digest"
  echo "    signed: image, chart, SBOM attestation, SHA256SUMS (public key: $out/cosign.pub)"
fi

step "released $version"
cat "$out/release.txt"
