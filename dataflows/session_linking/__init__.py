"""The session-linking flow: user-signed-in -> LinkOnce -> session events (SPEC §7, issue 6).

Run it with ``python -m bytewax.run dataflows.session_linking:flow``. ``flow`` is built on first
access from the ``USER_ACTIVITY_*`` environment, so importing this package (or its pure step
modules) has no side effects; tests call ``build_flow(settings)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_flow", "flow"]


def __getattr__(name: str) -> Any:
    if name == "build_flow":
        from dataflows.session_linking.wiring import build_flow

        return build_flow
    if name == "flow":
        from dataflows.session_linking.wiring import build_flow
        from runtime.logs import configure_logging
        from runtime.settings import Settings

        settings = Settings()
        configure_logging(settings.log_level)
        return build_flow(settings)
    raise AttributeError(name)
