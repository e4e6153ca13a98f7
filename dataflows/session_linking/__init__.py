"""The session-linking flow: user-signed-in -> LinkOnce -> session events (SPEC §7, issue 6).

``python -m bytewax.run dataflows.session_linking:flow`` runs it (:mod:`dataflows.entry`);
importing this package has no side effects, tests call ``build_flow(settings)``.
"""

from typing import Any

from dataflows.entry import flow_attribute


def __getattr__(name: str) -> Any:
    return flow_attribute(f"{__name__}.flow", name)
