"""The recovery store's start check: Bytewax's options, which stores are refused, stored keys."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from bytewax.recovery import init_db_dir

from runtime.bytewax_0_21.recovery import (
    Partition,
    RunOptions,
    Store,
    problems,
    run_options,
    stored_keys,
)

RUN = "/venv/lib/python3.11/site-packages/bytewax/run.py"
FLOW = "favorite_actions"


def _options(processes: int = 1, snapshot: int | None = 30) -> RunOptions:
    return RunOptions(Path("/rec"), snapshot, 0, processes)


def _part(index: int, count: int, *steps: str) -> Partition:
    return Partition(f"part-{index}.sqlite3", index, count, frozenset(steps))


def test_the_options_are_read_as_bytewax_run_reads_them() -> None:
    assert run_options([RUN, "f:flow", "-r", "/rec", "-s", "0", "-i", "1", "-a", "a:1;b:2"],
                       {}) == RunOptions(Path("/rec"), 0, 1, 2)
    assert run_options([RUN, "f:flow"], {"BYTEWAX_RECOVERY_DIRECTORY": "/env"}) == RunOptions(
        Path("/env"), None, 0, 1)


def test_a_complete_store_of_this_flow_is_accepted() -> None:
    store = Store(True, (_part(0, 2, f"{FLOW}.dedup"), _part(1, 2)))
    assert problems(_options(), store, FLOW) == []


def test_each_mistake_is_named() -> None:
    cases = {
        "does not exist": Store(False),
        "holds no recovery partitions": Store(True),
        "made by `user-activity replay`": Store(True, (_part(0, 1),), replay_marker=True),
        "session_linking": Store(True, (_part(0, 1, "session_linking.user_signed_in_input"),)),
        "different stores": Store(True, (_part(0, 1), _part(1, 2))),
        "partitions [1] of 2 are missing": Store(True, (_part(0, 2),)),
    }
    for expected, store in cases.items():
        [problem] = problems(_options(), store, FLOW)
        assert expected in problem


def test_a_cluster_process_may_hold_some_partitions_or_none() -> None:
    assert problems(_options(processes=2), Store(True), FLOW) == []
    assert problems(_options(processes=2), Store(True, (_part(1, 2),)), FLOW) == []


def test_no_store_is_not_refused_but_s0_is() -> None:
    assert problems(RunOptions(None, None, 0, 1), None, FLOW) == []
    assert problems(_options(snapshot=0), Store(True, (_part(0, 1),)), FLOW)


def test_the_keys_a_step_has_snapshots_of_are_read_from_every_partition(tmp_path: Path) -> None:
    init_db_dir(tmp_path, 2)
    rows = {0: [("f.added_input", "t#0", 1), ("f.added_input", "t#0", 2), ("f.dedup", "3", 1)],
            1: [("f.added_input", "t#4", 2)]}
    for index, snaps in rows.items():
        with sqlite3.connect(tmp_path / f"part-{index}.sqlite3") as conn:
            conn.executemany("INSERT INTO snaps (step_id, state_key, snap_epoch, ser_change)"
                             " VALUES (?, ?, ?, NULL)", snaps)
        conn.close()
    (tmp_path / "part-2.sqlite3").write_bytes(b"not a database")

    assert stored_keys(tmp_path, "f.added_input") == {"t#0", "t#4"}
    assert stored_keys(tmp_path, "f.removed_input") == frozenset()
    assert stored_keys(None, "f.added_input") == frozenset()
