"""The Kafka source reports each poll to the backlog signal, against a real broker."""

from __future__ import annotations

import time

import pytest

from runtime.backlog import BACKLOG
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def test_a_full_poll_signals_a_backlog_and_a_short_one_ends_it(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(50)])
    source = KafkaInput(settings.kafka_client_config(), topic, tail=True, batch_size=10)
    part = source.build_part("input", f"{topic}#0", None)
    try:
        seen: list[int] = []
        saw_backlog = False
        deadline = time.monotonic() + 30
        while len(seen) < 50 and time.monotonic() < deadline:
            batch = part.next_batch()
            seen += [item.offset for item in batch if isinstance(item, SourceRecord)]
            if len(batch) == 10:
                assert BACKLOG.reading()  # this partition's poll came back full
                saw_backlog = True
            time.sleep(0.01)
        assert seen == list(range(50))
        assert saw_backlog
        part.next_batch()  # nothing left: the poll comes back short
        assert not BACKLOG.reading()
    finally:
        part.close()
    assert not BACKLOG.reading()
