"""The replay and init-recovery commands refuse arguments they would misread: one line, exit 2."""

from __future__ import annotations

import argparse
import fcntl
import io
import subprocess
import sys
from pathlib import Path

import pytest

from cli import replay
from cli.replay import parse_offsets, parse_timestamp
from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT
from runtime.settings import Settings


def _replay(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return replay.run(parser.parse_args(argv), Settings())


def test_offsets_and_timestamps_are_parsed() -> None:
    assert parse_offsets(["t.a:0=5,1=0", "x:y:2=7"]) == {("t.a", 0): 5, ("t.a", 1): 0,
                                                         ("x:y", 2): 7}
    assert parse_timestamp("1970-01-01T00:00:00Z") == 0
    assert parse_timestamp("2026-11-01T03:00:00+03:00") == 1_793_491_200_000


@pytest.mark.parametrize("spec", ["t:x=1", "t:0=-5", "t:0", "0=1", "t:0=1,"])
def test_an_offset_that_is_not_a_whole_number_is_refused(spec: str) -> None:
    # "t:x=1" was a ValueError traceback; "t:0=-5" a Rust panic in the job.
    with pytest.raises(argparse.ArgumentTypeError):
        parse_offsets([spec])


def test_a_time_before_1970_is_refused() -> None:
    # The broker answers UNSUPPORTED_VERSION for it, which was retried forever as an outage.
    with pytest.raises(argparse.ArgumentTypeError, match="1970"):
        parse_timestamp("0001-01-01T00:00:00Z")


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--offsets", "pin.favorites.favorite-addded.v1:0=5"],
         "--offsets names pin.favorites.favorite-addded.v1, which this replay does not read"),
        (["--offsets", "pin.favorites.favorite-removed.v1:0=5", "--topic", "added"],
         "--offsets names pin.favorites.favorite-removed.v1, which this replay does not read"),
        (["--offsets", "pin.favorites.favorite-added.v1:x=5"], "PARTITION=OFFSET"),
    ],
)
def test_replay_offsets_of_a_topic_it_does_not_read_are_refused_before_it_reads(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str],
) -> None:
    # A typo in the topic replayed the whole topic from its earliest offset, exit 0.
    assert _replay(argv) == 2

    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("user-activity replay: ") and problem in line


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *argv], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_init_recovery_refuses_an_existing_store_and_a_store_of_no_partitions(
    tmp_path: Path,
) -> None:
    # Both were a traceback (exit 1), or exit 0 with a store every start of the job fails on.
    store = tmp_path / "store"
    assert _cli("init-recovery", str(store), "--partitions", "2").returncode == 0
    files = {p.name: p.read_bytes() for p in store.iterdir()}

    again = _cli("init-recovery", str(store), "--partitions", "2")
    empty = _cli("init-recovery", str(tmp_path / "empty"), "--partitions", "0")

    assert again.returncode == 2
    assert again.stderr.splitlines() == [
        f"user-activity init-recovery: {store} already holds a recovery store (part-0.sqlite3,"
        " part-1.sqlite3); nothing changed"]
    assert {p.name: p.read_bytes() for p in store.iterdir()} == files
    assert empty.returncode == 2 and "expected a whole number >= 1" in empty.stderr
    assert not (tmp_path / "empty").exists()


def test_a_replay_refuses_a_recovery_dir_another_replay_runs_on(tmp_path: Path) -> None:
    # Two replays on one --recovery-dir both ran, each reading the whole range (measured on
    # the real services: 80,000 messages read twice, the second run all duplicates).
    store = tmp_path / "replay"
    store.mkdir()
    with (store / ".job-lock-0").open("a+b") as held:  # what a running replay holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(b"4242")
        held.flush()
        refused = subprocess.run(
            [sys.executable, "-m", "cli", "replay", "--from-beginning", "--recovery-dir",
             str(store)], cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=20,
            check=False)
    assert refused.returncode == 2, refused.stderr[-1000:]
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("user-activity")]
    assert line == (f"user-activity replay: {store} is in use by another process (pid 4242: a"
                    " replay, or the job on its own store): wait for it to end, or pass another"
                    " directory")
    assert not any(store.glob("part-*"))


def test_a_replay_takes_a_recovery_dir_that_exists_and_holds_no_store(tmp_path: Path) -> None:
    """An empty directory (made by the operator or a volume mount) is a new replay's store.

    Before: the replay locked it once as an existing directory, then again once it made it,
    and a flock being per open file, it found itself the holder: "in use by another replay
    (pid <its own>)", exit 2, also on every resume of a replay stopped before its first store.
    """
    store = tmp_path / "replay"
    store.mkdir()
    out = io.StringIO()
    chosen = replay._recovery_dir(store, "favorites", "beginning", False, out,  # type: ignore[arg-type]
                                  min_free_bytes=0)
    assert chosen == store
    assert (store / "replay.json").exists()
    assert replay._recovery_dir(store, "favorites", "beginning", False, out,  # type: ignore[arg-type]
                                min_free_bytes=0) == store  # taken again by the same process
