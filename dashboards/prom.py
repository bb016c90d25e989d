"""A small Prometheus client (HTTP API, stdlib only) and a throwaway Prometheus server for tests.

``find_prometheus()`` looks for the binary the way ``scripts/monitoring.sh`` installs it
(``$PROMETHEUS_BIN``, ``.tools/prometheus/usr/bin/``, ``$PATH``); ``PrometheusServer`` runs one
on a free port with a given config and a temporary data dir; ``PromClient`` wraps
``/api/v1/query`` and ``/api/v1/query_range``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DEFAULT_TARGETS_URL = "http://127.0.0.1:8000/metrics/targets"
DEFAULT_RAY_SD = "/tmp/ray/prom_metrics_service_discovery.json"


def find_binary(name: str) -> str | None:
    """``prometheus`` or ``promtool``: next to ``$PROMETHEUS_BIN``, in ``.tools/``, or on PATH."""
    env = os.environ.get("PROMETHEUS_BIN")
    candidates = []
    if env:
        candidates.append(Path(env).with_name(name) if name != "prometheus" else Path(env))
    candidates.append(ROOT / ".tools" / "prometheus" / "usr" / "bin" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


def find_prometheus() -> str | None:
    return find_binary("prometheus")


def find_promtool() -> str | None:
    return find_binary("promtool")


def config_for(targets_url: str, ray_sd_file: str = DEFAULT_RAY_SD, scrape_interval: str | None = None) -> str:
    """The committed ``deploy/prometheus/prometheus.yml`` pointed at another http_sd URL (and
    optionally a shorter scrape interval), as ``scripts/monitoring.sh`` does with sed."""
    text = PROM_CONFIG.read_text()
    if DEFAULT_TARGETS_URL not in text:
        raise ValueError(f"{PROM_CONFIG} no longer contains {DEFAULT_TARGETS_URL}")
    text = text.replace(DEFAULT_TARGETS_URL, targets_url).replace(DEFAULT_RAY_SD, ray_sd_file)
    if scrape_interval:
        text = text.replace("scrape_interval: 2s", f"scrape_interval: {scrape_interval}")
        text = text.replace("scrape_timeout: 2s", f"scrape_timeout: {scrape_interval}")
        text = text.replace("refresh_interval: 5s", f"refresh_interval: {scrape_interval}")
    return text


class PromError(RuntimeError):
    pass


class PromClient:
    """Prometheus HTTP API: ``query`` (instant) and ``query_range``; results are the API's
    ``data.result`` lists (``[{"metric": {...}, "value"|"values": ...}]``)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        data = urllib.parse.urlencode(params).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise PromError(f"{path} {params}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        if body.get("status") != "success":
            raise PromError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._get("/api/v1/query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return self._get("/api/v1/query_range", params)["result"]

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=self.timeout_s) as r:
            return json.load(r)["data"]["activeTargets"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


class PrometheusServer:
    """A Prometheus process for tests: ``with PrometheusServer(config_text) as prom: prom.client``.

    Listens on 127.0.0.1 on a free port; data in a temporary directory removed on exit (or in
    ``data_dir`` if given, kept). Startup is well under a second with the Debian 2.42 binary.
    """

    def __init__(self, config_text: str, binary: str | None = None, data_dir: Path | None = None) -> None:
        from observability.exporter import free_port

        self.binary = binary or find_prometheus()
        if not self.binary:
            raise FileNotFoundError("no prometheus binary (run scripts/monitoring.sh install)")
        self.config_text = config_text
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = PromClient(self.url)
        self._keep = data_dir is not None
        self._dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="fairway-prom-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        self._dir.mkdir(parents=True, exist_ok=True)
        cfg = self._dir / "prometheus.yml"
        cfg.write_text(self.config_text)
        self.log_path = self._dir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={self._dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while not self.client.ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"prometheus did not start: {self.log_tail()}")
            time.sleep(0.1)
        return self

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if not self._keep:
            shutil.rmtree(self._dir, ignore_errors=True)

    def wait_for_targets(self, n: int, job: str = "fairway", timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Block until ``n`` targets of ``job`` are up (scraped successfully at least once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            up = [t for t in self.client.targets() if t["labels"].get("job") == job and t["health"] == "up"]
            if len(up) >= n:
                return up
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(up)}/{n} {job} targets up after {timeout_s}s: {self.client.targets()}")
            time.sleep(0.25)
