"""Operator commands on the top floor: ``user-activity <command>`` / ``python -m cli``."""
