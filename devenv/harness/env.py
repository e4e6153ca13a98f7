"""Settings as the ``USER_ACTIVITY_*`` environment of a subprocess."""

from __future__ import annotations

import os
from enum import Enum

from pydantic import SecretStr

from runtime.settings import ENV_PREFIX, Settings


def settings_env(settings: Settings, **extra: str) -> dict[str, str]:
    """``settings`` as the variables that reproduce it (secrets in clear), then ``extra``."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            text = value.get_secret_value()
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, Enum):
            text = str(value.value)
        else:
            text = str(value)
        env[f"{ENV_PREFIX}{name.upper()}"] = text
    env.update(extra)
    return env


def base_env() -> dict[str, str]:
    """The current environment minus service or Bytewax settings that could leak in."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith((ENV_PREFIX, "BYTEWAX_"))},
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
