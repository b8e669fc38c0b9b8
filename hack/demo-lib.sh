# What hack/demo.sh and hack/demo-pods.sh share (sourced, not run): progress lines, a work
# directory whose control plane and processes are stopped and removed at exit (also on failure),
# free ports, and waiting with a deadline. The sourcing script sets `capm_env` and defines `die`.

started=$SECONDS
say() { printf '\n\033[1m==> [%dm%02ds] %s\033[0m\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

# Creates the work directory ($work, the control plane's state in $state) and arranges the
# cleanup. Processes started later are added to `pids`; a FIFO file descriptor the script holds
# open (a server's stdin) is named in `input_fd`.
start_work() { # name
  work=$(mktemp -d -t "capm-$1-XXXXXX")
  state="$work/control-plane"
  pids=()
  input_fd=""
  trap cleanup EXIT
}

cleanup() {
  set +e
  # The managers first, while the API server they talk to is still up: they stop in moments
  # instead of retrying an absent server until their shutdown timeouts.
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  "$capm_env" down --dir "$state" >/dev/null 2>&1
  [ -z "$input_fd" ] || eval "exec $input_fd>&-" 2>/dev/null
  rm -rf "$work"
}

# The Cluster API core manager on the host, against $KUBECONFIG, with a throw-away webhook
# certificate; its log is $work/capi-manager.log.
start_capi_manager() {
  mkdir -p "$work/capi-certs"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 -subj /CN=localhost \
    -keyout "$work/capi-certs/tls.key" -out "$work/capi-certs/tls.crt" 2>/dev/null
  bin/capi-manager --kubeconfig "$KUBECONFIG" --leader-elect=false \
    --webhook-port "$(free_port)" --webhook-cert-dir "$work/capi-certs" \
    --health-addr "127.0.0.1:$(free_port)" --diagnostics-address "127.0.0.1:$(free_port)" --insecure-diagnostics \
    > "$work/capi-manager.log" 2>&1 &
  pids+=($!)
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for() { # seconds, description, command...
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "timed out waiting for $what"
    sleep 0.5
  done
}
