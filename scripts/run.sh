#!/usr/bin/env bash
# Main job: bring the Fairway cluster up (Ray Serve, 2 replicas of the H200-calibrated sim
# engine, Fairway routing and gating), drive a short load through its OpenAI-compatible API,
# and print the per-lane TTFT table. The cluster stays up afterwards for curl / the openai
# client; `scripts/run.sh stop` stops it.
#
#   scripts/run.sh                 # up + load + table (about 1.5 min on 2 cores)
#   scripts/run.sh up              # only bring the cluster up
#   scripts/run.sh stop            # stop it
#   FAIRWAY_CONFIG=deploy/cluster-vllm-cpu.yaml scripts/run.sh up   # another deployment
#
# Environment: FAIRWAY_CONFIG (deploy/cluster.yaml), FAIRWAY_PORT (8000), LOAD_WORKLOAD
# (mixed-spike), LOAD_RATE (6), LOAD_DURATION (30 s), FAIRWAY_API_KEY (the key the readiness
# probe and the load send when the config turns API keys on; default: the first key of the
# config's auth.keys_file or auth.keys_env).
source "$(dirname "$0")/_venv.sh"
CONFIG="${FAIRWAY_CONFIG:-deploy/cluster.yaml}"
# a vLLM deployment runs from the environment that has vLLM (scripts/vllm_cpu_setup.sh makes it)
if [ -x .venv-vllm/bin/serve ] && [[ " $(python -m cluster.launch engines "$CONFIG" 2>/dev/null) " == *" vllm "* ]]; then
  export PATH="$PWD/.venv-vllm/bin:$PATH"
fi
PORT="${FAIRWAY_PORT:-8000}"
URL="http://127.0.0.1:$PORT"
OUT=out/cluster
PIDFILE="$OUT/serve.pid"
mkdir -p "$OUT"

stop() {
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    pid="$(cat "$PIDFILE")"
    kill -INT "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    python -m cluster.launch stop-haproxy "$PORT"  # Ray's HAProxy can outlive serve run after a reload
    echo "cluster stopped"
  else
    echo "no cluster started by this script is running"
  fi
  rm -f "$PIDFILE"
}

# the key to send when the config turns API keys on (empty when it does not): FAIRWAY_API_KEY,
# else the first key the config names (its keys file's first line, or its environment variable's)
api_key() {
  if [ -n "${FAIRWAY_API_KEY:-}" ]; then echo "$FAIRWAY_API_KEY"; return; fi
  python - "$CONFIG" <<'PY'
import os, sys, yaml
from router.auth import parse_keys
auth = {}
for app in yaml.safe_load(open(sys.argv[1])).get("applications", []):
    auth = (app.get("args") or {}).get("auth") or auth
keys = {}
if auth.get("keys_file") and os.path.exists(auth["keys_file"]):
    keys = parse_keys(open(auth["keys_file"]).read(), " ")
if not keys and auth.get("keys_env") and os.environ.get(auth["keys_env"]):
    keys = parse_keys(os.environ[auth["keys_env"]], "=")
print(next(iter(keys), ""))
PY
}

ready() {
  python - "$URL" "$KEY" <<'PY'
import json, sys, urllib.request
auth = {"authorization": f"Bearer {sys.argv[2]}"} if sys.argv[2] else {}
models = urllib.request.Request(sys.argv[1] + "/v1/models", headers=auth)
req = urllib.request.Request(sys.argv[1] + "/v1/completions", headers={"content-type": "application/json", **auth},
                             data=json.dumps({"model": json.load(urllib.request.urlopen(models, timeout=5))["data"][0]["id"],
                                              "prompt": [20] * 40, "max_tokens": 2}).encode())
sys.exit(0 if json.load(urllib.request.urlopen(req, timeout=10))["usage"]["completion_tokens"] == 2 else 1)
PY
}

up() {
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "cluster already running (pid $(cat "$PIDFILE")) at $URL"
    return
  fi
  cfg="$OUT/cluster.yaml"
  python - "$CONFIG" "$PORT" "$cfg" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
cfg.setdefault("http_options", {})["port"] = int(sys.argv[2])
yaml.safe_dump(cfg, open(sys.argv[3], "w"))
PY
  # `serve run` logs an invalid config and keeps running, so it is checked here first
  if ! python -m cluster.launch check "$CONFIG"; then
    echo "invalid config $CONFIG: not started" >&2
    exit 1
  fi
  start=$(date +%s)
  # the settings the tests start clusters with (cluster/launch.py serve_env: a private local Ray
  # unless RAY_ADDRESS points at a cluster, Ray Serve's throughput-optimized mode, HAProxy as the
  # HTTP ingress; README, "Streaming"); any of them set in the environment wins. The values come
  # shell-quoted (one has a space), and exec keeps $! the server's pid.
  (set -a; eval "$(python -m cluster.launch env)"; exec setsid nohup serve run "$cfg" > "$OUT/serve.log" 2>&1) &
  echo $! > "$PIDFILE"
  echo "starting the cluster ($CONFIG), log: $OUT/serve.log"
  for _ in $(seq 1 180); do
    if ready 2>/dev/null; then
      # until Ray's HAProxy lists the ingress replica it sends every request through Serve's own
      # proxy (its fallback): "up" means the path that serves from then on is in place
      python -m cluster.launch wait-haproxy "$PORT"
      echo "cluster up at $URL after $(( $(date +%s) - start )) s"
      return
    fi
    if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      echo "serve run exited; last lines of $OUT/serve.log:" >&2
      tail -20 "$OUT/serve.log" >&2
      exit 1
    fi
    # replicas that fail to start: serve run only retries them, so say so once one failed twice
    if [ $(( $(date +%s) - start )) -ge 10 ] && [ $(( $(date +%s) % 5 )) -eq 0 ]; then
      fails="$(python -m cluster.launch replica-failures "$start" 2>/dev/null)"
      if [ "$(printf '%s\n' "$fails" | grep -c .)" -ge 2 ]; then
        echo "replicas fail to start (Ray Serve keeps retrying them):" >&2
        printf '%s\n' "$fails" | sort | uniq -c >&2
        echo "their logs: ${RAY_TMPDIR:-/tmp/ray}/session_latest/logs/serve/; stopping the cluster" >&2
        stop >&2
        exit 1
      fi
    fi
    sleep 1
  done
  echo "cluster not ready after 180 s; see $OUT/serve.log" >&2
  exit 1
}

KEY="$(api_key)"
export FAIRWAY_API_KEY="$KEY"

case "${1:-all}" in
  stop) stop ;;
  up) up ;;
  all)
    up
    python -m loadgen run --url "$URL" --workload "${LOAD_WORKLOAD:-mixed-spike}" --rate "${LOAD_RATE:-6}" \
      --duration "${LOAD_DURATION:-30}" --seed 0 --json "$OUT/loadgen.json" \
      ${KEY:+--api-key-env FAIRWAY_API_KEY}
    echo
    echo "results: $OUT/loadgen.json. The cluster is still up at $URL, e.g.:"
    echo "  curl $URL/v1/completions -H 'content-type: application/json' \\"
    echo "    -d '{\"model\": \"fairway-tiny\", \"prompt\": \"Hello\", \"max_tokens\": 8}'"
    echo "stop it with: scripts/run.sh stop"
    ;;
  *) echo "usage: scripts/run.sh [all|up|stop]" >&2; exit 2 ;;
esac
