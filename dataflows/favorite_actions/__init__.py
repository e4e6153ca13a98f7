"""The favorites flow: favorite-added/removed -> action history + action-tracked (SPEC §4).

``python -m bytewax.run dataflows.favorite_actions:flow`` runs it (:mod:`dataflows.entry`);
importing this package has no side effects, tests call ``build_flow(settings)``.
"""

from typing import Any

from dataflows.entry import flow_attribute


def __getattr__(name: str) -> Any:
    return flow_attribute(f"{__name__}.flow", name)
