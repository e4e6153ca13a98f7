"""Dataflows: one package per flow, pure steps plus the Bytewax wiring (``build_flow``)."""
