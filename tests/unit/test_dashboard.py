"""k8s/dashboard.py generates the committed Grafana dashboard and its ConfigMap (no drift)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

import runtime.metrics
from sources.progress import INPUT_PROGRESS

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "k8s" / "dashboard.py"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# Bytewax 0.21.1's own metrics (its API server, :3030/metrics), as scraped from a running flow.
BYTEWAX_SERIES = {
    "bytewax_item_out_count_total",
    "bytewax_item_inp_count_total",
    *(f"bytewax_{name}_bucket" for name in (
        "inp_part_next_batch_duration_seconds", "flat_map_batch_duration_seconds",
        "stateful_batch_on_batch_duration_seconds", "out_part_write_batch_duration_seconds",
    )),
}
METRIC = re.compile(r"\b(?:user_activity|bytewax)_[a-z0-9_]+")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


DASHBOARD = _generator()


def _panels() -> list[dict[str, Any]]:
    model: dict[str, Any] = DASHBOARD.build()
    return [p for p in model["panels"] if p["type"] != "row"]


def _exported() -> set[str]:
    series = set(BYTEWAX_SERIES)
    families = [f for c in vars(runtime.metrics).values() if isinstance(c, MetricWrapperBase)
                for f in c.describe()]
    for family in [*families, *INPUT_PROGRESS.collect()]:
        series |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return series


def test_committed_dashboard_and_configmap_are_what_the_generator_writes() -> None:
    for path, text in DASHBOARD.outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run python k8s/dashboard.py"


def test_check_mode_reports_no_drift() -> None:
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)

    assert result.returncode == 0, result.stdout + result.stderr


def test_configmap_carries_the_json_for_the_grafana_sidecar() -> None:
    [doc] = list(yaml.safe_load_all(DASHBOARD.CONFIGMAP_FILE.read_text()))

    assert doc["kind"] == "ConfigMap"
    assert doc["metadata"]["namespace"] == "user-activity"
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(key, text)] = doc["data"].items()
    assert key.endswith(".json")
    assert json.loads(text) == json.loads(DASHBOARD.JSON_FILE.read_text())


def test_dashboard_has_a_uid_and_the_required_panels() -> None:
    model = DASHBOARD.build()
    titles = {p["title"] for p in _panels()}

    assert model["uid"] == "user-activity-stream"
    assert {
        "Input lag per partition", "Records behind", "Seconds since progress", "Paused time",
        "Favorites throughput by outcome", "Dead letters and parked outbox rows",
        "Session-linking outcomes", "Housekeeping task failures",
        "Oldest unpublished outbox row vs stall threshold", "Outbox published rate",
        "Items out per step",
    } <= titles
    assert any("duration (p99)" in t for t in titles)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))


def test_every_query_names_only_exported_series_and_the_datasource_variable() -> None:
    exported = _exported()
    for panel in _panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            names = METRIC.findall(target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in exported, f"{panel['title']}: {name} is not exported"


def test_panels_do_not_overlap_on_the_grid() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD.build()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine
