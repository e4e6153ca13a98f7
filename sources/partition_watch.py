"""Partitions added to an input topic while the job runs: the job restarts itself to read them.

Bytewax lists a source's partitions once, when the dataflow starts
(``FixedPartitionedSource.list_parts``). Records on a partition added later (``kafka-topics
--alter --partitions``, or a producer-side scale-up) would wait unread, and unseen by every lag
gauge (they follow the partitions being read), until someone restarts the job. So every
``USER_ACTIVITY_SOURCE_PARTITION_CHECK_SECONDS`` (60 s) the watch asks the broker how many
partitions each tailed input topic has. Once one has more than were listed, it logs
``kafka-partitions-added`` and asks for a clean stop of the whole cluster
(:meth:`runtime.shutdown.Shutdown.restart`: the batch in flight commits, exit code 75), so the
supervisor starts the job again; the new partitions, which have no snapshot, then start at
``USER_ACTIVITY_STARTING_OFFSET`` (``earliest``, the default: their first record).

A topic deleted and created again under the same name (its id changed: its offsets start at 0
again) is said at ERROR (``input-topic-recreated``) and the job restarts the same way; its
partitions' snapshots hold the old id, so they read the new topic from its first record.

A broker that does not answer is skipped until the next check: the input partitions report the
outage themselves. A broker that answers with an error for a topic (``UNKNOWN_TOPIC_OR_PART``:
deleted; ``TOPIC_AUTHORIZATION_FAILED``: its ACLs changed) is said, because nothing else says
it: the consumers of a deleted topic read nothing and report no error (seen on this broker: none
in 30 s after the delete), and the high watermark they know stays frozen, so no lag gauge moves.
The watch sets ``user_activity_input_topic_unavailable{topic}`` to 1 and logs
``input-topic-unavailable`` at ERROR (once, until it is available again:
``input-topic-available``, and the gauge back at 0).

A topic's ``cleanup.policy`` changed to ``compact`` while the job runs loses unread events as
silently as one compacted from the start (:func:`sources.topic_id.cleanup_policy`), so the watch
reads it at each check too: ``user_activity_input_topic_compacted{topic}`` follows it, and
``input-topic-compacted`` is logged at ERROR when it becomes compacted
(``input-topic-not-compacted`` when it is no more).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from runtime.logs import log_event
from runtime.metrics import INPUT_TOPIC_COMPACTED, INPUT_TOPIC_UNAVAILABLE
from runtime.periodic import Periodic
from runtime.shutdown import SHUTDOWN
from sources.topic_id import cleanup_policy, topic_id

logger = logging.getLogger(__name__)

NO_AUTO_CREATE = {"allow.auto.create.topics": False}
"""For an admin client that asks for a topic's metadata: a producer-type handle's default (true)
lets a broker with ``auto.create.topics.enable`` create the topic it asks about, so the watch
would create a deleted input topic again with the broker's default partitions (seen on this
broker), and a job started before ``create-topics`` would create its own inputs."""


def report_cleanup_policy(topic: str, policy: str | None, said: bool,
                          log: logging.Logger = logger) -> bool:
    """Set ``topic``'s compacted gauge from ``policy``; whether it is now said compacted.

    ``said``: whether it was said compacted before (then it is not logged again). ``policy``
    None (the broker did not tell) changes nothing.
    """
    if policy is None:
        return said
    compacted = "compact" in policy
    INPUT_TOPIC_COMPACTED.labels(topic).set(1 if compacted else 0)
    if compacted and not said:
        log_event(log, "input-topic-compacted", logging.ERROR, topic=topic,
                  cleanup_policy=policy,
                  consequence="records compacted away before they are read are lost, and"
                              " not counted: set cleanup.policy=delete")
    elif said and not compacted:
        log_event(log, "input-topic-not-compacted", topic=topic, cleanup_policy=policy)
    return compacted


class PartitionWatch(Periodic):
    """Compares each topic's partition count on the broker with the count listed at start."""

    def __init__(self, admin: AdminClient, interval: float) -> None:
        super().__init__(interval, "partition-watch")
        self._admin = admin
        self._lock = threading.Lock()
        self._listed: dict[str, int] = {}
        self._ids: dict[str, str] = {}
        self._unavailable: set[str] = set()
        self._compacted: set[str] = set()  # said compacted (at start, or by a check)

    def listed(self, topic: str, count: int, topic_id: str | None = None, *,
               compacted: bool = False) -> None:
        """Record that the dataflow reads ``count`` partitions of ``topic`` (of id ``topic_id``).

        ``compacted``: the input said the topic compacted at start (not to be said again).
        """
        with self._lock:
            self._listed[topic] = max(count, self._listed.get(topic, 0))
            if topic_id is not None:
                self._ids.setdefault(topic, topic_id)
            if compacted:
                self._compacted.add(topic)

    def tick(self) -> bool:
        """Check every listed topic; False (no more checks) once a restart was asked for."""
        with self._lock:
            listed = dict(self._listed)
        for topic, count in listed.items():
            try:
                metadata = self._admin.list_topics(topic, timeout=10).topics.get(topic)
            except KafkaException:
                return True
            if metadata is None or metadata.error is not None:
                self._topic_unavailable(topic, metadata.error.name() if metadata and
                                        metadata.error else "UNKNOWN_TOPIC_OR_PART")
                continue
            self._topic_available(topic)
            if self._recreated(topic):
                return False
            self._check_cleanup(topic)
            now = len(metadata.partitions)
            if now > count:
                log_event(logger, "kafka-partitions-added", logging.WARNING, topic=topic,
                          reading=count, partitions=now,
                          action="stopping cleanly: the restart reads the new partitions")
                SHUTDOWN.restart(f"{topic} has {now} partitions, {count} are read")
                return False
        return True

    def _recreated(self, topic: str) -> bool:
        """Whether ``topic`` was deleted and created again since it was listed (then restart)."""
        with self._lock:
            listed_id = self._ids.get(topic)
        current = None if listed_id is None else topic_id(self._admin, topic)
        if current is None or current == listed_id:
            return False
        log_event(logger, "input-topic-recreated", logging.ERROR, topic=topic,
                  topic_id=current, read_topic_id=listed_id,
                  action="stopping cleanly: the restart reads the new topic from its first record")
        SHUTDOWN.restart(f"{topic} was deleted and created again")
        return True

    def _check_cleanup(self, topic: str) -> None:
        said = topic in self._compacted
        if report_cleanup_policy(topic, cleanup_policy(self._admin, topic), said):
            self._compacted.add(topic)
        else:
            self._compacted.discard(topic)

    def _topic_unavailable(self, topic: str, error: str) -> None:
        INPUT_TOPIC_UNAVAILABLE.labels(topic).set(1)
        if topic not in self._unavailable:
            self._unavailable.add(topic)
            log_event(logger, "input-topic-unavailable", logging.ERROR, topic=topic, error=error,
                      consequence="its partitions read nothing until the topic is back")

    def _topic_available(self, topic: str) -> None:
        INPUT_TOPIC_UNAVAILABLE.labels(topic).set(0)
        if topic in self._unavailable:
            self._unavailable.discard(topic)
            log_event(logger, "input-topic-available", topic=topic)


_watch: PartitionWatch | None = None
_watch_lock = threading.Lock()


def watch_partitions(
    client_config: Mapping[str, Any], topic: str, count: int, interval: float,
    topic_id: str | None = None, *, compacted: bool = False,
) -> None:
    """Watch ``topic`` (read on ``count`` partitions); the first call starts the watch thread.

    ``interval`` 0: no watch. One watch per process, for every topic of its dataflows.
    """
    global _watch  # noqa: PLW0603
    if interval <= 0:
        return
    with _watch_lock:
        if _watch is None:
            _watch = PartitionWatch(AdminClient({**client_config, **NO_AUTO_CREATE}),
                                    interval).start()
        _watch.listed(topic, count, topic_id, compacted=compacted)
