"""``python -m devenv.deploy --image TAG``: k8s/'s Jobs and StatefulSets as containers, checked.

Starts Kafka and PostgreSQL on loopback, gives the ConfigMap and the example Secret local values,
translates the pods (:mod:`devenv.deploy.pods`), runs them (:mod:`devenv.deploy.kubelet`) and
runs :data:`STEPS` in order, each a row of the summary table (step, result, seconds, what it
found); a failed step skips the rest. Every count reads PostgreSQL and Kafka, not logs (but the
outbox lease holder and replayed duplicates, which only the pods' logs tell). The containers
and services are removed at the end; exit 1 when a step failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from cli.topics import ensure_topics
from devenv.deploy.kubelet import Kubelet, probe_until
from devenv.deploy.pods import API_PORT, Container, Manifests, Pod, pod_hosts, translate_pod
from devenv.harness.messages import favorite_envelope, sign_in_envelope
from devenv.harness.metrics import scrape
from devenv.harness.ports import free_port
from devenv.harness.sessions import seed_owners

ROOT = Path(__file__).resolve().parents[2]
FAVORITES, LINKING = "user-activity-favorites", "user-activity-session-linking"
CONFIG, SECRETS = "user-activity-stream-config", "user-activity-stream-secrets"
BACKLOG, LIVE, LIVE_SECONDS, AFTER_STOP, SIGN_INS = 3000, 1500, 9.0, 300, 5
"""Favorites before the cluster starts; during the SIGKILL (over LIVE_SECONDS); after the
SIGTERM of all pods; sign-ins for session linking."""
SNAPSHOT_WAIT_SECONDS = 35.0  # > the StatefulSet's -s 30: a snapshot covers the backlog


class StepFailed(AssertionError):
    """A step's check did not hold."""


@dataclasses.dataclass
class Row:
    """One line of the summary table."""

    step: str
    result: str = "skipped"
    seconds: float = 0.0
    detail: str = ""


class Deployment:
    """The translated manifests, the pods started so far, the services, the table."""

    def __init__(self, image: str, run_dir: Path, docker: str) -> None:
        self.image, self.run_dir, self.kubelet = image, run_dir, Kubelet(docker)
        self.rows: list[Row] = []
        self.pods: dict[str, Pod] = {}
        self.favorite_ids: list[uuid.UUID] = []
        self.devices: list[uuid.UUID] = []
        self.backlog_window: tuple[str, ...] = ()
        self.services: list[Any] = []
        self.dsn = self.bootstrap = ""
        self.manifests = Manifests.load(ROOT / "k8s")
        self.settings = self.manifests.data("ConfigMap", CONFIG)
        shm = Path("/dev/shm")  # noqa: S108 - a tmpfs for emptyDirs of medium: Memory
        self.memory_dir = Path(tempfile.mkdtemp(prefix="user-activity-deploy-test-",
                                                dir=shm if shm.is_dir() else None))

    @property
    def failed(self) -> bool:
        """Whether a step failed."""
        return any(r.result == "FAIL" for r in self.rows)

    @contextmanager
    def step(self, name: str) -> Iterator[Row]:
        """Time a step; an exception marks it FAIL (and every later step skipped)."""
        row, started = Row(name), time.monotonic()
        skip = self.failed
        self.rows.append(row)
        try:
            yield row
            row.result = "skipped" if skip else "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table, then the cleanup
            row.result, row.detail = "FAIL", f"{type(error).__name__}: {error}"[:2000]
            traceback.print_exc()
        row.seconds = round(time.monotonic() - started, 1)
        print(f"[deploy-test] {row.step}: {row.result} ({row.seconds} s) {row.detail}", flush=True)

    def start_services(self) -> str:
        """Kafka and PostgreSQL on loopback (fresh data); the ConfigMap and Secret's test values."""
        from devenv.kafka_broker import KafkaBroker
        from devenv.postgres_server import PostgresServer

        shutil.rmtree(self.run_dir / "services", ignore_errors=True)
        postgres = PostgresServer(self.run_dir / "services" / "postgres")
        self.services.append(postgres)
        postgres.start()
        self.dsn = postgres.create_database("user_activity")
        broker = KafkaBroker(self.run_dir / "services" / "kafka")
        self.services.append(broker)
        self.bootstrap = broker.start(fresh=True)
        config = {"USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
                  "USER_ACTIVITY_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}
        plaintext = ("USER_ACTIVITY_KAFKA_SASL_MECHANISM", "USER_ACTIVITY_KAFKA_SSL_CA_LOCATION")
        no_sasl = ("USER_ACTIVITY_KAFKA_SASL_USERNAME", "USER_ACTIVITY_KAFKA_SASL_PASSWORD")
        self.manifests = (
            self.manifests.with_values("ConfigMap", CONFIG, config, without=plaintext)
            .with_values("Secret", SECRETS, {"USER_ACTIVITY_DATABASE_URL": self.dsn},
                         without=no_sasl)
            .with_values("Secret", "user-activity-kafka-ca", {"ca.crt": "(PLAINTEXT here)\n"}))
        self.settings = self.manifests.data("ConfigMap", CONFIG)
        return (f"Kafka {self.bootstrap}, PostgreSQL {self.dsn.rsplit('@', 1)[-1]}; ConfigMap: "
                f"{config} without {plaintext}; Secret: the database URL, without {no_sasl}")

    def pod(self, workload: dict[str, Any], name: str, ip: str,
            hosts: dict[str, str] | None = None) -> Pod:
        """Translate one pod (its Bytewax API port gets a free host port); print the changes."""
        ports = {int(e["value"]): free_port() for c in workload["spec"]["template"]["spec"][
            "containers"] for e in c.get("env", []) if e["name"] == API_PORT}
        pod = translate_pod(self.manifests, workload, pod_name=name, pod_ip=ip, image=self.image,
                            pod_dir=self.run_dir / "pods" / name,
                            claims_dir=self.run_dir / "claims", hosts=hosts, ports=ports,
                            memory_dir=self.memory_dir)
        for change in pod.changes:
            print(f"[translate] {change}", flush=True)
        self.pods[name] = pod
        return pod

    def favorites(self, replace: int | None = None) -> list[Pod]:
        """The favorites StatefulSet's pods (127.0.10.<ordinal + 1>), translated on first use."""
        workload = self.manifests.get_copy("StatefulSet", FAVORITES)
        ips = [f"127.0.10.{i + 1}" for i in range(int(workload["spec"]["replicas"]))]
        for i, ip in enumerate(ips):
            if f"{FAVORITES}-{i}" not in self.pods or i == replace:
                self.pod(workload, f"{FAVORITES}-{i}", ip, pod_hosts(workload, ips))
        return [self.pods[f"{FAVORITES}-{i}"] for i in range(len(ips))]

    def run_job(self, job_name: str, ip: str, edit: Callable[[dict[str, Any]], None] | None = None,
                suffix: str = "0", timeout: float = 600.0) -> str:
        """A Job's pod ``<job>-<suffix>`` to completion (``edit``: the template edited first)."""
        job = self.manifests.get_copy("Job", job_name)
        if edit is not None:
            edit(job)
        pod = self.pod(job, f"{job_name.rstrip('-')}-{suffix}", ip)
        self.kubelet.start_pod(pod)
        [container] = pod.containers.values()
        try:
            return self.kubelet.completed(container.name, timeout)
        finally:
            self.save_log(container)

    def save_log(self, container: Container) -> None:
        """Keep a container's log in ``run_dir/logs``."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs" / f"{container.name}.log").write_text(
            self.kubelet.logs(container.name))

    def probe_pod(self, pod: Pod) -> str:
        """The stream container's startup, liveness, readiness probes; both /metrics ports."""
        stream = pod.containers["stream"]
        took = [f"{kind} {probe_until(stream.probes[kind], budget)}s"
                for kind, budget in (("startup", None), ("liveness", None), ("readiness", 240.0))]
        ours = scrape(int(stream.env["USER_ACTIVITY_HTTP_PORT"]), pod.ip)
        if not any(name.startswith("user_activity_") for name, _labels in ours):
            raise StepFailed(f"{pod.name}: no user_activity_* on /metrics")
        return f"{pod.name}: {', '.join(took)}, /metrics {len(ours)} samples"

    def bytewax_metrics(self, pod: Pod, timeout: float = 60.0) -> int:
        """How many ``bytewax_*`` samples the pod's Bytewax API serves (waits for the first)."""
        port, deadline = int(pod.containers["stream"].env[API_PORT]), time.monotonic() + timeout
        while not (count := sum(1 for name, _ in scrape(port) if name.startswith("bytewax_"))):
            if time.monotonic() > deadline:
                raise StepFailed(f"{pod.name}: no bytewax_* on :{port}/metrics")
            time.sleep(2.0)
        return count

    def replayed(self, pods: Sequence[Pod], since: datetime) -> int:
        """``skipped-duplicate`` events in the stream containers' logs (every run) since then."""
        stamp = since.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return sum(self.kubelet.logs(p.containers["stream"].name, since=stamp).count(
            '"event":"skipped-duplicate"') for p in pods)

    def wait_ready(self, pods: Sequence[Pod], budget: float = 240.0) -> None:
        """The readiness probe of each pod's stream container succeeds within ``budget`` s."""
        for pod in pods:
            probe_until(pod.containers["stream"].probes["readiness"], budget)

    def exactness(self) -> dict[str, int]:
        """Rows per produced favorite (PostgreSQL) and action-tracked records per row (Kafka)."""
        topic = self.settings["USER_ACTIVITY_TOPIC_ACTION_TRACKED"]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT id::text, source_message_id FROM user_activity.action_events").fetchall()
        per_message = Counter(source for _id, source in rows)
        per_row = Counter(str(r["AggregateId"]) for r in consume_json(self.bootstrap, topic))
        wanted = set(self.favorite_ids)
        return {"messages": len(wanted), "rows": len(rows),
                "messages_without_row": sum(1 for m in wanted if per_message[m] == 0),
                "messages_with_two_rows": sum(1 for n in per_message.values() if n > 1),
                "tracked_records": sum(per_row.values()),
                "rows_announced_once": sum(1 for row_id, _ in rows if per_row[row_id] == 1),
                "rows_announced_twice": sum(1 for n in per_row.values() if n > 1),
                "unpublished": unpublished(self.dsn, topic)}

    def wait_exact(self, timeout: float = 240.0) -> dict[str, int]:
        """Wait until every produced favorite has one row and its one published action-tracked."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.exactness()
            lost_or_waiting = (found["messages_without_row"] or found["unpublished"]
                               or found["rows_announced_once"] != found["rows"])
            doubled = found["messages_with_two_rows"] or found["rows_announced_twice"]
            if found["rows"] == found["messages"] == found["tracked_records"] and not (
                    lost_or_waiting or doubled):
                return found
            if doubled or time.monotonic() > deadline:
                raise StepFailed(f"not exactly once: {found}")
            time.sleep(2.0)

    def produce(self, count: int, seed: int, seconds: float = 0.0) -> None:
        """Produce ``count`` favorites of the seeded devices on both topics; each must be recorded.

        With ``seconds``: in 10 bursts spread over that long.
        """
        topics = [self.settings["USER_ACTIVITY_TOPIC_FAVORITE_ADDED"],
                  self.settings["USER_ACTIVITY_TOPIC_FAVORITE_REMOVED"]]
        producer = Producer({"bootstrap.servers": self.bootstrap, "acks": "all", "linger.ms": 10,
                             "enable.idempotence": True})
        bursts = 10 if seconds else 1
        for i in range(count):
            envelope = favorite_envelope(anonymous_id=self.devices[(seed * 7919 + i)
                                                                   % len(self.devices)],
                                         occurred_at=datetime.now(UTC).isoformat())
            producer.produce(topics[i % 2], key=str(envelope["AggregateId"]).encode(),
                             value=orjson.dumps(envelope))
            self.favorite_ids.append(uuid.UUID(envelope["MessageId"]))
            if seconds and (i + 1) % -(-count // bursts) == 0 and i + 1 < count:
                producer.flush(60)
                time.sleep(seconds / bursts)
        producer.flush(60)


def consume_json(bootstrap: str, topic: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every record of ``topic`` up to the end offsets seen now, as JSON."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"deploy-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in partitions}
        pending = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found, deadline = [], time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:
                    continue
                partition, offset = msg.partition() or 0, msg.offset() or 0
                if offset < ends[partition]:
                    found.append(orjson.loads(msg.value() or b"null"))
                if offset >= ends[partition] - 1:
                    pending.discard(partition)
        if pending:
            raise TimeoutError(f"{topic}: partitions {sorted(pending)} not read to their end")
        return found
    finally:
        consumer.close()


def unpublished(dsn: str, topic: str) -> int:
    """Outbox rows of ``topic`` not yet published."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM user_activity.outbox_unpublished"
                           " WHERE topic = %s", (topic,)).fetchone()
    return int(row[0]) if row else 0


def holds_lease(log: str) -> bool:
    """Whether a container's log ends holding the outbox lease (its last take not released)."""
    events = re.findall(r'"outbox-lease-(taken|released)"', log)
    return bool(events) and events[-1] == "taken"


# ---- the steps -------------------------------------------------------------------------------


def read_only_check(d: Deployment) -> str:
    """The migrate Job's container, with a shell: who it runs as and where it can write."""
    script = (
        'echo "uid=$(id -u) gid=$(id -g)"; '
        "for p in / /app /opt/venv /etc /usr /var /var/lib/user-activity /nonexistent; do "
        '  if touch "$p/.deploy-test" 2>/dev/null; then echo "WROTE $p"; fi; done; '
        'touch /tmp/.deploy-test && echo "WROTE-MOUNT /tmp"; '
        "python -c \"import zoneinfo; zoneinfo.ZoneInfo('Europe/Berlin')\" && echo TZDATA-OK; "
        "find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o "
        "-type d -writable -print 2>/dev/null | sed 's/^/WRITABLE-DIR /'")

    def shell(job: dict[str, Any]) -> None:
        container = job["spec"]["template"]["spec"]["containers"][0]
        container.update(command=["/bin/sh", "-c", script], args=[])

    log = d.run_job("user-activity-migrate", "127.0.12.1", shell, suffix="rootfs-check",
                    timeout=120)
    [run] = d.pods["user-activity-migrate-rootfs-check"].containers.values()
    wrote = re.findall(r"^WROTE (\S+)", log, re.M)
    writable = sorted(set(re.findall(r"^WRITABLE-DIR (\S+)", log, re.M)))
    stray = [p for p in writable if not any(p == m.target or p.startswith(m.target + "/")
                                            for m in run.mounts)]
    for wrong, found in (("not uid/gid 10001", "uid=10001 gid=10001" not in log),
                         (f"the root filesystem is writable at {wrote}", bool(wrote)),
                         ("the /tmp emptyDir is not writable", "WROTE-MOUNT /tmp" not in log),
                         ("no time zone database (tzdata)", "TZDATA-OK" not in log),
                         (f"writable outside the mounts: {stray}", bool(stray))):
        if found:
            raise StepFailed(f"{wrong}: {log[-300:]}")
    return (f"uid=10001 gid=10001; writes to / /app /opt/venv /etc /usr /var failed; writable "
            f"dirs: {writable} (= the mounts); time zones readable")


def _last_line(log: str) -> str:
    return (log.strip().splitlines() or ["exit 0"])[-1][:150]


def migrate(d: Deployment) -> str:
    """The migrate Job as written: exit 0."""
    return _last_line(d.run_job("user-activity-migrate", "127.0.12.2"))


def create_topics(d: Deployment) -> str:
    """The create-topics Job as written: exit 0; then the input topics, as their owners would."""
    log = d.run_job("user-activity-create-topics", "127.0.12.3")
    ensure_topics({"bootstrap.servers": d.bootstrap}, [d.settings[
        f"USER_ACTIVITY_TOPIC_{name}"] for name in ("FAVORITE_ADDED", "FAVORITE_REMOVED",
                                                    "USER_SIGNED_IN")], 6)
    return f"{_last_line(log)}; inputs made"


def backlog(d: Deployment) -> str:
    """Seed 400 guest sessions; produce the backlog before any dataflow pod runs."""
    d.devices, _users = seed_owners(d.dsn, 400, 0)
    start = datetime.now(UTC) - timedelta(seconds=1)
    d.produce(BACKLOG, seed=1)
    d.backlog_window = tuple(t.strftime("%Y-%m-%dT%H:%M:%S.%fZ") for t in (
        start, datetime.now(UTC) + timedelta(seconds=1)))
    return f"{BACKLOG} favorites events of 400 seeded guest sessions on both topics"


def start_favorites(d: Deployment) -> str:
    """Both favorites pods (podManagementPolicy: Parallel): volumes, init containers, stream."""
    return "; ".join(f"{pod.name} init {d.kubelet.start_pod(pod)}" for pod in d.favorites())


def probe_favorites(d: Deployment) -> str:
    """The kubelet's probes of both pods, then /metrics."""
    return " | ".join(d.probe_pod(pod) for pod in d.favorites())


def backlog_exactly_once(d: Deployment) -> str:
    """Every backlog message: one row, one action-tracked; Bytewax's own metrics served."""
    found = d.wait_exact()
    bytewax = [d.bytewax_metrics(pod) for pod in d.favorites()]
    return (f"{found['rows']} rows for {found['messages']} messages, {found['tracked_records']}"
            f" action-tracked, one per row, outbox empty; bytewax_* samples per pod {bytewax}")


def kill_and_replace(d: Deployment) -> str:
    """SIGKILL the outbox lease holder while events arrive, replace it: nothing lost or doubled."""
    pods = d.favorites()
    time.sleep(SNAPSHOT_WAIT_SECONDS)
    holders = [i for i, pod in enumerate(pods)
               if holds_lease(d.kubelet.logs(pod.containers["stream"].name))]
    victim = holders[0] if len(holders) == 1 else 1  # pod 1 when no one holds it (yet)
    peer = pods[1 - victim].containers["stream"].name
    restarts = (d.kubelet.state(peer) or {}).get("RestartCount", 0)
    since = datetime.now(UTC)
    producer = threading.Thread(target=d.produce, args=(LIVE, 2, LIVE_SECONDS))
    producer.start()
    time.sleep(LIVE_SECONDS / 3)
    d.save_log(pods[victim].containers["stream"])
    d.kubelet.delete_pod(pods[victim])  # docker rm --force: SIGKILL, the pod is gone
    killed = time.monotonic()
    replacement = d.favorites(replace=victim)[victim]
    d.kubelet.start_pod(replacement)
    producer.join()
    found = d.wait_exact()
    recovered = round(time.monotonic() - killed, 1)
    d.wait_ready(d.favorites())
    replayed = d.replayed(d.favorites(), since)
    restarts = (d.kubelet.state(peer) or {}).get("RestartCount", 0) - restarts
    if replayed >= BACKLOG:
        raise StepFailed(f"{replayed} duplicates replayed: the cluster started from scratch, "
                         "not from the recovery volumes")
    init_log = d.kubelet.logs(f"{replacement.name}.init-recovery").strip()
    role = "the lease holder" if holders == [victim] else f"lease holders found: {holders}"
    return (f"pod {victim} ({role}) SIGKILLed and replaced (init-recovery: {init_log[:70]}); "
            f"pod {1 - victim} restarted {restarts}x; all {found['messages']} recorded and "
            f"published once {recovered} s after the kill; {replayed} records replayed (< "
            f"backlog {BACKLOG}: resumed from the recovery volumes)")


def rolling_stop(d: Deployment) -> str:
    """SIGTERM to both pods: exit 0 within the grace period; the next start replays nothing."""
    names = [pod.containers["stream"].name for pod in d.favorites()]
    grace = d.favorites()[0].containers["stream"].stop_timeout
    exits: dict[str, tuple[int, float]] = {}
    sent = time.monotonic()

    def stop(name: str) -> None:
        exits[name] = (d.kubelet.stop(name, grace), round(time.monotonic() - sent, 1))

    threads = [threading.Thread(target=stop, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pod in d.favorites():
        d.save_log(pod.containers["stream"])
    if any(code != 0 for code, _took in exits.values()):
        raise StepFailed(f"SIGTERM: exit codes and seconds {exits}")
    since = datetime.now(UTC)
    for name in names:  # the kubelet restarts an exited container of an Always pod
        d.kubelet.docker("start", name)
    d.wait_ready(d.favorites())
    d.produce(AFTER_STOP, seed=3)
    found = d.wait_exact()
    if replayed := d.replayed(d.favorites(), since):
        raise StepFailed(f"the start after a clean stop replayed {replayed} records")
    return (f"SIGTERM to both: exit 0 after {sorted(t for _c, t in exits.values())} s (grace "
            f"{grace} s); the next start replayed 0; {found['messages']} recorded and published"
            " once")


def backfill(d: Deployment) -> str:
    """The backfill Job (dry run) over the backlog's time window: all duplicates."""
    start, end = d.backlog_window

    def window(job: dict[str, Any]) -> None:  # the operator's edit of the template
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        at = args.index("--from")
        args[at + 1:at + 2] = [start, "--until", end]

    log = d.run_job("user-activity-backfill-", "127.0.12.4", window)
    outcomes = {k: int(v.replace(",", "")) for k, v in
                re.findall(r"^would be (\S+)\s+([\d,]+)$", log, re.M)}
    if outcomes.get("duplicate") != BACKLOG or outcomes.get("recorded") != 0:
        raise StepFailed(f"dry run of [{start}, {end}): {outcomes}\n{log[-800:]}")
    return f"dry run --from {start} --until {end}: would be duplicate {BACKLOG}, recorded 0"


def session_linking(d: Deployment) -> str:
    """The session-linking pod: probes, sign-ins linked once each, SIGTERM exit 0."""
    workload = d.manifests.get_copy("StatefulSet", LINKING)
    pod = d.pod(workload, f"{LINKING}-0", "127.0.11.1", pod_hosts(workload, ["127.0.11.1"]))
    d.kubelet.start_pod(pod)
    probed = d.probe_pod(pod)
    guests, _users = seed_owners(d.dsn, SIGN_INS, 0)
    users = {device: uuid.uuid4() for device in guests}
    producer = Producer({"bootstrap.servers": d.bootstrap, "acks": "all",
                         "enable.idempotence": True})
    for device, user in users.items():
        producer.produce(d.settings["USER_ACTIVITY_TOPIC_USER_SIGNED_IN"], key=str(user).encode(),
                         value=orjson.dumps(sign_in_envelope(
                             user_id=user, anonymous_id=device,
                             signed_in_at=datetime.now(UTC).isoformat())))
    producer.flush(60)
    topic, deadline = d.settings["USER_ACTIVITY_TOPIC_SESSION_LINKED"], time.monotonic() + 120
    while True:  # linked, then published after the commit
        with psycopg.connect(d.dsn, autocommit=True) as conn:
            linked_users: dict[uuid.UUID, uuid.UUID] = dict(conn.execute(
                "SELECT anonymous_id, user_id FROM user_activity.sessions"
                " WHERE anonymous_id = ANY(%s)", (guests,)).fetchall())
        records = consume_json(d.bootstrap, topic)
        per_user = {str(u): sum(str(u) in orjson.dumps(r).decode().lower() for r in records)
                    for u in users.values()}
        done = linked_users == users and unpublished(d.dsn, topic) == 0 and len(records) >= SIGN_INS
        if done or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if linked_users != users or len(records) != SIGN_INS or set(per_user.values()) != {1}:
        raise StepFailed(f"sessions {linked_users}, {len(records)} session-linked records; "
                         f"per user: {per_user}")
    sent = time.monotonic()
    code = d.kubelet.stop(pod.containers["stream"].name, pod.containers["stream"].stop_timeout)
    d.save_log(pod.containers["stream"])
    if code != 0:
        raise StepFailed(f"session linking exited {code} on SIGTERM")
    return (f"{probed}; {SIGN_INS} sign-ins linked, one session-linked each; SIGTERM exit 0 in "
            f"{round(time.monotonic() - sent, 1)} s")


STEPS: tuple[tuple[str, Callable[[Deployment], str]], ...] = (
    ("rootfs: uid 10001, read-only", read_only_check), ("job: migrate", migrate),
    ("job: create-topics", create_topics), ("backlog produced", backlog),
    ("favorites: 2 pods started", start_favorites),
    ("favorites: probes, /metrics", probe_favorites),
    ("favorites: backlog exactly once", backlog_exactly_once),
    ("favorites: SIGKILL lease holder, replace", kill_and_replace),
    ("favorites: SIGTERM all, restart", rolling_stop),
    ("job: backfill (dry run, window)", backfill), ("session-linking: sign-ins", session_linking))


def main(argv: Sequence[str] | None = None) -> int:
    """Run every step; append the table's rows to ``--steps-file``; 0 when every step passed."""
    parser = argparse.ArgumentParser(prog="python -m devenv.deploy")
    parser.add_argument("--image", required=True, help="the image built from k8s/Dockerfile")
    parser.add_argument("--docker", default="docker", help="the docker CLI to use")
    parser.add_argument("--run-dir", type=Path, default=ROOT / ".run" / "deploy-test")
    parser.add_argument("--steps-file", type=Path, required=True,
                        help="the tab-separated table scripts/deploy-test.sh prints")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir.resolve()
    for stale in ("pods", "claims", "logs"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    d = Deployment(args.image, run_dir, args.docker)
    d.kubelet.remove_all()
    try:
        with d.step("services: Kafka, PostgreSQL") as row:
            row.detail = d.start_services()
        for name, step in STEPS:
            with d.step(name) as row:
                if not d.failed:
                    row.detail = step(d)
    finally:
        for pod in d.pods.values():
            for container in (*pod.init_containers, *pod.containers.values()):
                if d.kubelet.state(container.name) is not None:
                    d.save_log(container)
        removed = d.kubelet.remove_all()
        shutil.rmtree(d.memory_dir, ignore_errors=True)
        for service in reversed(d.services):
            try:
                service.stop()
            except Exception:  # noqa: BLE001 - best effort at the end
                traceback.print_exc()
        print(f"[deploy-test] removed {removed} containers; logs in {run_dir / 'logs'}")
    with args.steps_file.open("a") as rows:
        rows.writelines(f"{r.step}\t{r.result}\t{r.seconds}\t{' '.join(r.detail.split())[:400]}\n"
                        for r in d.rows)
    return 1 if d.failed else 0
