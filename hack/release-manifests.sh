#!/usr/bin/env bash
# Renders the clusterctl release assets into a folder (default: out/):
#   infrastructure-components.yaml  the chart rendered for clusterctl: one Namespace (capm-system),
#                                   cert-manager for the webhook certificate, the Mailgun backend
#                                   configured by the walkthrough's variables ${MAIL_RECIPIENT},
#                                   ${MAILGUN_DOMAIN} and ${MAILGUN_API_KEY}
#   metadata.yaml                   release series -> Cluster API contract
#   cluster-template.yaml           for `clusterctl generate cluster`
#   cluster-template-clusterclass.yaml
#                                   for `clusterctl generate cluster --flavor clusterclass`
#   clusterclass-mailgun.yaml       the ClusterClass that flavor names (clusterctl adds it)
# Usage: hack/release-manifests.sh [out-dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/out}
helm=${HELM:-$root/bin/helm}
[ -x "$helm" ] || { echo "helm not found at $helm: run \`make tools\`" >&2; exit 1; }
mkdir -p "$out"
namespace=capm-system
"$helm" template capm "$root/charts/cluster-api-provider-mailgun" \
  --namespace "$namespace" \
  --set fullnameOverride=capm-controller-manager \
  --set 'mail.recipient=${MAIL_RECIPIENT}' \
  --set mail.backend=mailgun \
  --set 'mail.mailgun.domain=${MAILGUN_DOMAIN}' \
  --set mail.mailgun.apiKeySecret.name=capm-mailgun-api-key \
  --set webhook.certManager.enabled=true \
  --set crds.keep=false \
  | python3 "$root/hack/clusterctl_components.py" "$namespace" > "$out/infrastructure-components.yaml"
cp "$root/metadata.yaml" "$out/metadata.yaml"
cp "$root/config/clusterctl/cluster-template.yaml" "$out/cluster-template.yaml"
cp "$root/config/clusterctl/cluster-template-clusterclass.yaml" "$out/cluster-template-clusterclass.yaml"
cp "$root/config/clusterctl/clusterclass-mailgun.yaml" "$out/clusterclass-mailgun.yaml"
echo "wrote $out/infrastructure-components.yaml, metadata.yaml, cluster-template.yaml, cluster-template-clusterclass.yaml, clusterclass-mailgun.yaml"
