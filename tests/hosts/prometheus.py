"""A real Prometheus for tests (Debian's `prometheus`, build/sysdeps.sh): started on loopback with its own config
and data dir, never the packaged service, stopped by its PID.

    prom = PrometheusProcess(tmp, targets=["127.0.0.1:8787"], token_file=F, rule_files=[R]).start()
    prom.query('onbox_run_step{run="x"}'); prom.alerts(); prom.stop()

Scrapes every `scrape_interval` with `authorization: {credentials_file: F}` (the bearer token), evaluates rules
every `evaluation_interval`. Every request to it is bounded in time.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional

from tests.hosts import free_port, log_tail, stop_child


def missing() -> Optional[str]:
    """Why no Prometheus can run here (None: it can)."""
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            return "%s not installed: run `bash build/sysdeps.sh`" % tool
    return None


class PrometheusProcess:
    def __init__(self, workdir: str, targets: List[str], token_file: Optional[str] = None,
                 rule_files: Optional[List[str]] = None, scrape_interval: str = "1s",
                 evaluation_interval: str = "1s") -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.config = os.path.join(workdir, "prometheus.yml")
        self.log_path = os.path.join(workdir, "prometheus.log")
        scrape: Dict[str, Any] = {"job_name": "onbox", "metrics_path": "/metrics", "scrape_interval": scrape_interval,
                                  "static_configs": [{"targets": targets}]}
        if token_file:
            scrape["authorization"] = {"credentials_file": token_file}
        doc = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
               "rule_files": list(rule_files or []), "scrape_configs": [scrape]}
        with open(self.config, "w") as f:
            json.dump(doc, f)  # JSON is YAML
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self, timeout: float = 60.0) -> "PrometheusProcess":
        argv = ["prometheus", "--config.file=" + self.config, "--storage.tsdb.path=" + os.path.join(self.workdir, "data"),
                "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited with %s:\n%s" % (self.proc.returncode, log_tail(self.log_path)))
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("prometheus not ready after %.0f s:\n%s" % (timeout, log_tail(self.log_path)))

    def stop(self) -> None:
        stop_child(self.proc, timeout=30.0)  # by its PID: TERM, then KILL

    def log(self) -> str:
        return log_tail(self.log_path)

    def api(self, path: str, **params: str) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc.get("status") == "success", doc
        return doc["data"]

    def query(self, expr: str) -> List[Dict[str, Any]]:
        """The instant vector `expr` evaluates to now: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        return self.api("/api/v1/query", query=expr)["result"]

    def targets(self) -> List[Dict[str, Any]]:
        return self.api("/api/v1/targets")["activeTargets"]

    def alerts(self) -> List[Dict[str, Any]]:
        return self.api("/api/v1/alerts")["alerts"]
