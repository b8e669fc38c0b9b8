#!/usr/bin/env bash
# Builds the Go peer the benchmark compares the provider with (the Cluster API book's
# MailgunCluster controller, written the ordinary Go way: ../shared/peer/goref by default) and
# caches it like the other Go tools, by the hash of its sources:
#   $CAPM_TOOLS_CACHE/goref-<sha256 of go.mod+go.sum+main.go, 16 hex>/goref
# Prints the binary's path. A warm cache builds nothing.
#
#   hack/build-peer.sh [PEER_DIR]
set -euo pipefail
peer=$(cd "${1:-$(dirname "$0")/../../shared/peer/goref}" && pwd)
cache=${CAPM_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cluster-api-provider-mailgun/tools}
key=$(cat "$peer/go.mod" "$peer/go.sum" "$peer/main.go" | sha256sum | cut -c1-16)
out="$cache/goref-$key/goref"
if [ ! -x "$out" ]; then
  echo "building the Go peer from $peer (Go module proxy; about 4 minutes cold)" >&2
  start=$SECONDS
  mkdir -p "$(dirname "$out")"
  (cd "$peer" && GOTOOLCHAIN=local GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out.tmp" .)
  mv "$out.tmp" "$out"
  echo "built the Go peer in $((SECONDS - start)) s" >&2
fi
echo "$out"
