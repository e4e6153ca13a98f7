"""The Markdown docs' links between each other resolve, anchors included."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown() -> list[str]:
    return subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    anchors: set[str] = set()
    for heading in re.findall(r"(?m)^#+ (.+?)\s*$", text):
        slug = re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("name", _markdown())
def test_every_link_to_a_file_of_the_repository_resolves(name: str) -> None:
    source = ROOT / name
    text = re.sub(r"(?ms)^```.*?^```", "", source.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        if not linked.exists() or (anchor and linked.suffix == ".md"
                                   and anchor not in _anchors(linked)):
            broken.append(target)
    assert broken == []
