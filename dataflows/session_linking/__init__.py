"""The session-linking flow: user-signed-in -> LinkOnce -> session events (SPEC §7, issue 6).

Run it with ``python -m bytewax.run dataflows.session_linking:flow``. ``flow`` is built on first
access from the ``USER_ACTIVITY_*`` environment, so importing this package (or its pure step
modules) has no side effects; tests call ``build_flow(settings)``.
"""

from __future__ import annotations

from typing import Any

from dataflows.entry import flow_attribute

__all__ = ["build_flow", "flow"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(name)
    return flow_attribute("dataflows.session_linking.flow", name)
