"""The recovery volume: its directory from Bytewax's command line, the start check, the crash line.

The real full volume (tmpfs) is in tests/e2e/test_recovery_volume_full.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from runtime.bytewax_0_21.recovery import (
    RECOVERY_VOLUME_FULL,
    VolumeSpace,
    is_short,
    measure,
    require_room,
    run_options,
)

ROOT = Path(__file__).resolve().parents[2]
RUN = "/venv/lib/python3.11/site-packages/bytewax/run.py"


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([RUN, "dataflows.favorite_actions:flow", "-r", "/rec", "-s", "30"], {}, "/rec"),
        ([RUN, "flows:flow", "--recovery-directory", "/rec", "-b", "300"], {}, "/rec"),
        ([RUN, "flows:flow", "--recovery-directory=/rec"], {}, "/rec"),
        ([RUN, "flows:flow", "-w", "2"], {"BYTEWAX_RECOVERY_DIRECTORY": "/env"}, "/env"),
        ([RUN, "flows:flow", "-r", "/rec"], {"BYTEWAX_RECOVERY_DIRECTORY": "/env"}, "/rec"),
        ([RUN, "flows:flow", "-w", "2"], {}, None),
    ],
)
def test_the_recovery_directory_is_the_one_bytewax_run_reads(
    argv: list[str], environ: dict[str, str], expected: str | None
) -> None:
    found = run_options(argv, environ).recovery_dir  # the one parser of Bytewax's options

    assert found == (None if expected is None else Path(expected))


def test_a_volume_is_short_below_the_minimum_and_never_when_the_minimum_is_zero() -> None:
    assert is_short(VolumeSpace(free_bytes=999, size_bytes=10_000), 1_000)
    assert not is_short(VolumeSpace(free_bytes=1_000, size_bytes=10_000), 1_000)
    assert not is_short(VolumeSpace(free_bytes=0, size_bytes=10_000), 0)


def test_the_start_check_logs_one_line_naming_the_directory_when_the_volume_is_short(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    space = measure(tmp_path)
    assert space is not None

    with caplog.at_level(logging.INFO, logger="runtime.bytewax_0_21.recovery"), pytest.raises(
            SystemExit) as refused:
        require_room(tmp_path, space.size_bytes + 1)

    assert refused.value.code == RECOVERY_VOLUME_FULL
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "recovery-volume-full")
    assert vars(record)["recovery_dir"] == str(tmp_path)
    assert vars(record)["exit_code"] == RECOVERY_VOLUME_FULL


def test_the_start_check_passes_with_room_a_zero_minimum_or_a_directory_it_cannot_ask(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="runtime.bytewax_0_21.recovery"):
        require_room(tmp_path, 1)
        require_room(tmp_path, 0)
        require_room(tmp_path / "missing", 1 << 62)  # Bytewax says what is missing

    assert caplog.records == []


def _crash_with(directory: Path, min_free_bytes: int) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(f"""
        from pathlib import Path
        from runtime.logs import configure_logging
        from runtime.bytewax_0_21.recovery import watch
        configure_logging("INFO")
        watch(Path({str(directory)!r}), {min_free_bytes})
        raise RuntimeError("SqliteFailure(DiskFull)")
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


def test_a_crash_while_the_volume_is_short_logs_the_line_then_the_traceback_and_exits_74(
    tmp_path: Path,
) -> None:
    space = measure(tmp_path)
    assert space is not None

    crashed = _crash_with(tmp_path, space.size_bytes + 1)

    assert crashed.returncode == RECOVERY_VOLUME_FULL
    [line] = [orjson.loads(x) for x in crashed.stderr.splitlines() if x.startswith("{")]
    assert line["event"] == "recovery-volume-full" and line["level"] == "ERROR"
    assert line["recovery_dir"] == str(tmp_path)
    assert "RuntimeError: SqliteFailure(DiskFull)" in crashed.stderr


def test_a_crash_with_room_on_the_volume_is_left_as_python_ends_it(tmp_path: Path) -> None:
    crashed = _crash_with(tmp_path, 1)

    assert crashed.returncode == 1
    assert "recovery-volume-full" not in crashed.stderr
    assert "RuntimeError: SqliteFailure(DiskFull)" in crashed.stderr
