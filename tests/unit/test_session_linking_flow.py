"""The session-linking flow's entry point and its per-device dedup step (no services needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

from dataflows.dedup import DedupWindow
from dataflows.operators import DedupLogic
from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from schemas.kafka_record import SourceRecord

ROOT = Path(__file__).resolve().parents[2]
DEVICE = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")


def message(message_id: UUID) -> SignInMessage:
    value = json.dumps({
        "MessageId": str(message_id), "CreatedAt": "2026-11-29T08:00:00+00:00", "Version": 1,
        "AggregateId": "u", "AggregateType": "User",
        "Payload": {"UserId": str(uuid4()), "AnonymousId": str(DEVICE),
                    "SignedInAt": "2026-11-29T08:00:00+00:00"},
    }).encode()
    decoded = decode_sign_in(SourceRecord("in", 0, 0, None, value))
    assert isinstance(decoded, SignInMessage)
    return decoded


def test_bytewax_run_finds_the_session_linking_dataflow_by_its_module_attribute() -> None:
    script = (
        "from bytewax.run import _locate_dataflow\n"
        "flow = _locate_dataflow('dataflows.session_linking', 'flow')\n"
        "print(flow.flow_id, *[step.step_name for step in flow.substeps])\n"
    )
    env = {**os.environ, "USER_ACTIVITY_HTTP_PORT": "0"}

    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True, timeout=60,
    )

    names = done.stdout.split()
    assert names[0] == "session_linking"
    assert {"user_signed_in_input", "decode_sign_in", "dead_letter_poison",
            "reorder_by_signed_in_at", "dedup_by_message_id",
            "link_sessions_2_partitions"} <= set(names[1:])


def test_dedup_step_passes_a_message_id_once_per_device() -> None:
    first, second = message(uuid4()), message(uuid4())
    duplicates: list[Any] = []
    logic = DedupLogic(ttl=60.0, state=None, on_duplicate=duplicates.append)

    passed, _ = logic.on_batch([first, first, second])
    again, _ = logic.on_batch([second])

    assert passed == [first, second]
    assert again == []
    assert duplicates == [first, second]


def test_dedup_step_forgets_expired_ids_and_discards_an_empty_device() -> None:
    expired = DedupWindow(60.0)
    expired.admit(uuid4().bytes, now=0.0)  # expired long ago
    logic = DedupLogic(ttl=60.0, state=expired.snapshot(), on_duplicate=print)

    emitted, discard = logic.on_notify()

    assert emitted == []
    assert discard
    assert logic.notify_at() is None
