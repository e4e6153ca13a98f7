"""A bad setting stops every entry point with one line naming the variable, exit code 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT
from runtime.configuration import load_settings

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


HOSTILE = {
    # each crashed the job with a traceback (a crash loop), or dead-lettered every message
    "LOG_LEVEL": "LOUD",
    "GC_YOUNG_THRESHOLD": "3000000000",
    "DEDUP_TTL_SECONDS": "1e10",
    "SOURCE_BATCH_SIZE": "2000000",
    "SESSION_LINKING_LATENESS_SECONDS": "1e12",
    "SESSION_LINKING_MAX_CLOCK_SKEW_SECONDS": "1e12",
    "DB_STATEMENT_TIMEOUT_MS": "99999999999",
    "DB_DEAD_CONNECTION_SECONDS": "1e10",
    "RETENTION_DAYS": "1000000",
    "SOURCE_PARTITION_CHECK_SECONDS": "inf",
    "GC_FULL_COLLECT_INTERVAL_SECONDS": "nan",
    "DATABASE_URL": "postgresql+psycopg://svc:hunter2@db/user_activity",
    # psycopg reads it, the migrations (yoyo) do not
    "DATABASE_URL-key-value": "host=db dbname=user_activity user=svc password=hunter2",
    # each was retried forever as a broker outage, silently
    "KAFKA_BOOTSTRAP_SERVERS": "http://kafka:9092",
    "KAFKA_SECURITY_PROTOCOL": "FOO",  # a Rust panic
}


@pytest.mark.parametrize(("case", "value"), HOSTILE.items(), ids=HOSTILE.keys())
def test_a_value_the_job_cannot_run_with_is_refused_at_start_up(
    case: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    name = case.partition("-")[0]
    monkeypatch.setenv(f"USER_ACTIVITY_{name}", value)

    with pytest.raises(SystemExit) as stopped:
        load_settings()

    assert stopped.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"user-activity: invalid configuration: USER_ACTIVITY_{name}: ")
    assert "hunter2" not in line  # a secret's value is never shown


def test_a_uri_with_options_lower_case_names_and_brokers_without_a_port_are_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("USER_ACTIVITY_DATABASE_URL",
                       "postgres://svc:p%40ss@db:5432/user_activity?sslmode=verify-full")
    monkeypatch.setenv("USER_ACTIVITY_LOG_LEVEL", "warning")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS", "SSL://k-0:9093, k-1, [::1]:9092")
    monkeypatch.setenv("USER_ACTIVITY_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")

    settings = load_settings()

    assert (settings.log_level, settings.kafka_security_protocol) == ("WARNING", "SASL_SSL")


def test_a_port_in_use_is_one_line_and_exit_code_2_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**base_env(), "USER_ACTIVITY_HTTP_HOST": "127.0.0.1",
               "USER_ACTIVITY_HTTP_PORT": str(port),
               "USER_ACTIVITY_TAIL": "false"}  # no recovery-disabled warning before the line

        done = subprocess.run(ENTRY_POINTS["favorites job"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"user-activity: cannot serve /metrics, /livez and /readyz on 127.0.0.1:{port}"
        " (USER_ACTIVITY_HTTP_HOST, USER_ACTIVITY_HTTP_PORT): [Errno 98] Address already in use"]
