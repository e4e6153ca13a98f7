"""One 3-node Kafka cluster (SASL/PLAIN users, ACLs enforced) shared by the tests in this folder.

Each test here is marked ``xdist_group("kafka-cluster")``: under pytest-xdist (``--dist
loadgroup``) they all run on one worker, which starts one cluster for them.  With
``USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS`` set (external services, maybe no Java) they skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from devenv.harness.broker_faults import cluster_job_settings
from devenv.kafka_cluster import KafkaCluster
from runtime.settings import Settings
from tests.support import scratch_database

USERS = {"job": "job-secret", "other": "other-secret"}
"""The cluster's users besides ``admin``, with their passwords (no ACLs at first)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): run on the same pytest-xdist worker")


@pytest.fixture(scope="package")
def shared_kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """The folder's cluster, started on first use; every JVM is SIGKILLed after its last test.

    Its tests run one after another on one worker (their group), so the three JVMs do not idle
    through the rest of that worker's session.

    If the run is killed instead, each JVM gets SIGKILL from the kernel (``die_with_parent``).
    """
    if os.environ.get("USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS"):
        pytest.skip("external services configured: no local Kafka cluster")
    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster"), users=USERS)
    try:
        began = time.monotonic()
        cluster.start()
        print(f"{len(cluster.nodes)}-node cluster format + start + ready: "
              f"{time.monotonic() - began:.2f}s")
        yield cluster
    finally:
        for node in cluster.nodes:
            cluster.kill(node)


@pytest.fixture
def kafka_cluster(shared_kafka_cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The shared cluster; what a test froze or stopped runs again after it (``heal``)."""
    yield shared_kafka_cluster
    shared_kafka_cluster.heal()


@pytest.fixture
def own_database(database_url: str) -> Iterator[str]:
    """A migrated database of the test's own (the cluster's topics exist nowhere else)."""
    with scratch_database(database_url, "cluster", migrated=True) as dsn:
        yield dsn


@pytest.fixture
def cluster_settings(kafka_cluster: KafkaCluster, own_database: str) -> Callable[..., Settings]:
    """``(prefix, user, **overrides)`` -> the settings of a job on the cluster as ``user``.

    Every topic and both groups are named ``<prefix>.<name>``; the database is ``own_database``.
    """

    def factory(prefix: str, user: str, **overrides: Any) -> Settings:
        return cluster_job_settings(kafka_cluster, own_database, prefix, user, **overrides)

    return factory
