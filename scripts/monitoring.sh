#!/usr/bin/env bash
# Local monitoring stack: Prometheus scraping a running Fairway cluster with deploy/prometheus/.
#
#   scripts/monitoring.sh [start]   get Prometheus if needed, start it on :9090 (idempotent)
#   scripts/monitoring.sh stop      stop it (data stays in out/monitoring/prometheus-data)
#   scripts/monitoring.sh status    running or not, and the targets Prometheus sees
#   scripts/monitoring.sh install   only fetch the binaries; prints the prometheus path
#
# No root needed: Debian's `prometheus` package (2.42, with promtool) is fetched with
# `apt-get download` and unpacked with `dpkg-deb -x` into .tools/prometheus/ (cached).
# Environment:
#   PROMETHEUS_BIN       use this prometheus binary instead (promtool looked up next to it)
#   FAIRWAY_TARGETS_URL  http_sd URL (default http://127.0.0.1:8000/metrics/targets: the ingress)
#   RAY_SD_FILE          Ray's file_sd file (default /tmp/ray/prom_metrics_service_discovery.json)
#   PROM_LISTEN          listen address (default 127.0.0.1:9090)
#   PROM_RETENTION       TSDB retention (default 7d)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TOOLS="$ROOT/.tools/prometheus"
RUN="$ROOT/out/monitoring"
PIDFILE="$RUN/prometheus.pid"
LISTEN="${PROM_LISTEN:-127.0.0.1:9090}"
TARGETS_URL="${FAIRWAY_TARGETS_URL:-http://127.0.0.1:8000/metrics/targets}"
RAY_SD="${RAY_SD_FILE:-/tmp/ray/prom_metrics_service_discovery.json}"

install_prometheus() {
  if [ -n "${PROMETHEUS_BIN:-}" ]; then
    echo "$PROMETHEUS_BIN"
    return
  fi
  if [ ! -x "$TOOLS/usr/bin/prometheus" ]; then
    local dl
    dl="$(mktemp -d)"
    echo "fetching Debian's prometheus package (apt-get download) ..." >&2
    if ! (cd "$dl" && apt-get download -q prometheus >&2); then
      echo "apt-get download failed; refreshing the package lists (apt-get update) and retrying" >&2
      apt-get update -qq >&2 || true
      (cd "$dl" && apt-get download -q prometheus >&2)
    fi
    mkdir -p "$TOOLS"
    dpkg-deb -x "$dl"/prometheus_*.deb "$TOOLS"
    rm -rf "$dl"
  fi
  echo "$TOOLS/usr/bin/prometheus"
}

running_pid() {
  if [ -f "$PIDFILE" ]; then
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
      echo "$pid"
      return 0
    fi
  fi
  return 1
}

start() {
  local bin pid
  if pid="$(running_pid)"; then
    echo "prometheus already running (pid $pid) at http://$LISTEN"
    return
  fi
  bin="$(install_prometheus)"
  mkdir -p "$RUN/prometheus-data"
  # the committed config, with this run's service-discovery locations
  sed -e "s#http://127.0.0.1:8000/metrics/targets#$TARGETS_URL#" \
      -e "s#/tmp/ray/prom_metrics_service_discovery.json#$RAY_SD#" \
      deploy/prometheus/prometheus.yml > "$RUN/prometheus.yml"
  nohup "$bin" \
    --config.file="$RUN/prometheus.yml" \
    --storage.tsdb.path="$RUN/prometheus-data" \
    --storage.tsdb.retention.time="${PROM_RETENTION:-7d}" \
    --web.listen-address="$LISTEN" \
    --web.enable-lifecycle \
    > "$RUN/prometheus.log" 2>&1 &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 60); do
    if curl -fsS "http://$LISTEN/-/ready" >/dev/null 2>&1; then
      echo "prometheus $("$bin" --version 2>&1 | head -1 | awk '{print $3}') running (pid $(cat "$PIDFILE")) at http://$LISTEN"
      echo "  config: $RUN/prometheus.yml  data: $RUN/prometheus-data  log: $RUN/prometheus.log"
      echo "  targets from: $TARGETS_URL (+ Ray: $RAY_SD)"
      return
    fi
    if ! running_pid >/dev/null; then
      echo "prometheus exited; see $RUN/prometheus.log:" >&2
      tail -20 "$RUN/prometheus.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "prometheus did not become ready in 30 s; see $RUN/prometheus.log" >&2
  exit 1
}

stop() {
  local pid
  if pid="$(running_pid)"; then
    kill "$pid"
    for _ in $(seq 1 40); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.25
    done
    echo "prometheus (pid $pid) stopped"
  else
    echo "prometheus not running"
  fi
  rm -f "$PIDFILE"
}

status() {
  local pid
  if pid="$(running_pid)"; then
    echo "prometheus running (pid $pid) at http://$LISTEN"
    curl -fsS "http://$LISTEN/api/v1/targets?state=active" | python3 -c '
import json, sys
for t in json.load(sys.stdin)["data"]["activeTargets"]:
    print("  %s: %s %s %s" % (t["labels"].get("job"), t["scrapeUrl"], t["health"], t.get("lastError", "")))'
  else
    echo "prometheus not running"
    return 1
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  install)
    bin="$(install_prometheus)"
    echo "$bin"
    echo "$(dirname "$bin")/promtool"
    ;;
  *)
    echo "usage: $0 [start|stop|status|install]" >&2
    exit 2
    ;;
esac
