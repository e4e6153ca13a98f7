"""The alert rules are evaluated by Prometheus' own promtool: syntax, and unit tests per alert.

``promtool`` comes with Debian's ``prometheus`` package (scripts/bootstrap.sh installs it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
RULES_FILE = K8S / "prometheus-rules.yaml"
TEST_FILES = sorted((K8S / "tests").glob("*.yaml"))


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: run scripts/bootstrap.sh (installs Debian's prometheus)"
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=K8S.parent, capture_output=True, text=True, timeout=120,
        check=False,
    )


def _alerts() -> list[str]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def _alert_tests() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        for test in doc["tests"]:
            found += test.get("alert_rule_test", [])
    return found


def test_promtool_accepts_the_rules_file() -> None:
    result = _run("check", "rules", str(RULES_FILE.relative_to(K8S.parent)))

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    assert TEST_FILES
    result = _run("test", "rules", *(str(p.relative_to(K8S.parent)) for p in TEST_FILES))

    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_load_the_rules_file_itself() -> None:
    for path in TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        assert [(path.parent / f).resolve() for f in doc["rule_files"]] == [RULES_FILE], path


@pytest.mark.parametrize("alert", _alerts())
def test_every_alert_has_a_firing_and_a_quiet_case(alert: str) -> None:
    cases = [case for case in _alert_tests() if case["alertname"] == alert]

    assert any(case.get("exp_alerts") for case in cases), f"{alert}: no firing case"
    assert any(not case.get("exp_alerts") for case in cases), f"{alert}: no quiet case"
