"""The favorites flow: favorite-added/removed -> action history + action-tracked (SPEC §4).

Run it with ``python -m bytewax.run dataflows.favorite_actions:flow``. ``flow`` is built on
first access from the ``USER_ACTIVITY_*`` environment, so importing this package (or its pure
step modules) has no side effects; tests call ``build_flow(settings)``.
"""

from __future__ import annotations

from typing import Any

from dataflows.entry import flow_attribute

__all__ = ["build_flow", "flow"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(name)
    return flow_attribute("dataflows.favorite_actions.flow", name)
