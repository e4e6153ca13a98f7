"""Named SQL queries of the outbox, kept in ``.sql`` files next to this module."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def query(name: str) -> str:
    """The text of ``{name}.sql``."""
    return resources.files(__name__).joinpath(f"{name}.sql").read_text(encoding="utf-8")
