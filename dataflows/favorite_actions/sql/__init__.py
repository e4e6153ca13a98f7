"""Named SQL queries, kept in ``.sql`` files next to this module."""

from __future__ import annotations

from functools import cache
from importlib import resources

_INCLUDE = "--@"


@cache
def query(name: str) -> str:
    """The text of ``{name}.sql``, a line ``--@other`` replaced by the text of ``other.sql``."""
    text = resources.files(__name__).joinpath(f"{name}.sql").read_text(encoding="utf-8")
    return "".join(query(line.strip()[len(_INCLUDE):]) if line.startswith(_INCLUDE) else line
                   for line in text.splitlines(keepends=True))
