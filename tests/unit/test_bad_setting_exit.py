"""A bad setting stops every entry point with one line naming the variable, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT

ENTRY_POINTS = {
    "operator command": [sys.executable, "-m", "cli", "migrate"],
    "favorites job": [sys.executable, "-m", "bytewax.run", "dataflows.favorite_actions:flow"],
    "session-linking job": [sys.executable, "-m", "bytewax.run",
                            "dataflows.session_linking:flow"],
}


@pytest.mark.parametrize("command", ENTRY_POINTS.values(), ids=ENTRY_POINTS.keys())
def test_a_bad_setting_is_one_line_naming_the_variable_and_exit_code_2(
    command: list[str],
) -> None:
    env = {**base_env(), "USER_ACTIVITY_SINK_PARTITIONS": "abc"}

    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "user-activity: invalid configuration: USER_ACTIVITY_SINK_PARTITIONS: Input should be a"
        " valid integer, unable to parse string as an integer (got 'abc')"
    ]
