"""Load the settings at an entry point: a bad setting is one clear line and exit code 2."""

from __future__ import annotations

import sys
from typing import NoReturn

from pydantic import ValidationError

from runtime.settings import ENV_PREFIX, Settings

_SECRETS = frozenset(
    name for name, info in Settings.model_fields.items() if "SecretStr" in str(info.annotation))


def describe(error: ValidationError) -> str:
    """``USER_ACTIVITY_X: problem (got 'value')`` for each invalid setting, joined by ``; ``."""
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "settings"
        given = item.get("input")
        shown = (f" (got {given!r})" if isinstance(given, (str, int, float, bool))
                 and field not in _SECRETS else "")
        problems.append(f"{ENV_PREFIX}{field.upper()}: {item['msg']}{shown}")
    return "; ".join(problems)


def exit_for(error: ValidationError) -> NoReturn:
    """Print the configuration problem on one line of stderr and exit 2."""
    print(f"user-activity: invalid configuration: {describe(error)}", file=sys.stderr,
          flush=True)
    raise SystemExit(2)


def load_settings() -> Settings:
    """The settings from the environment, or a one-line error and exit code 2."""
    try:
        return Settings()
    except ValidationError as error:
        exit_for(error)
