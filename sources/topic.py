"""What the broker says of an input topic: its partitions, its id, its cleanup policy.

A compacted input topic loses unread events silently: said at start and by each check (ERROR,
the compacted gauge). While a tailed job runs, :meth:`TopicWatch.check` (called by partition 0's
poll) asks again every interval without waiting: partitions added, or the topic made again (its id
changed), is one line and exit 75 (the restart reads them). The topic missing or refused, at start
or later, is the unavailable gauge, ``/readyz`` 503 naming it and one ERROR line until it is back;
one missing at start is asked for at back-off steps, and its appearance is exit 75 (the restart
reads it). No answer is no news.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from typing import Any

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicCollection,
)
from confluent_kafka import TopicPartition as Tp
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from runtime.backoff import Backoff
from runtime.logs import log_event
from runtime.metrics import INPUT_TOPIC_COMPACTED, INPUT_TOPIC_UNAVAILABLE
from runtime.process import Process

logger = logging.getLogger(__name__)

NO_AUTO_CREATE = {"allow.auto.create.topics": False}  # a metadata request must not create it


def topic_id(admin: AdminClient, topic: str, timeout: float = 10.0) -> str | None:
    """The broker's id of ``topic`` (None when not told): a topic made again has another."""
    try:
        described = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)
        return str(described[topic].result(timeout + 1).topic_id)
    except (KafkaException, TimeoutError, ValueError, TypeError, AttributeError):
        return None


def cleanup_policy(admin: AdminClient, topic: str, timeout: float = 10.0) -> str | None:
    """``topic``'s ``cleanup.policy`` (None when not told)."""
    resource = ConfigResource("topic", topic)
    try:
        configs = admin.describe_configs([resource], request_timeout=timeout)[resource]
        return str(configs.result(timeout + 1)["cleanup.policy"].value)
    except (KafkaException, TimeoutError, KeyError, ValueError, TypeError, AttributeError):
        return None


def group_offsets(admin: AdminClient, group: str, topic: str, partitions: list[int]
                  ) -> dict[int, int]:
    """The offsets ``group`` committed on ``topic``; raises ``KafkaException`` unanswered."""
    asked = ConsumerGroupTopicPartitions(group, [Tp(topic, p) for p in partitions])
    answer = admin.list_consumer_group_offsets([asked])[group].result(15)
    return {tp.partition: tp.offset for tp in answer.topic_partitions if tp.offset >= 0}


class TopicWatch:
    """The periodic check of one input topic (see the module doc)."""

    def __init__(self, admin: AdminClient, topic: str, *, partitions: int,
                 known_id: str | None, interval: float, process: Process,
                 missing: str | None = None, backoff: Backoff | None = None) -> None:
        """Watch ``topic``; ``interval`` <= 0: an existing topic is not watched.

        ``missing``: the broker's error for a topic missing at start, asked for again at
        ``backoff``'s steps (None: never).
        """
        self._admin, self._topic, self._partitions, self._id = admin, topic, partitions, known_id
        self._health, self._stopping = process.health, process.stopping
        self._interval, self._backoff, self._attempt = interval, backoff, 0
        self.waits_for_topic = missing is not None
        self._asked: tuple[Future[Any], Future[Any]] | None = None
        self._unavailable, self._compacted = False, False
        self._due = self._next_due()
        self._say_unavailable(missing)  # a topic found: what a worker that missed it said ends

    def _next_due(self) -> float | None:
        """When to ask next (None: never)."""
        if self.waits_for_topic:
            if self._backoff is None:
                return None
            self._attempt += 1
            return time.monotonic() + self._backoff.delay(self._attempt - 1)
        return time.monotonic() + self._interval if self._interval > 0 else None

    def cleanup(self, policy: str | None) -> None:
        """Set the compacted gauge from ``policy``; said when it becomes compacted."""
        if policy is None:
            return
        compacted = "compact" in policy
        INPUT_TOPIC_COMPACTED.labels(self._topic).set(1 if compacted else 0)
        if compacted != self._compacted:
            self._compacted = compacted
            log_event(logger, "input-topic-compacted" if compacted else
                      "input-topic-not-compacted", logging.ERROR if compacted else logging.INFO,
                      topic=self._topic, cleanup_policy=policy)

    def check(self) -> None:
        """Ask when due; read the answers once they are in (never waits)."""
        if self._asked is None:
            if self._due is None or time.monotonic() < self._due:
                return
            self._due = self._next_due()
            resource = ConfigResource("topic", self._topic)
            self._asked = (
                self._admin.describe_topics(TopicCollection([self._topic]),
                                            request_timeout=5)[self._topic],
                self._admin.describe_configs([resource], request_timeout=5)[resource])
            return
        described, configs = self._asked
        if not (described.done() and configs.done()):
            return
        self._asked = None
        try:
            topic = described.result()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() > 0:  # the broker's answer
                self._say_unavailable(error.name())
            return
        self._say_unavailable(None)
        if self.waits_for_topic:
            self._restart("input-topic-appeared", logging.WARNING,
                          f"{self._topic} exists now: a restart reads it",
                          partitions=len(topic.partitions))
        elif self._id is not None and str(topic.topic_id) != self._id:
            self._restart("input-topic-recreated", logging.ERROR,
                          f"{self._topic} was deleted and created again",
                          topic_id=str(topic.topic_id), read_topic_id=self._id)
        elif len(topic.partitions) > self._partitions:
            self._restart("kafka-partitions-added", logging.WARNING,
                          f"{self._topic} has {len(topic.partitions)} partitions,"
                          f" {self._partitions} are read",
                          reading=self._partitions, partitions=len(topic.partitions))
        else:
            with contextlib.suppress(KafkaException, KeyError):
                self.cleanup(str(configs.result()["cleanup.policy"].value))

    def _restart(self, event: str, level: int, reason: str, **fields: Any) -> None:
        log_event(logger, event, level, topic=self._topic, **fields,
                  action="stopping cleanly (exit 75): the restart reads it")
        self._due = None
        self._stopping.restart(reason)

    def _say_unavailable(self, error: str | None) -> None:
        """The gauge, ``/readyz`` and, when it changes, one line."""
        INPUT_TOPIC_UNAVAILABLE.labels(self._topic).set(0 if error is None else 1)
        component = f"input {self._topic}"
        if error is None:
            self._health.unstalled(component)
        else:
            self._health.stalled(component, f"the broker answers {error}: none of its records"
                                 " are read" + (" (exit 75 once it exists)" if self.waits_for_topic
                                                else ""))
        if (error is not None) != self._unavailable:
            self._unavailable = error is not None
            fields = {"consequence": "nothing of it is read; the job restarts itself (exit 75)"
                                     " once it exists, and the restart reads it"
                      } if self.waits_for_topic and error is not None else {}
            log_event(logger, "input-topic-available" if error is None else
                      "input-topic-unavailable", logging.INFO if error is None else logging.ERROR,
                      topic=self._topic, error=error, **fields)
