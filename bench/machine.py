"""The machine's processes and ports: where our benchmark cluster listens, and checks that it is ours.

Other users of the machine start clusters too, and Serve's HTTP proxies bind with SO_REUSEPORT:
a second cluster on the same port silently takes part of the connections. So the benchmark
clusters listen on their own port (``FAIRWAY_BENCH_PORT``, default 8471, not the tests' 8000);
before starting one, ``cluster()`` (around ``cluster/launch.py:running_cluster``) waits until
nothing listens there, and once it answers checks that every listener is a descendant of our own
``serve run`` (else it stops ours and waits again). The Ray address a driver needs comes from our
``serve run``'s session folder (``/tmp/ray/session_*_<pid>/gcs_server_port_*``). Linux only (/proc).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PORT = int(os.environ.get("FAIRWAY_BENCH_PORT", "8471"))


# -- the machine's processes (Linux /proc) -------------------------------------------------------


def port_listening(port: int = PORT) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def is_descendant(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = _ppid(pid)
    return False


def listener_pids(port: int = PORT) -> set[int]:
    """Processes holding a listening TCP socket on ``port`` (IPv4 or IPv6)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    out: set[int] = set()
    if not inodes:
        return out
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    out.add(pid)
                    break
            except OSError:
                continue
    return out


def my_serve_pid() -> int | None:
    """Our child ``serve run`` process (started by ``running_cluster``)."""
    me = os.getpid()
    for pid in _pids():
        if _ppid(pid) == me:
            cmd = _cmdline(pid)
            if len(cmd) >= 3 and Path(cmd[-3]).name == "serve" and cmd[-2] == "run":
                return pid
    return None


def ray_address_of(serve_pid: int, timeout_s: float = 30.0) -> str:
    """``IP:port`` of the GCS of the Ray instance ``serve run`` (pid ``serve_pid``) started."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        files = glob.glob(f"/tmp/ray/session_*_{serve_pid}/gcs_server_port_*")
        if files:
            port = Path(files[0]).read_text().strip()
            if port:
                return f"{ray.util.get_node_ip_address()}:{port}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Ray session for serve run pid {serve_pid}")
        time.sleep(0.5)


def wait_port_free(port: int = PORT, timeout_s: float = 1800.0, poll_s: float = 10.0) -> None:
    """Wait until nothing listens on ``port`` (another user's cluster); ``TimeoutError`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    said = False
    while port_listening(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"port {port} still busy after {timeout_s:.0f} s")
        if not said:
            print(f"[bench] port {port} is busy (another cluster); waiting", flush=True)
            said = True
        time.sleep(poll_s)


@contextlib.contextmanager
def cluster(tries: int = 5, **overrides: Any) -> Iterator[tuple[str, str]]:
    """``(url, ray_address)`` of our own running cluster (see the module docstring)."""
    from cluster.launch import running_cluster

    for attempt in range(tries):
        wait_port_free()
        print(f"[bench] starting cluster {json.dumps(overrides)}", flush=True)
        t0 = time.monotonic()
        with running_cluster(timeout_s=300.0, port=PORT, **overrides) as url:
            serve_pid = my_serve_pid()
            owners = listener_pids()
            if serve_pid is not None and owners and all(is_descendant(p, serve_pid) for p in owners):
                print(f"[bench] cluster up in {time.monotonic() - t0:.0f} s", flush=True)
                yield url, ray_address_of(serve_pid)
                return
            print(f"[bench] port {PORT} is held by another cluster (pids {sorted(owners)}); retrying",
                  flush=True)
        time.sleep(5.0 * (attempt + 1))
    raise RuntimeError(f"could not get port {PORT} for our cluster after {tries} tries")
