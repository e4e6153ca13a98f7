"""The session-linking flow: user-signed-in -> LinkOnce -> session events (SPEC §7, issue 6).

``python -m bytewax.run dataflows.session_linking:flow`` runs it (:mod:`dataflows.entry`);
importing this package has no side effects, tests call ``build_flow(settings)``.
"""

from __future__ import annotations

from typing import Any

from dataflows.entry import flow_attribute

__all__ = ["build_flow", "flow"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(name)
    return flow_attribute("dataflows.session_linking.flow", name)
