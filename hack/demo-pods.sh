#!/usr/bin/env bash
# The demo with real Pods: a local control plane with a node (containerd, kubelet, scheduler on a
# bridge of its own), the provider's image built by this project and imported into the node,
# `helm install` of the chart (2 replicas, namespace enforcing "restricted"), the Mailgun contract
# server on the host, a sample Cluster + MailgunCluster, the request mail. Needs root. Everything
# is stopped and removed at the end, also on failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=hack/demo-lib.sh
. hack/demo-lib.sh
die() {
  echo "demo-pods: $*" >&2
  if [ -n "${KUBECONFIG:-}" ]; then
    bin/kubectl -n capm-system get pods -o wide >&2
    bin/kubectl -n capm-system logs -l app.kubernetes.io/name=cluster-api-provider-mailgun --prefix --tail=15 >&2
  fi
  exit 1
}
[ "$(id -u)" = 0 ] || die "the node (kubelet, containerd, a bridge) needs root"

say "building the provider, the local environment CLI and the Mailgun contract server"
cargo build -q -p cluster-api-provider-mailgun -p capm-test-support -p capm-mail-servers \
  --bin cluster-api-provider-mailgun --bin capm-env --bin mailgun-contract-server
capm_env=target/debug/capm-env
kubectl=bin/kubectl
image=capm.local/cluster-api-provider-mailgun:demo

start_work demo-pods

say "starting a control plane and a node; building the provider's image and importing it"
eval "$("$capm_env" up --dir "$state" --capi-crds --node --timeout 180 \
  --load-image target/debug/cluster-api-provider-mailgun --image "$image")"
"$kubectl" get nodes -o wide
gateway=$(sed -n 's|^ *server: https://\([0-9.]*\):.*|\1|p' "$KUBECONFIG" | head -1)

say "starting the Cluster API core manager"
start_capi_manager

say "starting the Mailgun contract server on the node's bridge ($gateway), where Pods reach it"
api_key="key-demo-$RANDOM$RANDOM"
# It exits when its stdin closes: a FIFO this script holds open, so it also goes away if the
# script is killed.
mkfifo "$work/mailgun.in"
MAILGUN_CONTRACT_API_KEY=$api_key target/debug/mailgun-contract-server --listen "$gateway:0" \
  --domain mg.example.com < "$work/mailgun.in" > "$work/mailgun.addr" 2> "$work/mailgun.log" &
pids+=($!)
input_fd=4
exec 4> "$work/mailgun.in"
wait_for 20 "the Mailgun contract server" test -s "$work/mailgun.addr"
mailgun=$(head -1 "$work/mailgun.addr")

say "helm install: 2 replicas from $image into a namespace enforcing restricted"
"$kubectl" create namespace capm-system
"$kubectl" label namespace capm-system pod-security.kubernetes.io/enforce=restricted
printf '%s' "$api_key" > "$work/api-key"
"$kubectl" -n capm-system create secret generic mailgun-api-key --from-file=api-key="$work/api-key"
bin/helm install capm charts/cluster-api-provider-mailgun -n capm-system \
  --set image.repository="${image%:*}" --set image.tag="${image##*:}" --set image.pullPolicy=Never \
  --set mail.recipient=infrastructure-team@example.com --set mail.mailgun.domain=mg.example.com \
  --set mail.mailgun.baseURL="http://$mailgun" --set mail.mailgun.apiKeySecret.name=mailgun-api-key \
  --wait --timeout 3m
"$kubectl" -n capm-system get pods -o wide
echo "leader: $("$kubectl" -n capm-system get lease cluster-api-provider-mailgun-leader -o jsonpath='{.spec.holderIdentity}')"

say "applying the sample Cluster and MailgunCluster"
"$kubectl" apply -f config/samples/infrastructure_v1beta1_mailguncluster.yaml -f config/samples/cluster_v1beta2_cluster.yaml

say "waiting for the request mail at the Mailgun contract server"
wait_for 120 "the request mail" sh -c "curl -fsS 'http://$mailgun/_control/messages' | grep -q subject"
curl -fsS "http://$mailgun/_control/messages" | python3 -c '
import json, sys
for m in json.load(sys.stdin):
    print("To:", ", ".join(m["to"])); print("Subject:", m["subject"]); print(); print(m.get("text") or "")'
[ "$(curl -fsS "http://$mailgun/_control/messages" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')" = 1 ] \
  || die "expected exactly one mail"

say "done: two Pods, one leader, one mail; cleaning up"
