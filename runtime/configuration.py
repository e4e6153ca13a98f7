"""Load the settings at an entry point: a bad setting is one clear line and exit code 2."""

from __future__ import annotations

import sys

from pydantic import ValidationError

from runtime.settings import ENV_PREFIX, Settings

_SECRETS = frozenset(
    name for name, info in Settings.model_fields.items() if "SecretStr" in str(info.annotation))


def load_settings() -> Settings:
    """The settings from the environment, or ``USER_ACTIVITY_X: problem (got 'value')``, exit 2."""
    try:
        return Settings()
    except ValidationError as error:
        problems = []
        for item in error.errors():
            field = ".".join(str(part) for part in item["loc"]) or "settings"
            given = item.get("input")
            shown = (f" (got {given!r})" if isinstance(given, (str, int, float, bool))
                     and field not in _SECRETS else "")
            problems.append(f"{ENV_PREFIX}{field.upper()}: {item['msg']}{shown}")
        print(f"user-activity: invalid configuration: {'; '.join(problems)}", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None
