"""Export the JSON Schema of every wire contract to ``schemas/json/``, or check it has not drifted.

``python -m schemas.export`` (re)writes one ``<kebab-name>.schema.json`` per model and removes
stale ones; ``--check`` writes nothing and exits 1 listing the drifted files. The rendering is
deterministic, so a drift is always a real contract change.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from schemas.favorites import ActionTrackedEnvelope, FavoriteEnvelope
from schemas.sessions import (
    SessionEndedEnvelope,
    SessionLinkedEnvelope,
    SessionStartedEnvelope,
    UserSignedInEnvelope,
)

CONTRACT_MODELS: tuple[type[BaseModel], ...] = (
    FavoriteEnvelope,
    ActionTrackedEnvelope,
    UserSignedInEnvelope,
    SessionLinkedEnvelope,
    SessionStartedEnvelope,
    SessionEndedEnvelope,
)

SCHEMA_DIR = Path(__file__).resolve().parent / "json"

SCHEMA_SUFFIX = ".schema.json"

_WORD_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")


def schema_file_name(model: type[BaseModel]) -> str:
    """The schema file name: ``FavoriteEnvelope`` -> ``favorite-envelope.schema.json``."""
    return _WORD_BOUNDARY.sub("-", model.__name__).lower() + SCHEMA_SUFFIX


def render_schema(model: type[BaseModel]) -> str:
    """``model``'s validation JSON Schema with wire names: sorted keys, indent 2, final newline."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return json.dumps(schema, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _changes(directory: Path) -> dict[Path, str | None]:
    """Each schema file to (re)write with its text, or to delete (None): stale ones."""
    expected = {schema_file_name(model): render_schema(model) for model in CONTRACT_MODELS}
    changes: dict[Path, str | None] = {
        directory / name: text for name, text in expected.items()
        if _read_text(directory / name) != text}
    if directory.is_dir():
        changes |= {path: None for path in sorted(directory.glob(f"*{SCHEMA_SUFFIX}"))
                    if path.name not in expected}
    return changes


def drifted_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    """The schema files in ``directory`` that are missing, differ from their model, or are stale."""
    return list(_changes(directory))


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write every contract's changed schema into ``directory``, delete stale ones; the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    changes = _changes(directory)
    for path, text in changes.items():
        if text is None:
            path.unlink()
        else:
            path.write_text(text, encoding="utf-8")
    return list(changes)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code (1 = drift found by ``--check``)."""
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and list the files that drifted")
    parser.add_argument("--directory", type=Path, default=SCHEMA_DIR,
                        help=f"where the schema files live (default: {SCHEMA_DIR})")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    if args.check:
        drifted = drifted_schemas(directory)
        for path in drifted:
            print(f"drifted: {path}", file=sys.stderr)
        if drifted:
            print("run `python -m schemas.export` to regenerate", file=sys.stderr)
            return 1
        return 0
    for path in write_schemas(directory):
        print(f"updated: {path}")
    return 0


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
