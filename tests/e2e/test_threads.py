"""The threads a job runs beside Bytewax's workers: the composition root's, at most five."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from devenv.harness.env import base_env, settings_env
from devenv.harness.ports import free_port
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e

# the flow is built as `python -m bytewax.run` builds it; then the threads of the process
_PROBE = ("import threading, dataflows.favorite_actions as job; job.flow;"
          " main = threading.main_thread();"
          " print(sorted(t.name for t in threading.enumerate() if t is not main))")
_ROOTS = ["housekeeping", "http", "outbox-publisher", "stop-deadline"]


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_the_job_starts_only_the_composition_roots_threads(
    make_settings: SettingsFactory, traced: bool,
) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"} if traced else {}
    env = {**base_env(), **settings_env(make_settings(http_port=free_port())), **otel}

    run = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=60, check=False)

    assert run.returncode == 0, run.stderr[-2000:]
    threads = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    exporter = [name for name in threads if name not in _ROOTS]
    assert sorted(set(threads) - set(exporter)) == _ROOTS
    assert len(exporter) == (1 if traced else 0), threads  # the span exporter, only when traced
    assert len(threads) <= 5
