"""README.md is the front door: at most 8 KB, and every test it names exists."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _expanded(path: str) -> list[str]:
    """``a_{b,c}.py`` -> ``a_b.py``, ``a_c.py`` (shell-style braces, as the README writes them)."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(chosen) for chosen in itertools.product(*choices)]


def test_the_readme_is_at_most_8_kb() -> None:
    assert len(README.read_bytes()) <= 8_000


def test_every_test_file_the_readme_names_exists() -> None:
    named = re.findall(r"`((?:e2e|integration|unit)/[^`:]*?\.py)", README.read_text())
    assert named
    missing = [path for name in named for path in _expanded(name)
               if not (ROOT / "tests" / path).is_file()]
    assert not missing
