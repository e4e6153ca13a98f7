"""The suite on pytest-xdist workers: how many, own ports, longest tests first, groups.

pyproject's addopts ask for ``-n auto``; :func:`pytest_xdist_auto_num_workers` says how many.
Each worker is a pytest session of its own, so the session fixtures of tests/conftest.py give
each worker its own PostgreSQL and Kafka, started when a test of that worker first needs one.
This plugin gives each worker a disjoint share of ports (devenv.harness.ports), keeps the
tests of a module- or class-scoped fixture on one worker (an ``xdist_group``), and orders
the work longest first by ``tests/durations.json`` (``--store-durations`` rewrites it), so
the long e2e tests spread over the workers and the short ones fill the gaps at the end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devenv.harness.ports import use_port_share

DURATIONS = Path(__file__).with_name("durations.json")
UNIT = Path(__file__).with_name("unit")
# the guess for a test not in DURATIONS yet, by the folder it is in
_UNKNOWN = {"e2e": 15.0, "integration": 3.0}
_MIN_STORED = 0.5  # seconds; shorter unit tests are all alike to the schedule


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's seconds to {DURATIONS.name} (the workers' schedule)")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The workers of ``-n auto``: ``USER_ACTIVITY_TEST_WORKERS`` if set, else by what is run.

    None against an external server or broker (the tests that share one must not run at the
    same time), nor for tests named one by one (``file::test``); one per core for unit tests
    alone (they compute), two per core otherwise (the e2e tests mostly wait).
    """
    if os.environ.get("USER_ACTIVITY_TEST_DATABASE_URL") or os.environ.get(
            "USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS"):
        return 0
    if count := os.environ.get("USER_ACTIVITY_TEST_WORKERS"):
        return int(count)
    args = config.args
    if args and all("::" in arg for arg in args):
        return 0
    cores = len(os.sched_getaffinity(0))
    unit_only = args and all(Path(arg).resolve().is_relative_to(UNIT) for arg in args)
    return cores if unit_only else 2 * cores


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        # a crashed worker's replacement is numbered past the count: spare shares for it
        shares = 2 * int(worker["workercount"])
        use_port_share(int(worker["workerid"].removeprefix("gw")) % shares, shares)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: group the tests of a shared fixture, then order the work longest first."""
    if not hasattr(config, "workerinput"):
        return  # one process: the files' order
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        named = item.get_closest_marker("xdist_group")  # a group the test names wins
        group = str(named.args[0]) if named is not None and named.args else _shared_scope(item)
        if group is not None and named is None:
            item.add_marker(pytest.mark.xdist_group(group))
        units.setdefault(group or item.nodeid, []).append(item)
    known = _load()
    order = sorted(units.values(), key=lambda unit: -sum(_guess(known, i) for i in unit))
    items[:] = [item for unit in order for item in unit]  # sorted() is stable: ties keep order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid.split("@")[0]  # without the xdist_group suffix
    _measured[nodeid] = _measured.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        kept = {k: round(v, 1) for k, v in sorted(_measured.items())
                if v >= _MIN_STORED or _folder(k) in _UNKNOWN}
        DURATIONS.write_text(json.dumps(kept, indent=0) + "\n")


_measured: dict[str, float] = {}  # setup + call + teardown seconds by test


def _shared_scope(item: pytest.Item) -> str | None:
    """The module or class whose fixture ``item`` shares with other tests, if any."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(info, "names_closure", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0] if defs[-1].scope != "class" else \
                "::".join(item.nodeid.split("::")[:2])
    return None


def _load() -> dict[str, float]:
    try:
        loaded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _guess(known: dict[str, float], item: pytest.Item) -> float:
    nodeid = item.nodeid.split("@")[0]
    if nodeid in known:
        return float(known[nodeid])
    return _UNKNOWN.get(_folder(nodeid), 0.0)


def _folder(nodeid: str) -> str:
    """``e2e`` for ``tests/e2e/test_x.py::test_y``."""
    return nodeid.split("/")[1] if nodeid.startswith("tests/") else ""
