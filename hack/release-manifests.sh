#!/usr/bin/env bash
# Renders the clusterctl release assets into a folder (default: out/):
#   infrastructure-components.yaml  the chart rendered for clusterctl: one Namespace (capm-system),
#                                   cert-manager for the webhook certificate, the Mailgun backend
#                                   configured by the walkthrough's variables ${MAIL_RECIPIENT},
#                                   ${MAILGUN_DOMAIN} and ${MAILGUN_API_KEY}, and the account's
#                                   region ${MAILGUN_REGION} (us, the default, or eu)
#   fulfilment-page-components.yaml the fulfilment page apart from the keys, applied beside
#                                   `clusterctl init` (clusterctl generate yaml --from ... |
#                                   kubectl apply -f -): its Deployment, ServiceAccount, roles and
#                                   Service, the links' key Secret (${FULFILMENT_KEYS}) and the
#                                   ConfigMap the provider reads its public URL from
#                                   (${FULFILMENT_URL}); ${FULFILMENT_TRUSTED_PROXIES} optional
#   metadata.yaml                   release series -> Cluster API contract
#   cluster-template.yaml           for `clusterctl generate cluster`
#   cluster-template-clusterclass.yaml
#                                   for `clusterctl generate cluster --flavor clusterclass`
#   clusterclass-mailgun.yaml       the ClusterClass that flavor names (clusterctl adds it); no
#                                   placeholders, no namespace (checked: hack/check-clusterclass.sh)
# Usage: hack/release-manifests.sh [out-dir]
# CAPM_IMAGE_REPOSITORY and CAPM_IMAGE_DIGEST (sha256:...) pin the components' image (`make
# release` sets them to what it pushed); unset, the chart's default image.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/out}
helm=${HELM:-$root/bin/helm}
[ -x "$helm" ] || { echo "helm not found at $helm: run \`make tools\`" >&2; exit 1; }
mkdir -p "$out"
namespace=capm-system
image=()
[ -z "${CAPM_IMAGE_REPOSITORY:-}" ] || image+=(--set "image.repository=$CAPM_IMAGE_REPOSITORY")
[ -z "${CAPM_IMAGE_DIGEST:-}" ] || image+=(--set "image.digest=$CAPM_IMAGE_DIGEST")
# The chart as clusterctl's variables fill it: `${VAR}`s where users give values.
render() {
  "$helm" template capm "$root/charts/cluster-api-provider-mailgun" --skip-tests \
    --namespace "$namespace" \
    --set fullnameOverride=capm-controller-manager \
    --set 'mail.recipient=${MAIL_RECIPIENT}' \
    --set mail.backend=mailgun \
    --set 'mail.mailgun.domain=${MAILGUN_DOMAIN}' \
    --set mail.mailgun.region=us \
    --set mail.mailgun.apiKeySecret.name=capm-mailgun-api-key \
    --set webhook.certManager.enabled=true \
    --set crds.keep=false \
    ${image[@]+"${image[@]}"} "$@"
}
render | python3 "$root/hack/clusterctl_components.py" "$namespace" > "$out/infrastructure-components.yaml"
# The page apart: the same chart with fulfilment.separateDeployment, only the page's objects kept.
render --set fulfilment.url=https://fulfilment-url.invalid \
  --set fulfilment.keysSecret.name=capm-fulfilment-keys \
  --set fulfilment.separateDeployment=true \
  | python3 "$root/hack/clusterctl_page_components.py" "$namespace" capm-controller-manager-fulfilment \
  > "$out/fulfilment-page-components.yaml"
cp "$root/metadata.yaml" "$out/metadata.yaml"
cp "$root/config/clusterctl/cluster-template.yaml" "$out/cluster-template.yaml"
cp "$root/config/clusterctl/cluster-template-clusterclass.yaml" "$out/cluster-template-clusterclass.yaml"
"$root/hack/check-clusterclass.sh" "$root/config/clusterctl/clusterclass-mailgun.yaml" >/dev/null
cp "$root/config/clusterctl/clusterclass-mailgun.yaml" "$out/clusterclass-mailgun.yaml"
echo "wrote $out/infrastructure-components.yaml, fulfilment-page-components.yaml, metadata.yaml, cluster-template.yaml, cluster-template-clusterclass.yaml, clusterclass-mailgun.yaml"
