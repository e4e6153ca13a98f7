"""The ``peer`` phase: the same backlog through a Quix Streams app (:mod:`bench.peer_app`).

Quix Streams runs in its own venv, ``.venv-peer`` (made on first use with ``pip install
quixstreams[postgresql]==3.28.1``), so its pins never touch the project's environment. The app
is a subprocess; done = every expected row in ``action_events`` and every output on its topic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from bench.measure import CpuSampler, OutputCounter, cpu_us_per_event, proc_cpu_seconds, rss_kb
from bench.services import Services
from bench.workload import Backlog
from devenv.harness.jobs import ROOT
from runtime.settings import Settings

QUIXSTREAMS = "quixstreams[postgresql]==3.28.1"
PEER_VENV = ROOT / ".venv-peer"


def ensure_peer_venv(venv: Path = PEER_VENV) -> Path:
    """The peer venv's python, creating the venv with Quix Streams first if needed."""
    python = venv / "bin" / "python"
    marker = venv / f".installed-{QUIXSTREAMS}"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", QUIXSTREAMS], check=True,
                       stdout=subprocess.DEVNULL)
        marker.touch()
    return python


def run_peer(services: Services, input_settings: Settings, backlog: Backlog, db_url: str, *,
             prefill_rows: int, timeout: float, dedup_ttl_s: float) -> dict[str, Any]:
    """Run the Quix Streams app on the backlog until every row and output is there."""
    python = ensure_peer_venv()
    url = urlsplit(db_url)
    settings = services.settings("peer", db_url)
    env = {**os.environ, "PEER_BOOTSTRAP": services.bootstrap,
           "PEER_GROUP": f"bench-peer-{services.run_id}",
           "PEER_STATE_DIR": str(services.run_dir / "peer-state"),
           "PEER_ADDED_TOPIC": input_settings.topic_favorite_added,
           "PEER_REMOVED_TOPIC": input_settings.topic_favorite_removed,
           "PEER_OUTPUT_TOPIC": settings.topic_action_tracked,
           "PEER_DEDUP_TTL_SECONDS": str(dedup_ttl_s),
           "PEER_PG_HOST": url.hostname or "127.0.0.1", "PEER_PG_PORT": str(url.port or 5432),
           "PEER_PG_DBNAME": unquote(url.path.lstrip("/")),
           "PEER_PG_USER": unquote(url.username or "postgres"),
           "PEER_PG_PASSWORD": unquote(url.password or "")}
    expected = backlog.expected_recorded
    counter = OutputCounter(services.bootstrap, settings.topic_action_tracked)
    log_path = services.run_dir / "peer.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(python), str(ROOT / "bench" / "peer_app.py")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=services.run_dir)
    started = time.monotonic()
    sampler = CpuSampler(services, cpu=lambda: proc_cpu_seconds(proc.pid),
                         rss=lambda: (rss_kb(proc.pid) or 0) / 1024)  # the sampler keeps the peak
    rows, failure = 0, None
    while True:
        rows = services.counts(db_url)["action_events"] - prefill_rows
        if rows >= expected and counter.count >= expected:
            break
        if proc.poll() is not None:
            failure = f"the peer exited ({proc.returncode}) with {rows}/{expected} rows"
            break
        if time.monotonic() - started > timeout:
            failure = f"timeout after {timeout:.0f}s: {rows}/{expected} rows"
            break
        time.sleep(0.2)
    done = time.monotonic()
    resources = sampler.stop()
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    counter.close()
    wall = done - started
    total = len(backlog.records)
    result: dict[str, Any] = {
        "app": QUIXSTREAMS, "messages": total, "expected_recorded": expected,
        "rows_committed": rows, "outputs_on_topic": counter.count,
        "wall_s": round(wall, 2), "events_per_s": round(total / wall, 1) if not failure else None,
        "cpu_us_per_event": cpu_us_per_event(resources, total), "resources": resources,
        "ok": failure is None and rows == expected,
    }
    if not result["ok"]:
        result["failure"] = failure or f"{rows} rows, {expected} expected"
        result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return result
