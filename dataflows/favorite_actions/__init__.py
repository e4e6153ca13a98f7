"""The favorites flow: favorite-added/removed -> action history + action-tracked (SPEC §4).

``python -m bytewax.run dataflows.favorite_actions:flow`` runs it (:mod:`dataflows.entry`);
importing this package has no side effects, tests call ``build_flow(settings)``.
"""

from __future__ import annotations

from typing import Any

from dataflows.entry import flow_attribute

__all__ = ["build_flow", "flow"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(name)
    return flow_attribute("dataflows.favorite_actions.flow", name)
