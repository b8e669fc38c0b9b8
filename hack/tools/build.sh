#!/usr/bin/env bash
# Builds the Go tools the local control plane, the tests and the demo use, from the Go module proxy,
# and caches them.
#
#   hack/tools/build.sh [kubernetes|kubernetes-node|etcd|helm|cluster-api|runc|containerd|cni|
#                        registry|crane|cosign|kube-state-metrics|cert-manager ...]
#   (default: all)
#
# Each tool module under hack/tools/<name>/ is built into
#   $CAPM_TOOLS_CACHE/<name>-<sha256 of go.mod+go.sum, 16 hex>/bin
# (default cache: ~/.cache/cluster-api-provider-mailgun/tools). A folder that already holds every
# binary is reused and nothing is built. kube-state-metrics comes from the module proxy like the
# others; when the proxy does not serve k8s.io/kube-state-metrics/v2, from its source tarball in
# $CAPM_SOURCES (default ../shared/sources next to the checkout; see its README), its
# dependencies from the proxy, cached in kube-state-metrics-src-<sha256 of the tarball, 16 hex>. `bin/` at the repository root gets symlinks to the
# current binaries, and the Cluster API CRDs are copied to bin/capi-crds/ (the kubeadm providers'
# template CRDs to bin/capi-kubeadm-crds/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${CAPM_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cluster-api-provider-mailgun/tools}
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(kubernetes etcd helm cluster-api kubernetes-node runc containerd cni registry crane cosign kube-state-metrics cert-manager)
sources=${CAPM_SOURCES:-$root/../shared/sources}

key() { cat "$here/$1/go.mod" "$here/$1/go.sum" | sha256sum | cut -c1-16; }

# binaries <tool>: "<output name> <package>" lines
binaries() {
  case "$1" in
    kubernetes) printf '%s\n' \
      "kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver" \
      "kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager" \
      "kubectl k8s.io/kubernetes/cmd/kubectl" ;;
    kubernetes-node) printf '%s\n' \
      "kubelet k8s.io/kubernetes/cmd/kubelet" \
      "kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler" \
      "pause c:build/pause/linux/pause.c" ;;
    etcd) echo "etcd go.etcd.io/etcd/server/v3" ;;
    helm) echo "helm helm.sh/helm/v4/cmd/helm" ;;
    cluster-api) printf '%s\n' \
      "capi-manager sigs.k8s.io/cluster-api/core" \
      "clusterctl sigs.k8s.io/cluster-api/cmd/clusterctl" ;;
    runc) echo "runc github.com/opencontainers/runc" ;;
    containerd) printf '%s\n' \
      "containerd github.com/containerd/containerd/v2/cmd/containerd" \
      "containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2" \
      "ctr github.com/containerd/containerd/v2/cmd/ctr" ;;
    cni) printf '%s\n' \
      "bridge github.com/containernetworking/plugins/plugins/main/bridge" \
      "loopback github.com/containernetworking/plugins/plugins/main/loopback" \
      "host-local github.com/containernetworking/plugins/plugins/ipam/host-local" ;;
    # The release: an OCI registry for the tests (CNCF distribution, TLS), a registry client that
    # pushes the image archive by digest, and the signer.
    registry) echo "registry github.com/distribution/distribution/v3/cmd/registry" ;;
    crane) echo "crane github.com/google/go-containerregistry/cmd/crane" ;;
    cosign) echo "cosign github.com/sigstore/cosign/v2/cmd/cosign" ;;
    # The monitoring tests: the custom-resource metrics of config/metrics, served by the real thing.
    kube-state-metrics) echo "kube-state-metrics k8s.io/kube-state-metrics/v2" ;;
    *) echo "unknown tool '$1' (known: kubernetes kubernetes-node etcd helm cluster-api runc containerd cni registry crane cosign kube-state-metrics cert-manager)" >&2; return 1 ;;
  esac
}

module_version() { (cd "$here/$1" && go list -m -f '{{.Version}}' "$2"); }

ldflags() {
  case "$1" in
    kubernetes|kubernetes-node)
      local v; v=$(module_version "$1" k8s.io/kubernetes)
      local minor; minor=$(echo "$v" | cut -d. -f2)
      local f="-s -w"
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        f="$f -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
      done
      echo "$f" ;;
    helm)
      local v; v=$(module_version helm helm.sh/helm/v4)
      echo "-s -w -X helm.sh/helm/v4/internal/version.version=$v" ;;
    cluster-api)
      local v; v=$(module_version cluster-api sigs.k8s.io/cluster-api)
      echo "-s -w -X sigs.k8s.io/cluster-api/version.gitVersion=$v -X sigs.k8s.io/cluster-api/version.gitTreeState=clean" ;;
    runc)
      local v; v=$(module_version runc github.com/opencontainers/runc)
      echo "-s -w -X main.version=${v#v}" ;;
    containerd)
      local v; v=$(module_version containerd github.com/containerd/containerd/v2)
      echo "-s -w -X github.com/containerd/containerd/v2/version.Version=$v" ;;
    registry)
      local v; v=$(module_version registry github.com/distribution/distribution/v3)
      echo "-s -w -X github.com/distribution/distribution/v3/version.version=$v" ;;
    crane)
      local v; v=$(module_version crane github.com/google/go-containerregistry)
      echo "-s -w -X github.com/google/go-containerregistry/cmd/crane/cmd.Version=$v" ;;
    cosign)
      local v; v=$(module_version cosign github.com/sigstore/cosign/v2)
      echo "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=$v -X sigs.k8s.io/release-utils/version.gitTreeState=clean" ;;
    kube-state-metrics)
      # What its Makefile stamps: `kube-state-metrics --version` and its build_info metric.
      # Read from go.mod: the tarball build must not need the proxy to serve the module.
      local v cg; v=$(ksm_required k8s.io/kube-state-metrics/v2); cg=$(ksm_required k8s.io/client-go)
      echo "-s -w -X github.com/prometheus/common/version.Version=$v -X github.com/prometheus/common/version.Branch=release -X k8s.io/kube-state-metrics/v2/pkg/app.ClientGoVersion=$cg" ;;
    *) echo "-s -w" ;;
  esac
}

# ksm_required <module>: its version in hack/tools/kube-state-metrics/go.mod.
ksm_required() { awk -v m="$1" '$1 == m { print $2 }' "$here/kube-state-metrics/go.mod"; }

# The kube-state-metrics source tarball (the fallback when the proxy does not serve the module).
ksm_tarball() { local v; v=$(ksm_required k8s.io/kube-state-metrics/v2); echo "$sources/kube-state-metrics-${v#v}.src.tar.gz"; }

# ksm_from_proxy: whether the module proxy serves the kube-state-metrics module hack/tools names.
ksm_from_proxy() { (cd "$here/kube-state-metrics" && go mod download k8s.io/kube-state-metrics/v2 >/dev/null 2>&1); }

# ksm_build_tarball <dir>: unpack the tarball and build its main package, its go.mod and go.sum
# as released (dependencies from the proxy), stamped like the proxy build.
ksm_build_tarball() {
  local dir=$1 tarball work status=0 t0
  tarball=$(ksm_tarball)
  [ -r "$tarball" ] || { echo "    kube-state-metrics: the proxy does not serve the module and $tarball is missing (set CAPM_SOURCES)" >&2; return 1; }
  t0=$(date +%s)
  work=$(mktemp -d)
  tar -xzf "$tarball" -C "$work"
  echo "    kube-state-metrics: go build . in $(basename "$tarball")"
  (cd "$work"/kube-state-metrics-* && go build -trimpath -tags "$(tags kube-state-metrics)" \
    -ldflags "$(ldflags kube-state-metrics)" -o "$dir/kube-state-metrics.tmp.$$" .) || status=$?
  rm -rf "$work"
  [ "$status" -eq 0 ] || { echo "    kube-state-metrics: go build failed after $(elapsed "$t0")" >&2; return "$status"; }
  mv "$dir/kube-state-metrics.tmp.$$" "$dir/kube-state-metrics"
  echo "    kube-state-metrics: built in $(elapsed "$t0")"
}

# Build tags and cgo per tool: runc needs cgo and libseccomp (`make deps`) to apply the
# RuntimeDefault seccomp profile the chart asks for; everything else is pure Go.
tags() { case "$1" in runc) echo seccomp ;; *) echo selinux,notest ;; esac; }
cgo() { case "$1" in runc) echo 1 ;; *) echo 0 ;; esac; }

# pause_version <pause.c>: v<TAG> from the pause Makefile next to the source (upstream appends a
# git describe, which a module download does not have).
pause_version() {
  echo "v$(sed -n 's/^TAG ?= //p' "$(dirname "$(dirname "$1")")/Makefile")"
}

elapsed() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

# Says every CAPM_BUILD_TICK seconds (30) that `$1`, started at `$2`, is still building; run in
# the background and killed when the build ends.
progress() {
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "${CAPM_BUILD_TICK:-30}" >/dev/null & nap=$!
    wait "$nap"
    echo "    $1: still building, $(elapsed "$2") elapsed (total $(elapsed "$run_start"))"
  done
}

# build_one <tool> <name> <package> <dir>: go build into <name>.tmp.<pid> (two checkouts sharing
# the cache may build the same tool at once; each renames its own file), with a line every 30 s (CAPM_BUILD_TICK) so a cold build
# (modules downloaded, then compiled; up to several minutes per binary on 2 cores) shows progress.
build_one() {
  local tool=$1 name=$2 pkg=$3 dir=$4 t0 ticker status=0
  t0=$(date +%s)
  echo "    $name: go build $pkg"
  progress "$name" "$t0" &
  ticker=$!
  if [ "${pkg#c:}" != "$pkg" ]; then
    # The Pod sandbox's pause process, from the kubernetes module's C source, the way upstream
    # builds the pause image (static, so the image holds this one file).
    local src; src="$(cd "$here/$tool" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/${pkg#c:}"
    kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
    gcc -Os -Wall -Werror -static -DVERSION="$(pause_version "$src")" -o "$dir/$name.tmp.$$" "$src"
    mv "$dir/$name.tmp.$$" "$dir/$name"
    echo "    $name: built in $(elapsed "$t0")"
    return
  fi
  (cd "$here/$tool" && CGO_ENABLED=$(cgo "$tool") go build -trimpath -tags "$(tags "$tool")" -ldflags "$(ldflags "$tool")" -o "$dir/$name.tmp.$$" "$pkg") || status=$?
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  [ "$status" -eq 0 ] || { echo "    $name: go build failed after $(elapsed "$t0")" >&2; return "$status"; }
  mv "$dir/$name.tmp.$$" "$dir/$name"
  echo "    $name: built in $(elapsed "$t0")"
}

# --- cert-manager (test tool) -------------------------------------------------------------------
# The module proxy serves cert-manager's main module but not its binaries' modules (cmd/controller,
# cmd/cainjector), and not the Venafi client the controller imports; so they are built from a
# source snapshot of v1.21.1 with only the Venafi issuer removed ($CAPM_CERT_MANAGER_SRC, default
# in $CAPM_SOURCES; its PATCHED.md lists the change), dependencies from
# the module proxy. Cached in $cache/cert-manager-<sha256 of the tarball, 16 hex>/; the tarball's
# hash is pinned so a different snapshot is refused rather than cached under a new key unseen.
# Linked into bin/: cert-manager-controller, cert-manager-cainjector; CRDs in bin/cert-manager-crds/.
cert_manager_version=v1.21.1
cert_manager_sha256=a4fe12245fbfe5fe19dd206dfa10789c54427dbf9990e15b1f8df77503d3e2ef
cert_manager_src=${CAPM_CERT_MANAGER_SRC:-$sources/cert-manager-1.21.1-novenafi.src.tar.gz}
build_cert_manager() {
  local sum dir src name t0 start status
  [ -f "$cert_manager_src" ] || { echo "cert-manager: source snapshot $cert_manager_src not found (set CAPM_CERT_MANAGER_SRC)" >&2; return 1; }
  sum=$(sha256sum "$cert_manager_src" | cut -d' ' -f1)
  [ "$sum" = "$cert_manager_sha256" ] || { echo "cert-manager: $cert_manager_src has sha256 $sum, expected $cert_manager_sha256" >&2; return 1; }
  dir="$cache/cert-manager-${sum:0:16}"
  if [ -x "$dir/bin/cert-manager-controller" ] && [ -x "$dir/bin/cert-manager-cainjector" ] && [ -d "$dir/crds" ]; then
    echo "==> cert-manager: cached in $dir/bin, nothing to build"
  else
    echo "==> cert-manager: building controller and cainjector $cert_manager_version into $dir/bin (cold: minutes; later runs reuse them)"
    start=$(date +%s)
    mkdir -p "$dir/bin"
    src="$dir/src.$$"
    rm -rf "$src" && mkdir -p "$src" && tar xzf "$cert_manager_src" -C "$src" --strip-components=1
    for name in controller cainjector; do
      [ -x "$dir/bin/cert-manager-$name" ] && continue
      t0=$(date +%s) status=0
      echo "    cert-manager-$name: go build ./cmd/$name"
      progress "cert-manager-$name" "$t0" &
      local ticker=$!
      (cd "$src/cmd/$name" && go build -trimpath -ldflags "-s -w -X github.com/cert-manager/cert-manager/pkg/util.AppVersion=$cert_manager_version -X github.com/cert-manager/cert-manager/pkg/util.AppGitState=clean" \
        -o "$dir/bin/cert-manager-$name.tmp.$$" .) || status=$?
      kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
      [ "$status" -eq 0 ] || { echo "    cert-manager-$name: go build failed after $(elapsed "$t0")" >&2; rm -rf "$src"; return "$status"; }
      mv "$dir/bin/cert-manager-$name.tmp.$$" "$dir/bin/cert-manager-$name"
      echo "    cert-manager-$name: built in $(elapsed "$t0")"
    done
    rm -rf "$dir/crds.$$" && cp -r "$src/deploy/crds" "$dir/crds.$$" && rm -f "$dir/crds.$$/README.md"
    rm -rf "$dir/crds" && mv "$dir/crds.$$" "$dir/crds"
    chmod -R u+w "$src" && rm -rf "$src"
    echo "==> cert-manager: built in $(elapsed "$start")"
  fi
  ln -sfn "$dir/bin/cert-manager-controller" "$root/bin/cert-manager-controller"
  ln -sfn "$dir/bin/cert-manager-cainjector" "$root/bin/cert-manager-cainjector"
  rm -rf "$root/bin/cert-manager-crds" && cp -r "$dir/crds" "$root/bin/cert-manager-crds" && chmod u+w "$root/bin/cert-manager-crds"/*.yaml
}
# --- end cert-manager ---------------------------------------------------------------------------

run_start=$(date +%s)
mkdir -p "$root/bin"
for tool in "${tools[@]}"; do
  if [ "$tool" = cert-manager ]; then build_cert_manager; continue; fi
  binaries "$tool" >/dev/null
  dir="$cache/$tool-$(key "$tool")/bin"
  from_tarball=
  if [ "$tool" = kube-state-metrics ] && [ ! -x "$dir/kube-state-metrics" ] && ! ksm_from_proxy; then
    from_tarball=1
    dir="$cache/$tool-src-$(sha256sum "$(ksm_tarball)" 2>/dev/null | cut -c1-16)/bin"
  fi
  missing=()
  while read -r name pkg; do
    [ -x "$dir/$name" ] || missing+=("$name $pkg")
  done < <(binaries "$tool")
  if [ ${#missing[@]} -eq 0 ]; then
    echo "==> $tool: cached in $dir, nothing to build"
  else
    echo "==> $tool: building ${#missing[@]} binar$([ ${#missing[@]} -eq 1 ] && echo y || echo ies) into $dir (cold: minutes; later runs reuse them)"
    mkdir -p "$dir"
    start=$(date +%s)
    if [ -n "$from_tarball" ]; then
      ksm_build_tarball "$dir"
    else
      for entry in "${missing[@]}"; do
        read -r name pkg <<<"$entry"
        build_one "$tool" "$name" "$pkg" "$dir"
      done
    fi
    echo "==> $tool: built in $(elapsed "$start")"
  fi
  while read -r name _; do ln -sfn "$dir/$name" "$root/bin/$name"; done < <(binaries "$tool")
  if [ "$tool" = cluster-api ]; then
    src=$(cd "$here/cluster-api" && go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)
    rm -rf "$root/bin/capi-crds" && mkdir -p "$root/bin/capi-crds"
    # All core CRDs: the core manager watches most of them and fails to start without them.
    cp "$src"/core/config/crd/bases/*.yaml "$root/bin/capi-crds/"
    chmod u+w "$root/bin/capi-crds"/*.yaml
    # The kubeadm providers' template CRDs, apart (no test runs their managers): the API server
    # checks the clusterclass flavor's KubeadmControlPlaneTemplate and KubeadmConfigTemplate.
    rm -rf "$root/bin/capi-kubeadm-crds" && mkdir -p "$root/bin/capi-kubeadm-crds"
    cp "$src"/controlplane/kubeadm/config/crd/bases/*templates.yaml \
      "$src"/bootstrap/kubeadm/config/crd/bases/*templates.yaml "$root/bin/capi-kubeadm-crds/"
    chmod u+w "$root/bin/capi-kubeadm-crds"/*.yaml
  fi
done
