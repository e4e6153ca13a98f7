"""README.md is the front door: its sections, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REQUIRED_HEADINGS = ("The flows", "Commands", "Configuration", "Guarantees", "Folder map",
                     "Documentation")
NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _headings(text: str) -> list[str]:
    return re.findall(r"(?m)^#+ (.+?)\s*$", text)


def test_the_readme_has_every_section_a_newcomer_needs() -> None:
    headings = _headings(README.read_text())

    assert [h for h in REQUIRED_HEADINGS if h not in headings] == []


def test_every_guarantee_row_names_a_test() -> None:
    text = README.read_text()
    section = text.split("## Guarantees", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| guarantee", "|---"))]

    assert rows
    assert [row for row in rows if not NAMED_TEST.search(row.rsplit(" | ", 1)[-1])] == []


def test_every_test_the_readme_names_exists() -> None:
    named = NAMED_TEST.findall(README.read_text())

    assert named
    missing = [f"{path}::{name}" for path, name in named
               if not (ROOT / path).is_file()
               or not re.search(rf"(?m)^(async )?def {name}\(", (ROOT / path).read_text())]
    assert missing == []


def test_the_readme_links_the_commands_it_promises() -> None:
    text = README.read_text()

    for command in ("scripts/run-job.sh", "bash scripts/test.sh", ".venv/bin/pytest tests/unit"):
        assert command in text
