#!/usr/bin/env bash
# The demo: a local control plane with the Cluster API core manager, an SMTP server, and the
# provider. A sample Cluster + MailgunCluster is applied; the request mail arrives; the request is
# fulfilled through the fulfilment page the mail links (curl, no cluster credentials; the mail's
# kubectl patch is shown beside the link); the Cluster reaches phase Provisioned with
# InfrastructureReady=True. Everything is stopped and removed at the end, also on failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=hack/demo-lib.sh
. hack/demo-lib.sh
die() { echo "demo: $*" >&2; exit 1; }

say "building the provider and the local environment CLI (a fresh clone compiles every crate: minutes)"
cargo build -q -p cluster-api-provider-mailgun -p capm-test-support --bin cluster-api-provider-mailgun --bin capm-env
capm_env=${CARGO_TARGET_DIR:-target}/debug/capm-env
provider=${CARGO_TARGET_DIR:-target}/debug/cluster-api-provider-mailgun
kubectl=bin/kubectl

start_work demo

say "starting a local control plane (etcd, kube-apiserver, kube-controller-manager) with the Cluster API CRDs"
eval "$("$capm_env" up --dir "$state" --capi-crds)"
"$kubectl" version

say "installing the provider's CRDs"
"$kubectl" apply --server-side -f config/crd/ >/dev/null
"$kubectl" wait --for condition=established --timeout=60s -f config/crd/ >/dev/null

say "starting the Cluster API core manager ($(bin/capi-manager --version 2>/dev/null | head -1 || echo v1.14))"
start_capi_manager

say "starting an SMTP server on loopback"
mkdir -p "$work/mail"
# The server exits when its stdin closes: a FIFO this script holds open, so it also goes away
# if the script is killed.
mkfifo "$work/smtp.in"
python3 tests/mail-servers/smtp_server.py --dir "$work/mail" < "$work/smtp.in" > "$work/smtp.port" 2>"$work/smtp.log" &
pids+=($!)
input_fd=3
exec 3> "$work/smtp.in"
wait_for 20 "the SMTP server" test -s "$work/smtp.port"
smtp_addr=$(head -1 "$work/smtp.port")
echo "SMTP server listening on $smtp_addr"

say "starting the provider (SMTP backend; the fulfilment page on loopback, docs/fulfilment.md)"
# The fulfilment links' key, as the chart's fulfilment.keysSecret would hold it.
head -c 32 /dev/urandom | base64 > "$work/fulfilment-keys"
page_port=$(free_port)
page="http://127.0.0.1:$page_port"
cat > "$work/provider.json" <<JSON
{ "mailer": { "smtp": { "url": "smtp://$smtp_addr", "starttls": "never" } },
  "mailFrom": "cluster-api-provider-mailgun@capm.example.com" }
JSON
MAIL_RECIPIENT=infrastructure-team@example.com "$provider" --config "$work/provider.json" \
  --message-id-domain capm.example.com --kubeconfig "$KUBECONFIG" --leader-elect=false --webhook-port 0 \
  --diagnostics-address "127.0.0.1:$(free_port)" --insecure-diagnostics --health-probe-bind-address "127.0.0.1:$(free_port)" \
  --fulfilment-url "$page" --fulfilment-keys-file "$work/fulfilment-keys" --fulfilment-bind-address "127.0.0.1:$page_port" \
  > "$work/provider.log" 2>&1 &
pids+=($!)

say "applying the sample Cluster and MailgunCluster"
"$kubectl" apply -f config/samples/infrastructure_v1beta1_mailguncluster.yaml -f config/samples/cluster_v1beta2_cluster.yaml

say "waiting for the request mail"
wait_for 90 "the request mail (provider log: $work/provider.log)" sh -c "ls '$work'/mail/*.eml"
mail=$(ls "$work"/mail/*.eml | head -1)
# Headers as received, the body decoded from its transfer encoding.
python3 - "$mail" > "$work/mail.txt" <<'PY'
import email, sys
msg = email.message_from_binary_file(open(sys.argv[1], "rb"))
for name in ("From", "Reply-To", "To", "Subject", "Message-ID", "Date"):
    print(f"{name}: {msg[name]}")
print()
print(msg.get_payload(decode=True).decode(msg.get_content_charset() or "utf-8"))
PY
echo "----- the mail the recipient got -----"
cat "$work/mail.txt"
echo "-----"

say "the mail offers two ways to record the cluster: the kubectl patch, and the link beside it"
fulfil=$(grep -m1 'kubectl patch mailguncluster' "$work/mail.txt" | sed 's/^ *//; s/<host>/api.hello-mailgun.example.com/')
[ -n "$fulfil" ] || die "the mail carries no kubectl command"
link=$(grep -m1 -o "$page/fulfil/[A-Za-z0-9_-]*" "$work/mail.txt" || true)
[ -n "$link" ] || die "the mail carries no fulfilment link"
echo "with cluster credentials:    $fulfil"
echo "without (the page, a link):  $link"

say "fulfilling the request through the page, with curl as a browser would (no cluster credentials)"
# What the page says, without its markup.
text() { python3 -c 'import html, re, sys; t = re.sub(r"<(style|head)[^>]*>.*?</\1>|<[^>]+>", " ", sys.stdin.read(), flags=re.S); print(re.sub(r"[ \t]*\n[\s]*", "\n", html.unescape(t)).strip())'; }
echo "\$ curl $link"
curl -sS -c "$work/cookies" -b "$work/cookies" "$link" > "$work/page.html"
text < "$work/page.html" | sed -n '1,12p'
token=$(grep -o 'name="form-token" value="[^"]*"' "$work/page.html" | sed 's/.*value="//; s/"$//')
[ -n "$token" ] || die "the page has no form"
echo "\$ curl -d host=api.hello-mailgun.example.com -d port=6443 -d form-token=... $link"
curl -sS -c "$work/cookies" -b "$work/cookies" -d host=api.hello-mailgun.example.com -d port=6443 \
  --data-urlencode "form-token=$token" "$link" | text

say "waiting for the Cluster to be Provisioned with InfrastructureReady=True"
wait_for 90 "Cluster phase Provisioned (core manager log: $work/capi-manager.log)" \
  sh -c "[ \"\$($kubectl get cluster hello-mailgun -o jsonpath='{.status.phase}')\" = Provisioned ]"
wait_for 30 "InfrastructureReady=True" \
  sh -c "[ \"\$($kubectl get cluster hello-mailgun -o jsonpath='{.status.conditions[?(@.type==\"InfrastructureReady\")].status}')\" = True ]"
"$kubectl" get cluster,mailguncluster -o wide
echo
"$kubectl" get cluster hello-mailgun -o jsonpath='phase={.status.phase} infrastructureReady={.status.conditions[?(@.type=="InfrastructureReady")].status} endpoint={.spec.controlPlaneEndpoint.host}:{.spec.controlPlaneEndpoint.port}{"\n"}'
[ "$(ls "$work"/mail/*.eml | wc -l)" = 1 ] || die "expected exactly one mail"

say "done: one mail, one cluster; cleaning up"
