"""A real single-node Apache Kafka broker (KRaft combined mode) for tests and local development.

The broker runs from Maven Central jars (no Docker, no tarball) on the machine's Java 17+.
``fetch_jars`` resolves the jars once with Maven into ``devenv/kafka/lib-<version>/``.
Later starts need no network: they reuse that directory, and a missing one is rebuilt
from ``~/.m2`` offline first.

Python API::

    from devenv.kafka_broker import KafkaBroker, create_topics

    with KafkaBroker(tmp_path / "kafka") as broker:       # format + start + wait until ready
        create_topics(broker.bootstrap, ["events"])        # 6 partitions, RF 1, idempotent
        ...
        broker.stop()                                      # SIGTERM, SIGKILL after a timeout
        broker.start()                                     # same port, same data
        broker.kill()                                      # SIGKILL (crash); start() again

CLI (state in ``.run/kafka`` unless ``--run-dir``)::

    python -m devenv.kafka_broker fetch
    python -m devenv.kafka_broker start [--port N] [--fresh]   # last stdout line: bootstrap
    python -m devenv.kafka_broker status
    python -m devenv.kafka_broker create-topics TOPIC... [--partitions 6]
    python -m devenv.kafka_broker stop
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

if TYPE_CHECKING:
    from confluent_kafka.admin._metadata import ClusterMetadata

__all__ = [
    "DEFAULT_LIB_DIR",
    "DEFAULT_RUN_DIR",
    "KAFKA_VERSION",
    "KafkaBroker",
    "KafkaBrokerError",
    "create_topics",
    "fetch_jars",
    "main",
    "wait_until_ready",
]

KAFKA_VERSION = "4.1.2"
"""Pinned Apache Kafka version (keep in sync with ``kafka.version`` in devenv/kafka/pom.xml)."""

HOST = "127.0.0.1"
"""The broker listens on loopback only."""

ASSETS_DIR = Path(__file__).resolve().parent / "kafka"
"""Directory holding pom.xml, log4j2.properties and the resolved lib-<version>/ dirs."""

POM_FILE = ASSETS_DIR / "pom.xml"
LOG4J2_CONFIG = ASSETS_DIR / "log4j2.properties"

DEFAULT_LIB_DIR = ASSETS_DIR / f"lib-{KAFKA_VERSION}"
"""Where ``fetch_jars`` puts the broker's runtime classpath by default."""

DEFAULT_RUN_DIR = Path(__file__).resolve().parent.parent / ".run" / "kafka"
"""Default state directory of the CLI (pid, ports, config, data, log)."""

_KAFKA_JAR = f"kafka_2.13-{KAFKA_VERSION}.jar"
_COMPLETE_MARKER = ".complete"
_STATE_FILE = "state.json"
_LOG_FILE = "broker.log"
_PROPERTIES_FILE = "server.properties"

# Serial GC + C1-only JIT: far less CPU at start-up on small CI machines; fine for tests.
_JVM_OPTS = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
    "-Djava.net.preferIPv4Stack=true",
    f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
)

# Single node: the defaults (RF 3, min ISR 2, 50 partitions, 3 s rebalance delay) break or slow
# consumer groups and transactions. Everything else is sized down for a 2-core test machine.
_TEST_PROPERTIES: dict[str, str] = {
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "num.partitions": "6",
    "auto.create.topics.enable": "true",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "1000",
    # After a SIGKILL the controller keeps the dead incarnation's session alive for
    # broker.session.timeout.ms (default 9 s) and rejects the restarted broker until then.
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "3000",
    "num.network.threads": "2",
    "num.io.threads": "2",
    "background.threads": "2",
    "num.recovery.threads.per.data.dir": "1",
    "log.cleaner.threads": "1",
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
}

_quiet_rdkafka = logging.getLogger(f"{__name__}.rdkafka")
_quiet_rdkafka.addHandler(logging.NullHandler())
_quiet_rdkafka.propagate = False  # hides librdkafka's "Connection refused" noise during start-up


class KafkaBrokerError(RuntimeError):
    """Raised when the jars cannot be fetched or the broker cannot be started or reached."""


# --------------------------------------------------------------------------------------------
# Jars
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _lib_complete(lib_dir: Path) -> bool:
    try:
        names = (lib_dir / _COMPLETE_MARKER).read_text().split()
    except OSError:
        return False
    return _KAFKA_JAR in names and all((lib_dir / name).is_file() for name in names)


@functools.cache
def _java_info() -> tuple[str, str]:
    """Return (path, build id) of a Java >= 17 (``$JAVA_HOME/bin/java`` or ``java`` on PATH)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else None
    if java is None or not os.access(java, os.X_OK):
        java = shutil.which("java")
    if java is None:
        raise KafkaBrokerError(
            "Java not found: install a JDK >= 17 (Debian: apt-get install openjdk-17-jre-headless) "
            "or set JAVA_HOME"
        )
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KafkaBrokerError(f"cannot run {java} -version: {exc}") from exc
    text = out.stderr + out.stdout
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if match is None:
        raise KafkaBrokerError(f"cannot parse the output of {java} -version: {text!r}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_x" style
        major = int(match.group(2))
    if major < 17:
        raise KafkaBrokerError(f"Kafka {KAFKA_VERSION} needs Java >= 17, {java} is Java {major}")
    build = re.search(r"\(build ([^)]+)\)", text)
    build_id = re.sub(r"[^A-Za-z0-9._-]", "_", build.group(1) if build else str(major))
    return java, build_id


def _java() -> str:
    """Return the path of a Java >= 17 executable."""
    return _java_info()[0]


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_MVN_BOILERPLATE = ("[ERROR] To see", "[ERROR] Re-run", "[ERROR] For more", "[ERROR] [Help")


def _tail(text: str, lines: int = 40) -> str:
    kept = [
        line
        for line in _ANSI_RE.sub("", text).strip().splitlines()
        if line.strip() not in ("", "[ERROR]") and not line.startswith(_MVN_BOILERPLATE)
    ]
    return "\n".join(kept[-lines:])


def fetch_jars(lib_dir: Path | None = None, *, timeout: float = 900.0) -> Path:
    """Resolve the broker's runtime jars into ``lib_dir`` with Maven; return the directory.

    Does nothing when ``lib_dir`` (default ``DEFAULT_LIB_DIR``) already holds a complete set
    (recorded in a ``.complete`` marker after a successful copy). Otherwise runs
    ``mvn -q -B dependency:copy-dependencies`` on devenv/kafka/pom.xml, first offline (enough
    when ``~/.m2`` already has the artifacts), then online against Maven Central. Safe to call
    from several processes at once (file lock).

    Raises:
        KafkaBrokerError: Java or Maven is missing, or Maven cannot resolve the jars
            (typically: no network access to Maven Central).
    """
    lib = (lib_dir if lib_dir is not None else DEFAULT_LIB_DIR).resolve()
    if _lib_complete(lib):
        return lib
    with _flock(lib / ".fetch.lock"):
        if _lib_complete(lib):
            return lib
        _java()
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaBrokerError(
                "Maven (mvn) not found on PATH; it is needed once to fetch the Kafka jars "
                "(Debian: apt-get install maven)"
            )
        # An interrupted copy may have left partial jars; class-data archives of other jars
        # would be silently ignored by the JVM.
        for stale in [*lib.glob("*.jar"), *lib.glob("*.jsa")]:
            stale.unlink()
        args = [
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(POM_FILE),
            f"-Dkafka.version={KAFKA_VERSION}",
            f"-Dkafka.lib.dir={lib}",
            "dependency:copy-dependencies",
        ]
        env = dict(os.environ, MAVEN_OPTS=os.environ.get("MAVEN_OPTS", "-Xmx512m"))
        output = ""
        for offline in (True, False):
            cmd = [mvn, *(["-o"] if offline else []), *args]
            try:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired as exc:
                raise KafkaBrokerError(
                    f"Maven did not finish within {timeout:.0f}s: {' '.join(cmd)}"
                ) from exc
            output = proc.stdout + proc.stderr
            if proc.returncode == 0:
                break
        else:
            raise KafkaBrokerError(
                f"Maven could not resolve Kafka {KAFKA_VERSION} from Maven Central (no network? "
                f"proxy settings in ~/.m2/settings.xml?). Command: {' '.join(cmd)}\n"
                f"{_tail(output)}"
            )
        names = sorted(p.name for p in lib.glob("*.jar"))
        if _KAFKA_JAR not in names:
            raise KafkaBrokerError(f"Maven succeeded but {_KAFKA_JAR} is missing from {lib}")
        marker = lib / f"{_COMPLETE_MARKER}.tmp"
        marker.write_text("\n".join(names) + "\n")
        marker.replace(lib / _COMPLETE_MARKER)
    return lib


# --------------------------------------------------------------------------------------------
# Readiness and topics (confluent-kafka)
# --------------------------------------------------------------------------------------------


def _admin(bootstrap: str) -> AdminClient:
    conf: dict[str, str | int | float | bool] = {
        "bootstrap.servers": bootstrap,
        "socket.connection.setup.timeout.ms": 2000,
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 500,
        "topic.metadata.refresh.interval.ms": 1000,
    }
    return AdminClient(conf, logger=_quiet_rdkafka)


def _metadata_ready(md: ClusterMetadata, topics: Sequence[str] | None) -> bool:
    """Broker registered and every (requested) topic has all partitions with a leader."""
    if not md.brokers:
        return False
    if topics is None:
        checked = list(md.topics.values())
    else:
        if any(t not in md.topics for t in topics):
            return False
        checked = [md.topics[t] for t in topics]
    for tm in checked:
        if tm.error is not None or not tm.partitions:
            return False
        if any(p.error is not None or p.leader < 0 for p in tm.partitions.values()):
            return False
    return True


def _poll_metadata(
    admin: AdminClient,
    deadline: float,
    topics: Sequence[str] | None,
    alive: Callable[[], None] | None = None,
) -> ClusterMetadata:
    last: Exception | str = "no metadata yet"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka metadata not ready: {last}")
        if alive is not None:
            alive()
        try:
            md = admin.list_topics(timeout=max(0.1, min(2.0, remaining)))
        except KafkaException as exc:
            last = exc
        else:
            if _metadata_ready(md, topics):
                return md
            last = f"brokers={sorted(md.brokers)} topics={sorted(md.topics)}"
        admin.poll(0)  # drain queued log callbacks
        time.sleep(0.1)


_GROUP_PROBE = "devenv-kafka-broker-readiness-probe"
_COORDINATOR_NOT_READY = {
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
}


def _wait_group_coordinator(
    admin: AdminClient, deadline: float, alive: Callable[[], None] | None = None
) -> None:
    """Wait until the group coordinator has loaded ``__consumer_offsets``.

    Right after a restart it answers COORDINATOR_LOAD_IN_PROGRESS, and librdkafka then waits
    about 3 s before its consumer retries JoinGroup.
    """
    last: object = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"group coordinator not ready: {last}")
        if alive is not None:
            alive()
        futures = admin.describe_consumer_groups(
            [_GROUP_PROBE], request_timeout=max(0.5, min(5.0, remaining))
        )
        try:
            futures[_GROUP_PROBE].result()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or not (
                err.code() in _COORDINATOR_NOT_READY or err.retriable()
            ):
                return  # not a loading problem: nothing to wait for
            last = err
        else:
            return
        time.sleep(0.05)


def _wait_ready(
    admin: AdminClient, deadline: float, alive: Callable[[], None] | None = None
) -> None:
    _poll_metadata(admin, deadline, None, alive)
    # Also creates __consumer_offsets on a new broker (FindCoordinator), so that the first
    # consumer group does not hit the loading delay either.
    _wait_group_coordinator(admin, deadline, alive)


def wait_until_ready(bootstrap: str, timeout: float = 60.0) -> None:
    """Block until the broker at ``bootstrap`` serves metadata and consumer groups.

    Ready means: a registered broker, a leader for every partition of every topic, and a group
    coordinator that has loaded ``__consumer_offsets`` (created here if missing).

    Raises:
        KafkaBrokerError: not ready within ``timeout`` seconds.
    """
    try:
        _wait_ready(_admin(bootstrap), time.monotonic() + timeout)
    except TimeoutError as exc:
        raise KafkaBrokerError(f"{bootstrap}: {exc} (after {timeout:.0f}s)") from exc


def create_topics(
    bootstrap: str,
    topics: Sequence[str],
    partitions: int = 6,
    *,
    replication_factor: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> None:
    """Create ``topics`` (idempotent) and wait until every partition has a leader.

    Topics that already exist are left as they are, whatever their partition count.
    Retriable errors (e.g. a broker that is still starting) are retried until ``timeout``.

    Raises:
        KafkaBrokerError: a non-retriable error, or not done within ``timeout`` seconds.
    """
    if isinstance(topics, str):
        raise TypeError("topics must be a sequence of topic names, not a str")
    wanted = list(dict.fromkeys(topics))
    if not wanted:
        return
    admin = _admin(bootstrap)
    deadline = time.monotonic() + timeout
    pending = list(wanted)
    last: object = None
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KafkaBrokerError(f"creating topics {pending} timed out: {last}")
        new = [
            NewTopic(
                t,
                num_partitions=partitions,
                replication_factor=replication_factor,
                config=dict(config or {}),
            )
            for t in pending
        ]
        futures = admin.create_topics(
            new, operation_timeout=min(remaining, 30.0), request_timeout=min(remaining, 30.0)
        )
        retry: list[str] = []
        for topic, future in futures.items():
            try:
                future.result(timeout=remaining + 1.0)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError):
                    if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                        continue
                    if err.retriable() or err.code() in (
                        KafkaError._TRANSPORT,
                        KafkaError._TIMED_OUT,
                        KafkaError._ALL_BROKERS_DOWN,
                    ):
                        retry.append(topic)
                        last = err
                        continue
                raise KafkaBrokerError(f"cannot create topic {topic!r}: {exc}") from exc
            except TimeoutError:
                retry.append(topic)
                last = "CreateTopics request timed out"
        pending = retry
        if pending:
            time.sleep(0.2)
    try:
        _poll_metadata(admin, deadline, wanted)
    except TimeoutError as exc:
        raise KafkaBrokerError(f"topics {wanted} created but not ready: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Ports, processes
# --------------------------------------------------------------------------------------------


def _port_bindable(port: int, *, reuse_addr: bool) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_addr:  # what the JVM's server sockets do: TIME_WAIT leftovers don't count
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _free_port(exclude: set[int]) -> int:
    """Pick a free port on 127.0.0.1, preferably below the ephemeral port range.

    Outgoing client connections then cannot grab it while the broker is stopped for a restart.
    Falls back to an OS-assigned port.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > 20100:
        for _ in range(100):
            port = random.randint(20000, low - 1)
            if port not in exclude and _port_bindable(port, reuse_addr=False):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in exclude:
            return port


def _proc_cmdline(pid: int) -> list[str] | None:
    """Command line of a live (non-zombie) process, or None."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:  # zombie or kernel thread
        return None
    return raw.decode(errors="replace").rstrip("\0").split("\0")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_cmdline(pid) is not None if Path("/proc").is_dir() else True


def _new_cluster_id() -> str:
    # Same shape as org.apache.kafka.common.Uuid.toString(); Uuid.randomUuid() also avoids '-'.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _escape_property(value: str) -> str:
    if "\n" in value or "\r" in value:
        raise ValueError(f"property values must be single-line: {value!r}")
    return value.replace("\\", "\\\\")


class _PortClashError(KafkaBrokerError):
    pass


class _JvmExitedError(KafkaBrokerError):
    pass


def _cds_archive_ok(archive: Path, lib: Path) -> bool:
    """Whether a JVM starts with this class-data archive (a truncated one crashes the JVM)."""
    cmd = [
        _java(),
        f"-XX:SharedArchiveFile={archive}",
        "-Xlog:cds*=off",
        "-XX:ErrorFile=/dev/null",
        "-XX:-CreateCoredumpOnCrash",
        "-cp",
        f"{lib}/*",
        "-version",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


class KafkaBroker:
    """One Kafka broker+controller JVM (KRaft combined mode) on 127.0.0.1, owning ``run_dir``.

    ``run_dir`` holds ``server.properties``, ``data/`` (the log dir), ``broker.log`` (the JVM's
    stdout/stderr, appended on every start, quiet: WARN and above) and ``state.json`` (pid and
    ports). The data dir is formatted on the first start only: stopping and starting again, in
    this or another process, reuses the same ports and keeps all data.

    Ports: ``port``/``controller_port`` if given, else those recorded in ``run_dir`` by an
    earlier start, else free ports (below the ephemeral range) chosen now.

    With ``die_with_parent`` (default) the JVM gets SIGTERM when the *thread* that started it
    exits (``setpriv --pdeathsig``), so a killed test run leaves no broker behind; start it
    from a long-lived thread (pytest fixtures run in the main thread). The CLI's ``start``
    turns this off to leave the broker running detached.

    With ``class_data_sharing`` (default) the first broker that is stopped cleanly leaves a
    JDK class-data archive (AppCDS, ``<lib dir>/kafka-broker-<jdk build>.jsa``) behind, and
    later starts load classes from it: about 1.5 s faster. A broken archive is discarded.
    """

    def __init__(
        self,
        run_dir: Path | str,
        *,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "384m",
        server_properties: Mapping[str, str | int | bool] | None = None,
        jvm_opts: Sequence[str] = (),
        lib_dir: Path | None = None,
        start_timeout: float = 90.0,
        stop_timeout: float = 30.0,
        die_with_parent: bool = True,
        class_data_sharing: bool = True,
    ) -> None:
        """Configure a broker; nothing is started until ``start()`` (or ``with``).

        Args:
            run_dir: State directory (created if needed).
            port: PLAINTEXT listener port (the bootstrap port).
            controller_port: KRaft controller listener port.
            heap: Maximum JVM heap (``-Xmx``).
            server_properties: Extra/overriding broker properties (applied last).
            jvm_opts: Extra JVM options, appended after the defaults (so they win).
            lib_dir: Jar directory, default ``DEFAULT_LIB_DIR`` (fetched on demand).
            start_timeout: Seconds ``start()`` waits for readiness before giving up.
            stop_timeout: Seconds ``stop()`` waits after SIGTERM before SIGKILL.
            die_with_parent: Kill the JVM when the starting thread dies (see class doc).
            class_data_sharing: Use/create an AppCDS archive for faster starts.
        """
        self.run_dir = Path(run_dir).resolve()
        self.data_dir = self.run_dir / "data"
        self.log_path = self.run_dir / _LOG_FILE
        self.properties_path = self.run_dir / _PROPERTIES_FILE
        self._state_path = self.run_dir / _STATE_FILE
        self._heap = heap
        self._extra_props = {
            k: (str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in (server_properties or {}).items()
        }
        self._jvm_opts = tuple(jvm_opts)
        self._lib_dir = lib_dir
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._die_with_parent = die_with_parent
        self._cds = class_data_sharing
        self._cds_used = False
        self._proc: subprocess.Popen[bytes] | None = None

        state = self._read_state()
        self._ports_pinned = port is not None or "port" in state
        self.port = port if port is not None else int(state.get("port") or 0)
        self.controller_port = (
            controller_port
            if controller_port is not None
            else int(state.get("controller_port") or 0)
        )
        if not self.port:
            self.port = _free_port(set())
        if not self.controller_port:
            self.controller_port = _free_port({self.port})
        if self.port == self.controller_port:
            raise ValueError("port and controller_port must differ")

    # ---- public API -----------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` value for clients, e.g. ``127.0.0.1:23456``."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Pid of the running broker JVM (started by this or another process), or None."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc.pid
            self._proc = None
        pid = self._read_state().get("pid")
        if isinstance(pid, int) and self._is_our_broker(pid):
            return pid
        return None

    def is_running(self) -> bool:
        """Whether the broker JVM of this run dir is alive (not necessarily ready)."""
        return self.pid is not None

    def start(self, *, fresh: bool = False) -> str:
        """Start the broker and wait until it is ready (see ``wait_until_ready``); return bootstrap.

        Formats the data dir on first use; a later start reuses it (same data, same ports).
        ``fresh=True`` deletes the data dir first.

        Raises:
            KafkaBrokerError: already running, port in use, JVM died, or not ready within
                ``start_timeout`` (the message includes the end of ``broker.log``).
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with _flock(self.run_dir / ".lock"):
            running = self.pid
            if running is not None:
                raise KafkaBrokerError(f"broker already running in {self.run_dir} (pid {running})")
            lib = fetch_jars(self._lib_dir)
            if fresh:
                shutil.rmtree(self.data_dir, ignore_errors=True)
            port_retries = 0 if self._ports_pinned else 2
            cds_retry = True
            while True:
                try:
                    self._start_once(lib)
                except _PortClashError:
                    if port_retries == 0:
                        raise
                    port_retries -= 1
                    self.port = _free_port(set())
                    self.controller_port = _free_port({self.port})
                except _JvmExitedError:
                    if not (self._cds_used and cds_retry):
                        raise
                    cds_retry = False  # maybe a bad class-data archive: retry without it
                    self._cds_archive(lib).unlink(missing_ok=True)
                    self._log_header("JVM died with the class-data archive; deleted it, retrying")
                else:
                    self._ports_pinned = True
                    return self.bootstrap

    def stop(self, timeout: float | None = None) -> None:
        """Stop the broker: SIGTERM (clean shutdown), then SIGKILL after ``timeout`` seconds.

        ``timeout`` defaults to ``stop_timeout``. Data and ports are kept for the next
        ``start()``. No-op when not running.
        """
        self._terminate(signal.SIGTERM, self.stop_timeout if timeout is None else timeout)

    def kill(self) -> None:
        """SIGKILL the broker at once (crash simulation).

        Acknowledged writes survive the next ``start()`` (they are in the OS page cache), as
        after a real process crash.
        """
        self._terminate(signal.SIGKILL, 0.0)

    def restart(self, stop_timeout: float | None = None) -> str:
        """``stop()`` then ``start()`` on the same port and data; return the bootstrap."""
        self.stop(stop_timeout)
        return self.start()

    def __enter__(self) -> Self:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"KafkaBroker({str(self.run_dir)!r}, bootstrap={self.bootstrap!r})"

    # ---- internals -------------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, pid: int | None, cds_dump: Path | None = None) -> None:
        state = {
            "pid": pid,
            "port": self.port,
            "controller_port": self.controller_port,
            "bootstrap": self.bootstrap,
            "kafka_version": KAFKA_VERSION,
            "log": str(self.log_path),
            "cds_dump": str(cds_dump) if cds_dump else None,
            "updated_at": time.time(),
        }
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self._state_path)

    def _is_our_broker(self, pid: int) -> bool:
        """Guard against pid reuse: the process must be kafka.Kafka on our server.properties."""
        cmd = _proc_cmdline(pid)
        if cmd is None:
            return _pid_alive(pid) and not Path("/proc").is_dir()
        return "kafka.Kafka" in cmd and str(self.properties_path) in cmd

    def _server_properties(self) -> dict[str, str]:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{HOST}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            **_TEST_PROPERTIES,
        }
        props.update(self._extra_props)
        return props

    def _write_properties(self) -> None:
        lines = [f"# Generated by devenv/kafka_broker.py (Kafka {KAFKA_VERSION}), on every start."]
        lines += [f"{k}={_escape_property(v)}" for k, v in self._server_properties().items()]
        self.properties_path.write_text("\n".join(lines) + "\n")

    def _log_header(self, what: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with self.log_path.open("a") as fh:
            fh.write(f"===== {stamp} devenv.kafka_broker: {what} =====\n")

    def _read_log_from(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _cds_archive(lib: Path) -> Path:
        return lib / f"kafka-broker-{_java_info()[1]}.jsa"

    def _settle_cds_dump(self, clean: bool) -> None:
        """After the JVM exited: keep its class-data dump if it stopped cleanly, else drop it."""
        dump = self._read_state().get("cds_dump")
        if not isinstance(dump, str):
            return
        tmp = Path(dump)
        try:
            if clean and tmp.is_file() and tmp.stat().st_size > 0:
                archive = tmp.with_name(tmp.name.rsplit(".", 2)[0])  # drop ".<hex>.tmp"
                if not archive.exists() and _cds_archive_ok(tmp, tmp.parent):
                    tmp.replace(archive)
        finally:
            tmp.unlink(missing_ok=True)

    def _format(self, lib: Path) -> None:
        """Format the data dir (static controller.quorum.voters, so no --standalone)."""
        if self.data_dir.exists():  # left over without meta.properties: unusable anyway
            shutil.rmtree(self.data_dir)
        cmd = [
            _java(),
            "-Xmx256m",
            *_JVM_OPTS,
            "-cp",
            f"{lib}/*",
            "kafka.tools.StorageTool",
            "format",
            "-t",
            _new_cluster_id(),
            "-c",
            str(self.properties_path),
        ]
        self._log_header("format storage")
        with self.log_path.open("ab") as log:
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=120,
                check=False,
                cwd=self.run_dir,
            )
        if proc.returncode != 0 or not (self.data_dir / "meta.properties").is_file():
            raise KafkaBrokerError(
                f"kafka-storage format failed (exit {proc.returncode}); see {self.log_path}:\n"
                f"{_tail(self._read_log_from(0), 20)}"
            )

    def _start_once(self, lib: Path) -> None:
        self._write_properties()
        if not (self.data_dir / "meta.properties").is_file():
            self._format(lib)
        for what, p in (("port", self.port), ("controller_port", self.controller_port)):
            if not _port_bindable(p, reuse_addr=True):
                raise _PortClashError(
                    f"{what} {p} on {HOST} is already in use (ports are kept across restarts "
                    f"of {self.run_dir}; choose others with port=/controller_port=)"
                )

        cds_opts: list[str] = []
        cds_dump: Path | None = None
        self._cds_used = False
        if self._cds:
            archive = self._cds_archive(lib)
            for stale in lib.glob("*.jsa.*.tmp"):  # dumps of brokers nobody stopped through us
                with contextlib.suppress(OSError):
                    if time.time() - stale.stat().st_mtime > 300:
                        stale.unlink()
            if archive.is_file():
                cds_opts = [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds*=off"]
                self._cds_used = True
            else:
                cds_dump = archive.with_name(f"{archive.name}.{uuid.uuid4().hex[:12]}.tmp")
                cds_opts = [f"-XX:ArchiveClassesAtExit={cds_dump}", "-Xlog:cds*=off"]
        cmd = [
            _java(),
            "-Xms64m",
            f"-Xmx{self._heap}",
            *_JVM_OPTS,
            *cds_opts,
            *self._jvm_opts,
            "-cp",
            f"{lib}/*",
            "kafka.Kafka",
            str(self.properties_path),
        ]
        setpriv = shutil.which("setpriv") if self._die_with_parent else None
        if setpriv is not None:
            cmd = [setpriv, "--pdeathsig", "TERM", *cmd]
        self._log_header(f"start broker on {self.bootstrap}")
        offset = self.log_path.stat().st_size
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                start_new_session=True,  # no terminal SIGINT/SIGHUP; the CLI detaches it
            )
        proc = self._proc
        self._write_state(proc.pid, cds_dump)

        def alive() -> None:
            if proc.poll() is not None:
                log_text = self._read_log_from(offset)
                self._proc = None
                self._settle_cds_dump(clean=False)
                self._write_state(None)
                msg = (
                    f"Kafka broker exited with code {proc.returncode} during start-up; "
                    f"see {self.log_path}:\n{_tail(log_text)}"
                )
                if "Address already in use" in log_text or "BindException" in log_text:
                    raise _PortClashError(msg)
                raise _JvmExitedError(msg)

        deadline = time.monotonic() + self.start_timeout
        try:
            self._wait_tcp(deadline, alive)
            _wait_ready(_admin(self.bootstrap), deadline, alive)
        except TimeoutError as exc:
            self._terminate(signal.SIGKILL, 0.0)
            raise KafkaBrokerError(
                f"Kafka broker not ready within {self.start_timeout:.0f}s ({exc}); "
                f"see {self.log_path}:\n{_tail(self._read_log_from(offset))}"
            ) from exc
        except BaseException:
            if self._proc is not None:
                self._terminate(signal.SIGKILL, 0.0)
            raise

    def _wait_tcp(self, deadline: float, alive: Callable[[], None]) -> None:
        while True:
            alive()
            try:
                with socket.create_connection((HOST, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"port {self.port} not accepting connections")
            time.sleep(0.1)

    def _terminate(self, sig: signal.Signals, timeout: float) -> None:
        pid = self.pid
        if pid is None:
            if self._state_path.exists():
                self._settle_cds_dump(clean=False)
                self._write_state(None)
            return
        proc = self._proc
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        clean = sig != signal.SIGKILL
        if not self._wait_exit(pid, proc, timeout) and clean:
            clean = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._log_header(f"SIGKILL after {timeout:.0f}s without clean shutdown")
        if not self._wait_exit(pid, proc, 30.0):
            raise KafkaBrokerError(f"Kafka broker pid {pid} did not exit after SIGKILL")
        self._proc = None
        self._settle_cds_dump(clean)
        self._write_state(None)

    @staticmethod
    def _wait_exit(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.pid == pid:
                if proc.poll() is not None:
                    return True
            elif not _pid_alive(pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--run-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"state directory (default: {DEFAULT_RUN_DIR})",
    )
    parser = argparse.ArgumentParser(
        prog="python -m devenv.kafka_broker",
        description=f"Single-node Apache Kafka {KAFKA_VERSION} broker (KRaft) for local use.",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        help=f"state directory: pid, ports, config, data, log (default: {DEFAULT_RUN_DIR})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", parents=[common], help="resolve the jars with Maven (once)")
    start = sub.add_parser(
        "start", parents=[common], help="start detached; print the bootstrap address"
    )
    start.add_argument("--port", type=int, default=None, help="bootstrap port (default: free)")
    start.add_argument("--controller-port", type=int, default=None)
    start.add_argument("--fresh", action="store_true", help="delete existing data first")
    start.add_argument("--timeout", type=float, default=90.0, help="readiness timeout (s)")
    stop = sub.add_parser("stop", parents=[common], help="SIGTERM, SIGKILL after --timeout")
    stop.add_argument("--timeout", type=float, default=30.0)
    sub.add_parser("status", parents=[common], help="exit 0 and print bootstrap if running")
    topics = sub.add_parser("create-topics", parents=[common], help="create topics (idempotent)")
    topics.add_argument("topics", nargs="+", metavar="TOPIC")
    topics.add_argument("--partitions", type=int, default=6)
    topics.add_argument(
        "--bootstrap", default=None, help="default: the running broker of --run-dir"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (see the module docstring); return the process exit code."""
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    try:
        if args.command == "fetch":
            t0 = time.monotonic()
            lib = fetch_jars()
            print(f"jars ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
            print(lib)
        elif args.command == "start":
            broker = KafkaBroker(
                run_dir,
                port=args.port,
                controller_port=args.controller_port,
                start_timeout=args.timeout,
                die_with_parent=False,
            )
            if broker.is_running():
                print(f"already running (pid {broker.pid})", file=sys.stderr)
            else:
                t0 = time.monotonic()
                broker.start(fresh=args.fresh)
                print(
                    f"Kafka {KAFKA_VERSION} ready in {time.monotonic() - t0:.1f}s "
                    f"(pid {broker.pid}, log {broker.log_path})",
                    file=sys.stderr,
                )
            print(broker.bootstrap)
        elif args.command == "stop":
            broker = KafkaBroker(run_dir)
            pid = broker.pid
            broker.stop(args.timeout)
            print("stopped" if pid else "not running", file=sys.stderr)
        elif args.command == "status":
            broker = KafkaBroker(run_dir)
            if not broker.is_running():
                print(f"not running ({run_dir})", file=sys.stderr)
                return 1
            print(f"running (pid {broker.pid}, data {broker.data_dir})", file=sys.stderr)
            print(broker.bootstrap)
        elif args.command == "create-topics":
            bootstrap = args.bootstrap
            if bootstrap is None:
                broker = KafkaBroker(run_dir)
                if not broker.is_running():
                    print(f"no broker running in {run_dir}; pass --bootstrap", file=sys.stderr)
                    return 1
                bootstrap = broker.bootstrap
            create_topics(bootstrap, args.topics, args.partitions)
            print(f"topics ready on {bootstrap}: {' '.join(args.topics)}", file=sys.stderr)
    except KafkaBrokerError as exc:
        print(f"kafka_broker: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
