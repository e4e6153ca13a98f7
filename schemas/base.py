"""The shared pydantic configuration of wire contracts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_pascal


class WireModel(BaseModel):
    """A frozen model whose wire names are PascalCase and which ignores unknown fields.

    Python attributes stay snake_case; ``model_dump(by_alias=True)`` writes the wire form.
    """

    model_config = ConfigDict(
        alias_generator=to_pascal,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        ser_json_timedelta="iso8601",
    )
