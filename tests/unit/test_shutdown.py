"""The stop's grace: retry sleeps cut short by a stop, an outage past the grace ends the process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from runtime.shutdown import EXIT_RESTART, Shutdown


def test_without_a_stop_a_retry_sleeps_its_whole_delay_and_time_left_is_the_timeout() -> None:
    shutdown = Shutdown(grace=5.0)
    started = time.monotonic()
    shutdown.retry_sleep(0.2)
    assert time.monotonic() - started >= 0.19
    assert shutdown.time_left(7.0) == 7.0


def test_a_stop_request_wakes_a_sleeping_retry_at_once() -> None:
    shutdown = Shutdown(grace=5.0)
    started = time.monotonic()
    waker = threading.Timer(0.1, shutdown.request, args=("test",))
    waker.start()
    shutdown.retry_sleep(30.0)
    assert time.monotonic() - started < 2.0


def test_after_a_stop_waits_are_bounded_by_what_is_left_of_the_grace() -> None:
    shutdown = Shutdown(grace=0.5)
    shutdown.request("test")
    assert 0.0 < shutdown.time_left(10.0) <= 0.5
    assert shutdown.time_left(0.1) == 0.1
    started = time.monotonic()
    shutdown.retry_sleep(30.0)  # sleeps until the grace ends, no longer
    assert time.monotonic() - started < 10.0  # a liveness bound, far below the 30 s asked for
    assert shutdown.time_left(10.0) == 0.0


def _exit_code(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_retry_past_the_grace_ends_the_process_with_75_and_one_line() -> None:
    done = _exit_code(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "from runtime.shutdown import Shutdown\n"
        "s = Shutdown(grace=0.0); s.request('SIGTERM'); s.retry_sleep(5.0)\n"
        "print('not reached')\n")
    assert done.returncode == EXIT_RESTART == 75
    assert "stopped-during-outage" in done.stderr and "not reached" not in done.stdout


def test_a_stop_that_left_work_behind_exits_75_at_the_end() -> None:
    done = _exit_code(
        "from runtime.shutdown import Shutdown\n"
        "s = Shutdown(); s.request('SIGTERM'); s.unfinished('outbox rows'); print('ran on')\n"
        "s.finish()\n")
    assert done.returncode == 75 and "ran on" in done.stdout


def test_a_clean_stop_ends_with_one_stopped_line_and_a_run_without_a_stop_with_none() -> None:
    done = _exit_code(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "from runtime.shutdown import Shutdown\n"
        "Shutdown().finish()\n"
        "s = Shutdown(); s.request('SIGTERM'); s.finish(); print('ran on')\n")
    assert done.returncode == 0 and "ran on" in done.stdout
    assert done.stderr.split() == ["shutdown-requested", "stopped"]


def test_a_restart_the_job_asks_for_is_a_clean_stop_that_exits_75_at_the_end() -> None:
    done = _exit_code(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "from runtime.shutdown import Shutdown\n"
        "s = Shutdown(); s.restart('t has 12 partitions, 6 are read')\n"
        "print('stop requested', s.requested()); s.finish()\n")
    assert done.returncode == 75
    assert "stop requested True" in done.stdout  # the stop itself runs to its end first
    assert done.stderr.split() == ["shutdown-requested", "stopped-for-restart"]


def test_a_stop_stuck_in_a_call_that_never_returns_ends_at_the_deadline_with_75() -> None:
    """A worker blocked in a query to a frozen server never reaches a retry loop (module doc)."""
    done = _exit_code(
        "import logging, sys, time\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "import runtime.shutdown as shutdown\n"
        "shutdown.DEADLINE_MARGIN = 0.5\n"
        "s = shutdown.Shutdown(grace=0.5); shutdown.install_signal_handlers(s)\n"
        "started = time.monotonic(); s.request('SIGTERM')\n"
        "time.sleep(30)  # the call that does not return\n"
        "print('not reached')\n")
    assert done.returncode == EXIT_RESTART
    assert done.stderr.split() == ["shutdown-requested", "stopped-during-outage"]
    assert "not reached" not in done.stdout


def test_without_the_signal_handlers_a_stop_request_never_ends_the_process() -> None:
    done = _exit_code(
        "import time\n"
        "import runtime.shutdown as shutdown\n"
        "shutdown.DEADLINE_MARGIN = 0.2\n"
        "s = shutdown.Shutdown(grace=0.0); s.request('test'); time.sleep(1.5); print('ran on')\n")
    assert done.returncode == 0 and "ran on" in done.stdout
