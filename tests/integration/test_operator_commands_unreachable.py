"""Operator commands against a service that is down or never answers: one line, exit 75, ended.

Measured before, with PostgreSQL frozen by SIGSTOP: ``maintain`` and ``outbox parked`` waited
for ever without a word (killed at 45 s by the probe), ``migrate`` ended after 10 s in a
17-line traceback; PostgreSQL down: every command a 16-18-line traceback, exit 1; Kafka down:
``create-topics`` a bare ``TimeoutError`` traceback after 60 s, exit 1, after about 200 raw
librdkafka lines. A listening socket that never answers stands in for the frozen server (the
kernel accepts, nobody reads). How long a command waits for a silent server is a figure of
``python -m bench --phases timing``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT

pytestmark = pytest.mark.integration

COMMANDS = (["migrate"], ["maintain"], ["outbox", "parked"], ["outbox", "requeue", "--all"])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli", *command], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_postgresql_and_kafka_not_answering_or_down_is_one_line_and_exit_75(
    silent_port: int,
) -> None:
    closed = _closed_port()
    runs = []
    for port, why in ((silent_port, "no answer within 10 s"), (closed, "Connection refused")):
        env = {**base_env(), "USER_ACTIVITY_DATABASE_URL": f"postgresql://u@127.0.0.1:{port}/d",
               "USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}
        runs += [(command, "PostgreSQL: ", why, _start(command, env)) for command in COMMANDS]
        runs += [(command, f"Kafka (127.0.0.1:{port}): ", "", _start(command, env))
                 for command in (["create-topics"], ["check"])]
    try:
        for command, service, why, run in runs:
            _, err = run.communicate(timeout=100)  # a liveness bound: ten times the 10 s
            ours = [line for line in err.splitlines() if line.startswith("user-activity ")]
            assert run.returncode == 75, (command, err[-1500:])
            assert "Traceback" not in err, (command, err[-1500:])
            assert len(ours) == 1 and ours[0].startswith(
                f"user-activity {' '.join(command[:2]).replace(' --all', '')}: {service}"), ours
            assert why in ours[0] and ours[0].endswith("run it again once it answers"), ours
            # librdkafka's own lines go through the JSON log, repeats throttled: before, about
            # 200 raw lines came ahead of the one that matters
            assert len(err.splitlines()) <= 10, (command, len(err.splitlines()), err[-1500:])
    finally:
        for *_, run in runs:
            run.kill()  # one that hangs (before: a frozen server) is not left behind
            run.wait()
