"""The shared pydantic configuration of wire contracts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_pascal


class WireModel(BaseModel):
    """A frozen, strict model whose wire names are PascalCase and which ignores unknown fields.

    Python attributes stay snake_case; only the PascalCase wire names are read (a snake_case
    key is an unknown field, ignored), and ``model_dump(by_alias=True)`` writes the wire form.
    Strict: a JSON number is not a datetime, ``true`` is not a Version, ``"1"`` is not an int;
    GUIDs and DateTimeOffsets still arrive as JSON strings, as .NET writes them.
    """

    model_config = ConfigDict(
        alias_generator=to_pascal,
        extra="ignore",
        frozen=True,
        strict=True,
        ser_json_timedelta="iso8601",
    )
