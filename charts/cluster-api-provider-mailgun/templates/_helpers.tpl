{{/* Names: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "capm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "capm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. `cluster.x-k8s.io/provider` is what clusterctl uses to find a provider's objects. */}}
{{- define "capm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "capm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cluster-api
cluster.x-k8s.io/provider: infrastructure-mailgun
{{- end }}

{{- define "capm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "capm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "capm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "capm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "capm.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "capm.webhookServiceName" -}}
{{- printf "%s-webhook" (include "capm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "capm.webhookSecretName" -}}
{{- if .Values.webhook.certSecret }}
{{- .Values.webhook.certSecret }}
{{- else }}
{{- printf "%s-webhook-cert" (include "capm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The CA bundle (base64) the CRDs' conversion webhook and the webhook configuration carry: the
user's (webhook.caBundle), the chart's self-signed CA, or empty with cert-manager (its cainjector
fills it in).
*/}}
{{- define "capm.webhookCABundle" -}}
{{- if .Values.webhook.caBundle }}
{{- .Values.webhook.caBundle | b64enc }}
{{- else if not .Values.webhook.certManager.enabled }}
{{- (include "capm.selfSignedCert" . | fromJson).caCert | b64enc }}
{{- end }}
{{- end }}

{{/*
The Lease: the binary's default name (cluster-api-provider-mailgun-leader), whatever the release is
called, so that the provider installed twice into one namespace (Helm and clusterctl, two Helm
releases) elects one leader; per shard, the shard's watchFilter is in its name.
leaderElection.id overrides it (e.g. 0.1's <fullname>-leader during an upgrade: docs/operations.md).
*/}}
{{- define "capm.leaderElectionID" -}}
{{- if .Values.leaderElection.id }}
{{- .Values.leaderElection.id }}
{{- else if .Values.watchFilter }}
{{- printf "cluster-api-provider-mailgun-%s-leader" (.Values.watchFilter | lower | replace "_" "-" | replace "." "-") | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- print "cluster-api-provider-mailgun-leader" }}
{{- end }}
{{- end }}

{{/*
The self-signed webhook CA and serving certificate, generated once per render and shared by the
Secret and the CRDs' caBundle (they are in different templates). An existing Secret is reused so
that `helm upgrade` does not rotate the certificate. Returns a dict: caCert, tlsCert, tlsKey.
*/}}
{{- define "capm.metricsServiceName" -}}
{{ include "capm.fullname" . }}-metrics
{{- end }}

{{/*
The PromQL matchers that select the provider's own series (metrics.prometheusRule.selector):
by default the job and namespace the chart's ServiceMonitor and PodMonitor give them.
*/}}
{{- define "capm.metricsSelector" -}}
{{- if .Values.metrics.prometheusRule.selector -}}
{{ .Values.metrics.prometheusRule.selector }}
{{- else -}}
job="{{ include "capm.metricsServiceName" . }}", namespace="{{ .Release.Namespace }}"
{{- end }}
{{- end }}

{{/*
Where the metrics endpoint's certificate and its CA come from: metrics.certSecret, else the
chart's own (the webhook's Secret, whose certificate also names the metrics Service).
*/}}
{{- define "capm.metricsCertSecretName" -}}
{{- default (include "capm.webhookSecretName" .) .Values.metrics.certSecret }}
{{- end }}

{{- define "capm.selfSignedCert" -}}
{{- if not (hasKey .Values "__capmWebhookCert") }}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "capm.webhookSecretName" .) }}
{{- $svc := include "capm.webhookServiceName" . }}
{{- if and $secret $secret.data (hasKey $secret.data "ca.crt") (hasKey $secret.data "tls.crt") (hasKey $secret.data "tls.key") }}
{{- $_ := set .Values "__capmWebhookCert" (dict "caCert" (index $secret.data "ca.crt" | b64dec) "tlsCert" (index $secret.data "tls.crt" | b64dec) "tlsKey" (index $secret.data "tls.key" | b64dec)) }}
{{- else }}
{{- $days := int .Values.webhook.selfSignedValidityDays }}
{{- $ca := genCA (printf "%s-ca" $svc) $days }}
{{- $dns := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) }}
{{- /* The same certificate serves the metrics Service unless metrics.certSecret is set. */}}
{{- $metricsSvc := include "capm.metricsServiceName" . }}
{{- $dns = concat $dns (list (printf "%s.%s.svc" $metricsSvc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $metricsSvc .Release.Namespace)) }}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc .Release.Namespace) nil $dns $days $ca }}
{{- $_ := set .Values "__capmWebhookCert" (dict "caCert" $ca.Cert "tlsCert" $cert.Cert "tlsKey" $cert.Key) }}
{{- end }}
{{- end }}
{{- toJson (get .Values "__capmWebhookCert") }}
{{- end }}

{{/*
Values that must be set, checked together so one failed install names every missing one.
values.schema.json checks types and shapes; this checks what depends on other values (the backend,
an SMTP user name). Under `helm lint` Helm reports a `fail` instead of failing, so the chart lints
clean with its defaults while `helm install` and `helm template` refuse them.
*/}}
{{- define "capm.validateValues" -}}
{{- $mail := .Values.mail -}}
{{- $missing := list -}}
{{- if not $mail.recipient -}}
{{- $missing = append $missing "mail.recipient: who receives the request mails" -}}
{{- end -}}
{{- if eq $mail.backend "mailgun" -}}
{{- if not $mail.mailgun.domain -}}
{{- $missing = append $missing "mail.mailgun.domain: the Mailgun sending domain (backend mailgun)" -}}
{{- end -}}
{{- if not $mail.mailgun.apiKeySecret.name -}}
{{- $missing = append $missing "mail.mailgun.apiKeySecret.name: an existing Secret holding the API key (backend mailgun)" -}}
{{- end -}}
{{- else if eq $mail.backend "smtp" -}}
{{- if not $mail.smtp.url -}}
{{- $missing = append $missing "mail.smtp.url: smtp://host[:port] or smtps://host[:port] (backend smtp)" -}}
{{- end -}}
{{- if not $mail.from -}}
{{- $missing = append $missing "mail.from: the sender, an address on the domain the relay sends for (backend smtp; DMARC)" -}}
{{- end -}}
{{- if and $mail.smtp.username (not $mail.smtp.passwordSecret.name) -}}
{{- $missing = append $missing "mail.smtp.passwordSecret.name: an existing Secret holding the password (mail.smtp.username is set)" -}}
{{- end -}}
{{- end -}}
{{- $webhook := .Values.webhook -}}
{{- if and $webhook.caBundle (not $webhook.certSecret) -}}
{{- $missing = append $missing "webhook.certSecret: the Secret with the serving certificate webhook.caBundle signed" -}}
{{- end -}}
{{- if and $webhook.certSecret (not $webhook.caBundle) -}}
{{- $missing = append $missing "webhook.caBundle: the CA that signed webhook.certSecret's certificate" -}}
{{- end -}}
{{- if and $webhook.caBundle $webhook.certManager.enabled -}}
{{- $missing = append $missing "webhook.caBundle with webhook.certManager.enabled: choose one (cert-manager injects its own CA)" -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "missing required values:\n  - %s" (join "\n  - " $missing)) -}}
{{- end -}}
{{- end -}}

{{/*
One scrape endpoint of the ServiceMonitor or the PodMonitor: HTTPS with the scraper's token,
verified against the CA, unless metrics.insecure.
*/}}
{{- define "capm.scrapeEndpoint" -}}
{{- $fullname := include "capm.fullname" . }}
{{- if .Values.metrics.insecure }}
scheme: http
{{- else }}
scheme: https
authorization:
  type: Bearer
  credentials:
    name: {{ $fullname }}-metrics-scraper-token
    key: token
tlsConfig:
  {{- with .Values.metrics.serviceMonitor.tlsConfig }}
  {{- toYaml . | nindent 2 }}
  {{- else }}
  # Verified against the CA of the certificate the provider serves (the chart's, or
  # metrics.certSecret's ca.crt), for the metrics Service's name.
  ca:
    secret:
      name: {{ include "capm.metricsCertSecretName" . }}
      key: ca.crt
  serverName: {{ include "capm.metricsServiceName" . }}.{{ .Release.Namespace }}.svc
  {{- end }}
{{- end }}
path: /metrics
interval: {{ .Values.metrics.serviceMonitor.interval }}
scrapeTimeout: {{ .Values.metrics.serviceMonitor.scrapeTimeout }}
{{- end }}

{{/*
The fulfilment page's own Deployment (fulfilment.separateDeployment): its name (also its
ServiceAccount's and its roles'), and labels whose `app.kubernetes.io/name` differs from the
provider's, so the provider Deployment's selector (immutable) never takes the page's Pods.
*/}}
{{- define "capm.page.fullname" -}}
{{- printf "%s-fulfilment" (include "capm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "capm.page.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-fulfilment" (include "capm.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: fulfilment-page
{{- end }}

{{- define "capm.page.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "capm.page.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cluster-api
cluster.x-k8s.io/provider: infrastructure-mailgun
{{- end }}

{{/* Whether the page runs in its own Deployment: the page configured and asked apart. */}}
{{- define "capm.page.separate" -}}
{{- if and .Values.fulfilment.url .Values.fulfilment.separateDeployment }}true{{ end }}
{{- end }}

{{/* The Pods that serve /fulfil/: the page's own, or the provider's. */}}
{{- define "capm.page.servingSelectorLabels" -}}
{{- if include "capm.page.separate" . }}
{{- include "capm.page.selectorLabels" . }}
{{- else }}
{{- include "capm.selectorLabels" . }}
{{- end }}
{{- end }}
