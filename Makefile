# cluster-api-provider-mailgun task runner. `make` lists the targets.
SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
CARGO ?= cargo
PYTHON ?= python3
CARGO_DENY_VERSION := 0.20.2
CARGO_CYCLONEDX_VERSION := 0.5.9
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CAPM_ENV := $(CARGO) run -q -p capm-test-support --bin capm-env --

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

PIP_INSTALL := $(PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore

.PHONY: deps-demo
deps-demo: ## Install only what the demo needs (the SMTP server's Python packages)
	$(PIP_INSTALL) -r tests/mail-servers/requirements.txt

.PHONY: deps
deps: deps-demo deps-node deps-release deps-browser ## Install what the tests need too (deps-node, deps-release, deps-browser, Debian's Prometheus, cargo-deny)
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  echo "installing Debian's prometheus (prometheus + promtool for the end-to-end tests)"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; fi
	@if ! $(CARGO) deny --version >/dev/null 2>&1; then \
	  echo "installing cargo-deny $(CARGO_DENY_VERSION) from crates.io (make deny)"; \
	  $(CARGO) install --locked cargo-deny --version $(CARGO_DENY_VERSION); fi

.PHONY: deps-browser
deps-browser: ## Install Debian's chromium, nginx-light and Playwright for Python (the fulfilment page's browser tests, one behind a reverse proxy; Playwright's own browsers are not downloaded)
	$(PIP_INSTALL) -r tests/e2e/browser/requirements.txt
	@if ! command -v chromium >/dev/null || ! test -x /usr/sbin/nginx; then \
	  echo "installing Debian's chromium and nginx-light (the fulfilment page's browser tests)"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium nginx-light; fi

# runc (built by `make tools`) links libseccomp through cgo; the node needs ip and iptables; the
# churn test asks the provider's allocator, through gdb, to give back its free memory before it
# measures the heap.
.PHONY: deps-node
deps-node: ## Install Debian's libseccomp-dev, pkg-config, iproute2, iptables, gdb (runc with seccomp; the local node's bridge and Service route; the churn test's heap)
	@missing=$$(for p in libseccomp-dev pkg-config iproute2 iptables gdb; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	  echo "installing Debian's $$missing (runc with seccomp; the local node's bridge and Service route; gdb for the churn test)"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi

.PHONY: deps-py
deps-py: ## Install the release scripts' Python packages (PyYAML)
	$(PIP_INSTALL) -r hack/requirements.txt

.PHONY: deps-release
deps-release: deps-py ## Install what `make release` needs: deps-py, cargo-cyclonedx (the SBOM)
	@if ! $(CARGO) cyclonedx --version >/dev/null 2>&1; then \
	  echo "installing cargo-cyclonedx $(CARGO_CYCLONEDX_VERSION) from crates.io (the release's SBOM)"; \
	  $(CARGO) install --locked cargo-cyclonedx --version $(CARGO_CYCLONEDX_VERSION); fi

.PHONY: tools
tools: deps-node ## Build the Go tools (control plane, kubectl, helm, Cluster API; the node: kubelet, kube-scheduler, containerd, runc, CNI plugins, pause; the release: registry, crane, cosign; the monitoring test: kube-state-metrics; cert-manager from its source snapshot), cached by go.sum (or snapshot) hash
	hack/tools/build.sh

# The demo needs no node: without runc (cgo, libseccomp-dev from `make deps`) and containerd it
# builds minutes sooner and needs no Debian package on a fresh machine.
.PHONY: tools-demo
tools-demo: ## Build only the Go tools the demo uses (control plane, kubectl, helm, Cluster API)
	hack/tools/build.sh kubernetes etcd helm cluster-api

.PHONY: build
build: ## Build every crate and test
	$(CARGO) build --workspace --all-targets

.PHONY: fmt
fmt: ## Format the code
	$(CARGO) fmt --all

.PHONY: lint
lint: ## cargo fmt --check, clippy and rustdoc with warnings denied, controllers/src imports in its declared layer order and its lines outside tests (no file over 450; the total printed against 5 600)
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace -q
	$(PYTHON) hack/module-cycles.py controllers/src
	$(PYTHON) hack/line-budget.py controllers/src 5600 450

.PHONY: unit
unit: ## The logic alone, fast: every crate's unit tests (no root, no Go tools, no control plane; the few unit tests that need one are ignored here, `make test` runs them)
	$(CARGO) test --workspace --lib --bins

.PHONY: deny
deny: ## Licences (permissive only), bans and sources (crates.io only) of dependencies, by deny.toml
	$(CARGO) deny check --hide-inclusion-graph licenses bans sources

CHART := charts/cluster-api-provider-mailgun
CRD_DIRS := config/crd $(CHART)/files/crds

.PHONY: generate
generate: tools-helm ## Regenerate committed files: CRD YAML (config/, the chart) from the Rust types, config/rbac and the monitoring files (config/metrics, prometheus, grafana) from the chart
	@for dir in $(CRD_DIRS); do $(CARGO) run -q -p capm-api --bin crdgen -- $$dir; done
	hack/render-rbac.sh > config/rbac/rbac.yaml
	hack/render-observability.sh config

.PHONY: verify-generated
verify-generated: tools-helm ## Fail when committed generated files are stale
	@for dir in $(CRD_DIRS); do $(CARGO) run -q -p capm-api --bin crdgen -- --check $$dir; done
	@hack/render-rbac.sh | diff -u config/rbac/rbac.yaml - \
	  || { echo "config/rbac/rbac.yaml is stale: run make generate" >&2; exit 1; }
	@echo "config/rbac/rbac.yaml is up to date"
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && hack/render-observability.sh "$$tmp" \
	  && for f in metrics/crd-metrics-config.yaml metrics/kube-state-metrics.yaml metrics/kube-state-metrics-chart-values.yaml prometheus/rules.yaml grafana/cluster-api-provider-mailgun.json; do \
	    diff -u config/$$f "$$tmp/$$f" || { echo "config/$$f is stale: run make generate" >&2; exit 1; }; done
	@echo "config/metrics, config/prometheus/rules.yaml and config/grafana are up to date"

# The soak plan `make test` replays (20 rounds): a seed validated on the current code, so CI
# checks a known plan. `make soak` draws a new seed each run (the exploring side); a seed that
# finds a violation there is fixed and may become this one.
TEST_SOAK_SEED ?= 4

.PHONY: lint-clusterctl
lint-clusterctl: ## Check the ClusterClass files against clusterctl's contract (no ${VAR}, no namespace:, variables and patches)
	hack/check-clusterclass.sh

.PHONY: test
test: deps tools lint lint-clusterctl deny verify-generated ## Everything CI runs: checks, unit and integration tests on the local control plane
	$(CARGO) build -q -p capm-mail-servers --bin mailgun-contract-server -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun $(FAILPOINTS)
	CAPM_MAILGUN_SERVER_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/debug/mailgun-contract-server \
	  SOAK_SEED=$${SOAK_SEED:-$(TEST_SOAK_SEED)} $(CARGO) test --workspace --no-fail-fast -- --include-ignored

ROUNDS ?= 20
# The tests' provider binary carries the failpoints (crash or freeze at a chosen step: the
# exactly-once tests, the soak's freezes mid-send). `cargo test --workspace` builds it so through
# cmd's dev-dependencies; a plain build of the binary must ask for them, or it would replace the
# test build with one whose failpoints do nothing.
FAILPOINTS := --features capm-controllers/failpoints
# The Go peer `make bench` compares the provider with (the Cluster API book's controller): a
# checkout of it, not part of this repository, given as PEER_DIR=<path>.
PEER_DIR ?=
SEED ?=

.PHONY: soak
soak: deps-demo tools ## The adversarial soak test alone: ROUNDS=200 for a long run (default 20), SEED=<n> replays a run
	$(CARGO) build -q -p capm-mail-servers --bin mailgun-contract-server -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun $(FAILPOINTS)
	CAPM_MAILGUN_SERVER_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/debug/mailgun-contract-server \
	  SOAK_ROUNDS=$(ROUNDS) SOAK_SEED=$(SEED) $(CARGO) test -p capm-e2e --test soak -- --nocapture

.PHONY: bench
bench: tools ## Backlog benchmark (not a test): the Go peer (PEER_DIR=<checkout>; 1 and 10 workers) and the provider on N=1000 pairs each, one control plane, with ratios
	@[ -n "$(PEER_DIR)" ] || { echo "make bench needs PEER_DIR=<a checkout of the Go peer>" >&2; exit 1; }
	$(CARGO) build --release -p cluster-api-provider-mailgun -p capm-bench -p capm-mail-servers
	T=$${CARGO_TARGET_DIR:-$(CURDIR)/target}; \
	  PEER=$$(hack/build-peer.sh $(PEER_DIR)); \
	  CAPM_MAILGUN_SERVER_BIN=$$T/release/mailgun-contract-server $$T/release/capm-bench \
	  --provider $$T/release/cluster-api-provider-mailgun --peer $$PEER \
	  --peer-crd $(PEER_DIR)/config/crd.yaml --objects $${N:-1000} $(BENCH_ARGS)

.PHONY: bench-partition
bench-partition: deps-demo tools ## Recovery from a partition, timed (not a test): 10 cycles of connections closed for 10 s, 2 of dropped packets, figures printed (`make test` runs 2 and 1 of them for the promise alone)
	$(CARGO) build -q -p capm-mail-servers --bin mailgun-contract-server -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun $(FAILPOINTS)
	CAPM_MAILGUN_SERVER_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/debug/mailgun-contract-server \
	  PARTITION_CLOSING_CYCLES=$${PARTITION_CLOSING_CYCLES:-10} PARTITION_DROPPING_CYCLES=$${PARTITION_DROPPING_CYCLES:-2} \
	  $(CARGO) test -p capm-e2e --test partition recovery_from -- --include-ignored --nocapture

.PHONY: bench-mailer
bench-mailer: ## Mail backend throughput (not a test): Mailgun with 16 senders, SMTP pooled vs per message
	$(CARGO) build --release -p capm-mail-servers --bin mailgun-contract-server
	CAPM_MAILGUN_SERVER_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/release/mailgun-contract-server $(CARGO) run --release -p capm-mailer --example bench

.PHONY: chart-lint
chart-lint: tools-helm ## helm lint the chart with its defaults and with each of its ci/*-values.yaml
	bin/helm lint --strict $(CHART)
	@for values in $(CHART)/ci/*-values.yaml; do bin/helm lint --strict $(CHART) -f $$values; done

.PHONY: release-manifests
release-manifests: deps-py tools-helm ## Render the clusterctl assets (infrastructure-components.yaml, metadata.yaml, cluster-template*.yaml, clusterclass-mailgun.yaml) into out/
	hack/release-manifests.sh out

.PHONY: tools-helm
tools-helm: ## Build only Helm (what chart-lint, release-manifests and the generated-file checks use)
	hack/tools/build.sh helm

VERSION ?=
REGISTRY ?=
COSIGN_KEY ?=

.PHONY: release
release: deps-release ## VERSION=x.y.z REGISTRY=host/path [COSIGN_KEY=cosign.key]: push the image (by digest) and the chart (OCI), write out/ (clusterctl assets, SBOM, SHA256SUMS, signatures)
	hack/tools/build.sh helm crane cosign
	VERSION=$(VERSION) REGISTRY=$(REGISTRY) COSIGN_KEY=$(COSIGN_KEY) hack/release.sh

.PHONY: up
up: tools ## Start a detached local control plane (with the Cluster API CRDs); `eval $$(make -s env)` to use it
	$(CAPM_ENV) up --capi-crds

.PHONY: env
env: ## Print the exports for the detached control plane
	@$(CAPM_ENV) env

.PHONY: down
down: ## Stop the detached control plane and remove its state
	$(CAPM_ENV) down

IMAGE ?= capm.local/cluster-api-provider-mailgun:dev

.PHONY: screenshots
screenshots: tools ## Refresh docs/fulfilment/*.png: the fulfilment page's browser test, its screenshots written there (CAPM_SCREENSHOTS=docs)
	CAPM_SCREENSHOTS=docs $(CARGO) test -p capm-e2e --test fulfilment -- --include-ignored

.PHONY: image
image: ## Build the provider's image (release binary, glibc, CA certificates, user 65532) as an OCI archive: out/provider.oci.tar
	$(CARGO) build --release -p cluster-api-provider-mailgun --bin cluster-api-provider-mailgun
	mkdir -p out
	$(CARGO) run -q -p capm-test-support --bin capm-image -- provider \
	  --binary $${CARGO_TARGET_DIR:-$(CURDIR)/target}/release/cluster-api-provider-mailgun --name $(IMAGE) -o out/provider.oci.tar

.PHONY: demo
demo: deps-demo tools-demo ## The demo: local control plane, provider, a sample Cluster, a mail received
	hack/demo.sh

.PHONY: demo-pods
demo-pods: deps tools ## The demo with real Pods (root): a node, the project's image, helm install (2 replicas), a mail received
	hack/demo-pods.sh
