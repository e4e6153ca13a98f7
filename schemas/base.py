"""The shared pydantic configuration of wire contracts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_pascal


class WireModel(BaseModel):
    """A frozen, strict model whose wire names are PascalCase and which ignores unknown fields.

    Only the PascalCase names are read; strict: ``"1"`` is not an int, a number not a datetime.
    """

    model_config = ConfigDict(
        alias_generator=to_pascal,
        extra="ignore",
        frozen=True,
        strict=True,
        ser_json_timedelta="iso8601",
    )
