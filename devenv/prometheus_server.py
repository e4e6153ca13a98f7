"""Debian's real Prometheus server on loopback, to evaluate the alert rules of k8s/ live.

:class:`PrometheusServer` writes a config (scrape and evaluation every 1 s by default), starts
``prometheus`` on a free port with its own TSDB in ``workdir``, waits for ``/-/ready`` and asks
its HTTP API (queries, alerts, rules). Each :class:`ScrapeTarget` is one scrape job with the
``job`` label and target labels the Prometheus Operator's PodMonitor gives (``namespace``,
``pod``, ``endpoint``), so the rule files load and match as they are. :class:`ApiJob` is a job
with Bytewax's API server on (``bytewax_*`` metrics). Nothing outlives its owner: the server
runs in its own process group under ``setpriv --pdeathsig KILL``; ``close`` kills that group.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson
import yaml

from devenv.harness.jobs import FAVORITES_FLOW, ROOT, JobProcess, wait_until
from devenv.harness.ports import free_port
from runtime.settings import Settings

RULES_FILE = ROOT / "k8s" / "prometheus-rules.yaml"
JOB_LABEL = "user-activity/user-activity-stream"
"""The ``job`` label the repository's PodMonitor gives both endpoints (see k8s/podmonitor.yaml)."""


def one_rule(workdir: Path, alert: str, *, threshold: float, hold: str) -> Path:
    """A rule file of k8s's ``alert`` alone, its ``> N`` threshold and its ``for`` replaced.

    Raises ValueError unless the rule's expression compares with ``>`` exactly once.
    """
    rules = yaml.safe_load(RULES_FILE.read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    expr, found = re.subn(r"> [0-9.]+", f"> {threshold:g}", rule["expr"])
    if found != 1:
        raise ValueError(f"{alert}: no single '> N' threshold in {rule['expr']!r}")
    rule["expr"], rule["for"] = expr, hold
    path = workdir / f"{alert}.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": alert, "rules": [rule]}]}))
    return path


@dataclass(frozen=True)
class ScrapeTarget:
    """One ``host:port`` to scrape at ``path``, with its target labels."""

    address: str
    labels: dict[str, str] = field(default_factory=dict)
    path: str = "/metrics"
    keep: str | None = None
    """A regex of metric names to keep (``metric_relabel_configs``), None for all."""
    job_label: str = JOB_LABEL


class ApiJob(JobProcess):
    """A dataflow job with Bytewax's API server enabled (``api_port``); ``flow`` to choose it."""

    def __init__(
        self, settings: Settings, workdir: Path, *, flow: str = FAVORITES_FLOW, **kwargs: Any
    ) -> None:
        self.api_port = free_port()
        super().__init__(
            settings, workdir, flow=flow, cwd=workdir,
            extra_env={
                "BYTEWAX_DATAFLOW_API_ENABLED": "true",
                "BYTEWAX_DATAFLOW_API_PORT": str(self.api_port),
                "BYTEWAX_DATAFLOW_API_CACHE_PATH": str(workdir),
            },
            **kwargs,
        )

    def scrape_targets(self, pod: str, namespace: str = "user-activity") -> list[ScrapeTarget]:
        """The two endpoints as the PodMonitor scrapes them (``bytewax_*`` only from 3030)."""
        labels = {"namespace": namespace, "pod": pod, "container": "stream"}
        return [
            ScrapeTarget(f"127.0.0.1:{self.port}", {**labels, "endpoint": "http"}),
            ScrapeTarget(f"127.0.0.1:{self.api_port}", {**labels, "endpoint": "bytewax-api"},
                         keep="bytewax_.*"),
        ]


class PrometheusServer:
    """``prometheus`` on 127.0.0.1:``port`` scraping ``targets`` and evaluating ``rule_files``."""

    def __init__(
        self,
        workdir: Path,
        targets: Iterable[ScrapeTarget],
        rule_files: Sequence[Path] = (),
        *,
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        binary: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.targets = list(targets)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        found = binary or shutil.which("prometheus")
        if found is None:
            raise RuntimeError("prometheus is missing: scripts/bootstrap.sh installs Debian's")
        self.binary = found
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The configuration file's content."""
        scrape_configs = []
        for number, target in enumerate(self.targets):
            job: dict[str, Any] = {
                "job_name": f"target-{number}",
                "metrics_path": target.path,
                "scrape_timeout": self.scrape_interval,
                "static_configs": [{"targets": [target.address], "labels": target.labels}],
                "relabel_configs": [
                    {"target_label": "job", "replacement": target.job_label},
                ],
            }
            if target.keep is not None:
                job["metric_relabel_configs"] = [
                    {"source_labels": ["__name__"], "regex": target.keep, "action": "keep"},
                ]
            scrape_configs.append(job)
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "evaluation_interval": self.evaluation_interval,
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": scrape_configs,
        }

    def start(self, timeout: float = 60.0) -> Self:
        """Write the config, start the server, wait until it is ready."""
        if self._proc is not None:
            raise RuntimeError("prometheus is already running")
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", self.binary,
                 f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d",
                 "--log.level=warn"],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_until(self._ready, timeout, "prometheus to be ready")
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 10 s) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def __enter__(self) -> Self:
        return self.start() if self._proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- HTTP API --------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; its ``data`` (raises on an error answer)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"http://{self.address}/api/v1/{path}{query}",
                                        timeout=10) as answer:
                body = orjson.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read()[:500]!r}") from exc
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: its vector's samples (``metric``, ``value``)."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return result

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` now (None when the vector is empty)."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending or firing) as ``/api/v1/alerts`` reports them."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        """The firing alerts named ``alertname``."""
        return [a for a in self.alerts()
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health and state (``/api/v1/rules``)."""
        groups = self.api("rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def targets_up(self) -> bool:
        """True once every target has been scraped successfully."""
        active = self.api("targets", state="active")["activeTargets"]
        return len(active) == len(self.targets) and all(t["health"] == "up" for t in active)

    # ---- helpers ---------------------------------------------------------------------------

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.5) -> float:
        """Poll ``condition`` until true; the seconds it took. Fails if the server exits."""

        def exited() -> str | None:
            code = None if self._proc is None else self._proc.poll()
            return None if code is None else f"prometheus exited ({code})"

        return wait_until(condition, timeout, what, interval=interval, exited=exited,
                          context=self.log_tail)
