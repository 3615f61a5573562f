#!/usr/bin/env bash
# Validates the deployment files without a Docker engine (CTest: deploy_config_check, label deploy).
#
#   tests/deploy/check_deploy.sh [--build-dir DIR] [--server PATH/vlmgraph-server]
#     DIR: scratch space (default: a temp dir); PATH: a built server, to validate deploy/config*.yaml
#
# Checks, each printed as ok / FAIL / skip:
#   compose      `docker-compose config -q` parses compose.yaml (Debian's docker-compose 1.29), for
#                the default config and VLMGRAPH_CONFIG=config-throughput.yaml
#   prometheus   `promtool check config deploy/prometheus.yml`
#   dashboard    deploy/grafana/dashboards/vlmgraph.json parses, queries only metrics of
#                docs/metrics.md with valid PromQL (promtool) and the provisioned data source
#                (check_dashboard_metrics.py), and that checker catches broken dashboards
#   wiring       compose.yaml, the server configs, prometheus.yml, Grafana provisioning and the
#                Dockerfile agree on ports, paths and service names (check_wiring.py), and the
#                Dockerfile runs scripts/install-deps.sh, the script .ci/run runs
#   configs      `vlmgraph-server --config deploy/config*.yaml --print-config` accepts each config
#                (the server's own parser and validator; skipped without --server or a binary)
#   secrets      the API-keys file in compose's and Kubernetes' layouts is readable by the
#                container's uid/gid 10001 and the old 0600 layout is not; the server serves with
#                it (test_secret_layout.py; needs root and setpriv, else skipped)
#   health probe the container's HEALTHCHECK binary builds and tells SERVING from NOT_SERVING
#                against a real grpc.health.v1 server (test_health_probe.py)
# The live half, every dashboard metric present in a scrape of the running server, is run by the
# end-to-end tests: check_dashboard_metrics.py DASHBOARD http://127.0.0.1:PORT/metrics.
#
# Exit status: 0 all passed; 1 a check failed; 77 (CTest: skipped) nothing failed but a tool was
# missing (docker-compose and promtool are installed on Debian by scripts/install-deps.sh). Under
# CI (CI=true) a missing tool is a failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}

scratch="" server=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) scratch=${2:?--build-dir needs a folder}; shift 2 ;;
    --server) server=${2:?--server needs a path}; shift 2 ;;
    *) echo "usage: $0 [--build-dir DIR] [--server PATH]" >&2; exit 2 ;;
  esac
done
if [ -n "$scratch" ]; then
  mkdir -p "$scratch"
else
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
fi

passed=0 failed=0 skipped=0
ok()   { echo "ok   $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
skip() {
  if [ "${CI:-}" = true ]; then
    fail "$1 (missing under CI: run scripts/install-deps.sh)"
  else
    echo "skip $1"; skipped=$((skipped + 1))
  fi
}
# run NAME CMD...: runs CMD, records ok or FAIL; prints CMD's output (indented) when it failed or
# when VERBOSE=1.
run() {
  local name=$1; shift
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ $rc = 0 ]; then ok "$name"; else fail "$name (exit $rc)"; fi
  if [ -n "$out" ] && { [ $rc != 0 ] || [ "${VERBOSE:-0}" = 1 ]; }; then
    printf '%s\n' "$out" | sed 's/^/     /'
  fi
  return 0
}

# --- compose ----------------------------------------------------------------------------------------
if command -v docker-compose >/dev/null; then
  run "compose: docker-compose config -q (deploy/config.yaml)" \
    env -u VLMGRAPH_CONFIG -u VLMGRAPH_MODEL_DIR docker-compose -f compose.yaml config -q
  run "compose: docker-compose config -q (VLMGRAPH_CONFIG=config-throughput.yaml)" \
    env VLMGRAPH_CONFIG=config-throughput.yaml docker-compose -f compose.yaml config -q
else
  skip "compose: docker-compose not installed"
fi

# --- prometheus -------------------------------------------------------------------------------------
promtool=$(command -v promtool || true)
if [ -n "$promtool" ]; then
  run "prometheus: promtool check config deploy/prometheus.yml" \
    "$promtool" check config deploy/prometheus.yml
else
  skip "prometheus: promtool not installed"
fi

# --- dashboard --------------------------------------------------------------------------------------
dash_args=(deploy/grafana/dashboards/vlmgraph.json --metrics-doc docs/metrics.md
           --datasources deploy/grafana/provisioning/datasources/prometheus.yml)
[ -n "$promtool" ] && dash_args+=(--promtool "$promtool")
run "dashboard: JSON, metric names (docs/metrics.md), PromQL, data source" \
  "$PY" tests/deploy/check_dashboard_metrics.py "${dash_args[@]}"
[ -z "$promtool" ] && skip "dashboard: PromQL parse (promtool not installed)"
run "dashboard: the checker rejects broken dashboards" \
  "$PY" tests/deploy/test_check_dashboard_metrics.py ${promtool:+"$promtool"}

# --- wiring -----------------------------------------------------------------------------------------
run "wiring: compose, configs, prometheus, grafana, Dockerfile, .ci/run agree" \
  "$PY" tests/deploy/check_wiring.py --root "$ROOT"
run "wiring: the checker rejects broken wiring" "$PY" tests/deploy/test_check_wiring.py

# --- configs ----------------------------------------------------------------------------------------
if [ -n "$server" ] && [ -x "$server" ]; then
  for cfg in deploy/config*.yaml; do
    # A model the image converts at build time (/opt/vlmgraph/models/...) is not here: the config
    # is checked with the built-in preset in its place (the Dockerfile's runtime stage checks it
    # with the model; check_wiring.py checks that the Dockerfile makes it).
    model=$(sed -n 's/^model: *\([^ #]*\).*/\1/p' "$cfg")
    extra=()
    case "$model" in /opt/vlmgraph/models/*) [ -d "$model" ] || extra=(--set model=nanovlm-tiny) ;; esac
    run "configs: vlmgraph-server --config $cfg --print-config${extra:+ (model: preset in place of $model)}" \
      "$server" --config "$cfg" "${extra[@]}" --print-config
  done
  # The API-keys secret as compose and Kubernetes mount it, read as the container's uid 10001.
  "$PY" tests/deploy/test_secret_layout.py "$server" >"$scratch/secret_layout.log" 2>&1
  case $? in
    0) ok "secrets: compose and k8s layouts readable by uid 10001, the server takes the keys" ;;
    # Not a missing tool: a build without root privileges. Said, not counted as a skip.
    77) echo "skip secrets: $(tail -1 "$scratch/secret_layout.log")" ;;
    *) fail "secrets: compose and k8s layouts (tests/deploy/test_secret_layout.py)"; sed 's/^/     /' "$scratch/secret_layout.log" ;;
  esac
else
  echo "skip configs: no server binary (${server:-not given}); deploy/config*.yaml not validated by the server"
  skipped=$((skipped + 1))
fi

# --- health probe -----------------------------------------------------------------------------------
if command -v g++ >/dev/null && pkg-config --exists grpc++ 2>/dev/null; then
  probe="$scratch/grpc_health_probe"
  # The Dockerfile's compile line, verbatim.
  if out=$(g++ -std=c++17 -O2 -o "$probe" tests/deploy/grpc_health_probe.cc \
             $(pkg-config --cflags --libs grpc++) 2>&1); then
    ok "health probe: builds like the Dockerfile builds it"
    if "$PY" -c 'import grpc_health.v1.health' 2>/dev/null; then
      run "health probe: SERVING / NOT_SERVING / unknown service / no server" \
        "$PY" tests/deploy/test_health_probe.py "$probe"
    else
      skip "health probe: Python grpcio-health-checking not installed"
    fi
  else
    fail "health probe: does not build"; printf '%s\n' "$out" | sed 's/^/     /'
  fi
else
  skip "health probe: g++ or grpc++ (pkg-config) missing"
fi

echo "check_deploy: $passed passed, $failed failed, $skipped skipped"
if [ "$failed" -gt 0 ]; then exit 1; fi
if [ "$skipped" -gt 0 ]; then exit 77; fi
exit 0
