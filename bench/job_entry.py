"""``python -m bytewax.run`` with experiment patches, for the RSS probe only (not production).

``BENCH_CONSUMER_OVERRIDES`` (a JSON object) is merged into the configuration of every
confluent-kafka ``Consumer`` the job creates (the Kafka input opens one per partition). The
patch is applied before the flow module is imported, so its ``from confluent_kafka import
Consumer`` picks it up.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import confluent_kafka

_overrides: dict[str, Any] = json.loads(os.environ.get("BENCH_CONSUMER_OVERRIDES", "{}"))


class _PatchedConsumer(confluent_kafka.Consumer):
    def __init__(self, config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__({**config, **_overrides}, *args, **kwargs)


if _overrides:
    confluent_kafka.Consumer = _PatchedConsumer  # type: ignore[misc,assignment]

sys.argv[0] = "bytewax.run"
runpy.run_module("bytewax.run", run_name="__main__", alter_sys=True)
