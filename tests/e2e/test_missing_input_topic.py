"""An input topic missing at start: the others are read, it is named, and read once it exists.

Bytewax lists a source's partitions once, at start; the job used to retry that listing forever,
reading none of its inputs, and a SIGTERM then ended in exit 75. Now the missing topic is named
(one line, ``/readyz``, the unavailable gauge, ``user-activity check``), a SIGTERM is a clean
stop, and its appearance restarts the job (exit 75), whose next start reads it from its start.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from cli import check
from cli.topics import ensure_topics
from devenv.harness.jobs import SESSION_LINKING_FLOW, JobProcess, JobSupervisor
from devenv.harness.stream import PacedProducer, Stream, good_stream
from runtime.bytewax_0_21.recovery import stored_keys
from runtime.settings import Settings
from sources.topic import NO_AUTO_CREATE
from tests.chaos import assert_exact_outcome, count_rows, wait_until_drained
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e

UNAVAILABLE = "user_activity_input_topic_unavailable"


def _without(settings: Settings, field: str) -> Settings:
    """``settings`` whose topic ``field`` names a topic nobody made."""
    return settings.model_copy(update={field: f"{getattr(settings, field)}.missing"})


def _assert_named(job: JobProcess, topic: str, run: int) -> None:
    """The missing ``topic`` is one ERROR line of start ``run``, in ``/readyz`` and the gauge."""
    lines = [e for e in job.log_events(run) if e.get("event") == "input-topic-unavailable"]
    assert [(e["topic"], e["error"], e["level"]) for e in lines] == [
        (topic, "UNKNOWN_TOPIC_OR_PART", "ERROR")], lines
    ready = job.get("/readyz")
    assert ready is not None and ready.status == 503
    body = ready.json()
    assert body["state"] == "stalled" and f"input {topic}" in body["stalled"], body
    assert job.metric(f'{UNAVAILABLE}{{topic="{topic}"}}') == 1


def _assert_check_names(settings: Settings, flow: str, topic: str,
                        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert check.run(settings, [flow]) == 2
    assert f"user-activity check: topic {topic}: missing (its owners create it)" in \
        capsys.readouterr().err.splitlines()


def test_a_missing_input_topic_is_named_and_read_once_made(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _without(make_settings(), "topic_favorite_removed")
    missing = settings.topic_favorite_removed
    stream = good_stream(settings, database_url, 1_000, seed=46)
    added = Stream([r for r in stream.records if r.topic == settings.topic_favorite_added])
    removed = Stream([r for r in stream.records if r.topic == missing])
    job = jobs.job(settings, tail=True)
    job.start()
    first = PacedProducer(settings, added.records, rate=1_000)
    first.start()
    job.wait_until(lambda: count_rows(database_url, added.good_ids) == len(added.good_ids), 90,
                   "every favorite-added event recorded")
    _assert_named(job, missing, 1)
    _assert_check_names(settings, "favorites", missing, capsys)

    assert job.terminate(timeout=25) == 0, job.log_tail()  # a SIGTERM while it is missing
    job.start()  # resumes its placeholder's snapshot; still missing
    job.wait_until(lambda: any(e.get("event") == "input-topic-unavailable"
                               for e in job.log_events(2)), 60, "the topic named again")
    ensure_topics(settings.kafka_client_config(), [missing], 6)
    second = PacedProducer(settings, removed.records, rate=1_000)
    second.start()
    assert job.wait(60) == 75, job.log_tail()
    events = job.log_events(2)
    [appeared] = [e for e in events if e.get("event") == "input-topic-appeared"]
    assert (appeared["topic"], appeared["partitions"]) == (missing, 6)
    assert "stopped-for-restart" in {e.get("event") for e in events}

    job.start()  # what the supervisor does on exit code 75
    wait_until_drained(job, database_url, stream)
    assert job.metric(f'{UNAVAILABLE}{{topic="{missing}"}}') == 0
    ready = job.get("/readyz")
    assert ready is not None and ready.status == 200, ready and ready.json()
    assert job.terminate(timeout=25) == 0
    counts = assert_exact_outcome(settings, database_url, stream,
                                  [*first.result(), *second.result()])
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    assert job.exit_codes == [0, 75, 0]


def test_session_linking_with_its_input_missing_names_it_and_stops_cleanly(
    make_settings: SettingsFactory, jobs: JobSupervisor, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _without(make_settings(), "topic_user_signed_in")
    missing = settings.topic_user_signed_in
    job = jobs.job(settings, name="session-linking", flow=SESSION_LINKING_FLOW, tail=True)
    job.start()
    job.wait_until(lambda: job.metric(f'{UNAVAILABLE}{{topic="{missing}"}}') == 1, 60,
                   "the missing topic's gauge")
    _assert_named(job, missing, 1)
    _assert_check_names(settings, "session-linking", missing, capsys)
    assert job.terminate(timeout=25) == 0, job.log_tail()
    assert "stopped-during-outage" not in {e.get("event") for e in job.log_events(1)}


def test_an_input_topic_deleted_while_the_job_was_stopped_is_named_at_the_next_start(
    make_settings: SettingsFactory, jobs: JobSupervisor, record_property: Any,
) -> None:
    # Its partitions' snapshots are in the store: Bytewax 0.21.1 panics on a stored partition
    # the source does not list, so the missing topic lists them all.
    settings = make_settings()
    topic = settings.topic_user_signed_in
    job = jobs.job(settings, name="session-linking", flow=SESSION_LINKING_FLOW, tail=True)
    job.start()
    job.wait_until(lambda: _stored(job) == 6, 60, "a snapshot of every partition")
    assert job.terminate(timeout=25) == 0
    _delete(AdminClient({**settings.kafka_client_config(), **NO_AUTO_CREATE}), topic)

    job.start()
    job.wait_until(lambda: job.metric(f'{UNAVAILABLE}{{topic="{topic}"}}') == 1, 60,
                   "the deleted topic's gauge")
    _assert_named(job, topic, 2)
    assert job.terminate(timeout=25) == 0, job.log_tail()
    record_property("stored_partitions", _stored(job))


def _stored(job: JobProcess) -> int:
    """How many partitions of the sign-in input the job's recovery store holds."""
    return len(stored_keys(job.recovery_dir, "session_linking.user_signed_in_input"))


def _delete(admin: AdminClient, topic: str) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it."""
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 30
    while admin.list_topics(topic, timeout=10).topics[topic].error is None:
        assert time.monotonic() < deadline, f"{topic} still listed 30 s after its deletion"
        time.sleep(0.2)
