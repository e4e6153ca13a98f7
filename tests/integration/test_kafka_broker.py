"""Tests of devenv.kafka_broker against a real Kafka broker (JVM from Maven Central jars)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from devenv.kafka_broker import KAFKA_VERSION, POM_FILE, KafkaBroker, create_topics, fetch_jars

ROOT = Path(__file__).resolve().parents[2]
N_MESSAGES = 100
PARTITIONS = 6

Records = dict[tuple[int, int], tuple[bytes, bytes]]  # (partition, offset) -> (key, value)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    began = time.monotonic()
    with KafkaBroker(tmp_path_factory.mktemp("kafka")) as b:
        print(f"format + start + ready: {time.monotonic() - began:.2f}s")
        yield b


def _topic() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def _messages(n: int, tag: str) -> list[tuple[bytes, bytes]]:
    return [(f"key-{i}".encode(), f"{tag}-value-{i}".encode()) for i in range(n)]


def _produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> Records:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5}
    )
    delivered: Records = {}
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            key, value = msg.key(), msg.value()
            assert isinstance(key, bytes) and isinstance(value, bytes)
            delivered[(msg.partition() or 0, msg.offset() or 0)] = (key, value)

    for key, value in messages:
        producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
    assert producer.flush(30) == 0, "messages still in flight after 30 s"
    assert errors == []
    assert len(delivered) == len(messages)
    return delivered


def _consume(bootstrap: str, topic: str, expected: int, timeout: float = 60.0) -> Records:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:10]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got: Records = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            assert err is None, err
            key, value = msg.key(), msg.value()
            assert isinstance(key, bytes) and isinstance(value, bytes)
            got[(msg.partition() or 0, msg.offset() or 0)] = (key, value)
        # Nothing beyond what was produced shows up.
        extra = consumer.consume(num_messages=10, timeout=0.5)
        assert [m for m in extra if m.error() is None] == []
    finally:
        consumer.close()
    return got


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_pom_pins_the_module_version() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pinned = ET.parse(POM_FILE).getroot().findtext("m:properties/m:kafka.version", namespaces=ns)
    assert pinned == KAFKA_VERSION


def test_fetch_jars_is_a_no_op_once_done(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = fetch_jars()  # what scripts/bootstrap.sh runs (python -m devenv.kafka_broker fetch)
    before = {p.name: p.stat().st_mtime_ns for p in lib.glob("*.jar")}
    monkeypatch.setenv("PATH", "/nonexistent")  # were Maven needed, fetch_jars would raise
    assert fetch_jars() == lib
    assert {p.name: p.stat().st_mtime_ns for p in lib.glob("*.jar")} == before
    assert (lib / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file()


@pytest.mark.e2e
def test_produce_consume_100_messages(broker: KafkaBroker) -> None:
    topic = _topic()
    create_topics(broker.bootstrap, [topic], partitions=PARTITIONS)
    create_topics(broker.bootstrap, [topic], partitions=PARTITIONS)  # idempotent

    md = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(topic, timeout=10)
    assert len(md.topics[topic].partitions) == PARTITIONS

    sent = _messages(N_MESSAGES, "a")
    delivered = _produce(broker.bootstrap, topic, sent)
    assert sorted(delivered.values()) == sorted(sent)
    assert {p for p, _ in delivered} == set(range(PARTITIONS))

    consumed = _consume(broker.bootstrap, topic, N_MESSAGES)
    assert consumed == delivered


@pytest.mark.e2e
def test_stop_and_restart_on_same_port_keeps_messages(broker: KafkaBroker) -> None:
    topic = _topic()
    create_topics(broker.bootstrap, [topic])
    bootstrap, port = broker.bootstrap, broker.port
    delivered = _produce(bootstrap, topic, _messages(N_MESSAGES, "b"))

    broker.stop()  # SIGTERM: clean shutdown
    assert not broker.is_running()
    assert not _port_open(port)
    began = time.monotonic()
    assert broker.start() == bootstrap
    restart = time.monotonic() - began
    assert _consume(bootstrap, topic, N_MESSAGES) == delivered

    broker.kill()  # SIGKILL: crash
    assert not broker.is_running()
    began = time.monotonic()
    assert broker.start() == bootstrap
    print(f"restart after stop: {restart:.2f}s, after kill: {time.monotonic() - began:.2f}s")
    assert _consume(bootstrap, topic, N_MESSAGES) == delivered

    more = _produce(bootstrap, topic, _messages(10, "c"))  # still writable after restarts
    assert _consume(bootstrap, topic, N_MESSAGES + 10) == delivered | more


@pytest.mark.e2e
def test_cli_start_status_create_topics_stop(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "devenv.kafka_broker", *args, "--run-dir", str(tmp_path)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    started = cli("start")
    pid = KafkaBroker(tmp_path).pid
    try:
        assert started.returncode == 0, started.stderr
        bootstrap = started.stdout.strip().splitlines()[-1]
        assert bootstrap.startswith("127.0.0.1:")

        status = cli("status")
        assert status.returncode == 0, status.stderr
        assert status.stdout.strip().splitlines()[-1] == bootstrap

        topics = cli("create-topics", "cli-a", "cli-b")
        assert topics.returncode == 0, topics.stderr
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        assert {len(md.topics[t].partitions) for t in ("cli-a", "cli-b")} == {PARTITIONS}
    finally:
        stopped = cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert cli("status").returncode == 1
    assert not _port_open(int(bootstrap.rsplit(":", 1)[1]))
    assert pid is not None and not KafkaBroker(tmp_path).is_running()
