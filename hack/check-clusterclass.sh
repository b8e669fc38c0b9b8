#!/usr/bin/env bash
# clusterctl's contract for ClusterClass files (clusterclass-<name>.yaml): they SHOULD NOT use
# environment variables and their objects SHOULD NOT set a namespace (clusterctl creates them in
# the Cluster's namespace, and one file serves every namespace). Fails, naming the line, when a
# file given (default: config/clusterctl/clusterclass-*.yaml) has `${` or `namespace:` anywhere,
# comments included, or has no `variables` and `patches` for the Cluster's choices.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
files=("$@")
[ ${#files[@]} -gt 0 ] || files=("$root"/config/clusterctl/clusterclass-*.yaml)
status=0
for f in "${files[@]}"; do
  if grep -n -F -e '${' -e 'namespace:' "$f" >&2; then
    echo "$f: a ClusterClass file must not use \${VAR} placeholders or set a namespace (clusterctl contract)" >&2
    status=1
  fi
  for key in variables patches; do
    grep -q "^  $key:" "$f" || { echo "$f: no spec.$key" >&2; status=1; }
  done
done
[ "$status" -eq 0 ] && echo "ClusterClass files follow clusterctl's contract: ${files[*]#"$root/"}"
exit "$status"
