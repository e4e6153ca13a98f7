"""A real single-node Apache Kafka broker (KRaft combined mode) for tests and local development.

No library runs real Kafka without containers, so this runs the broker's Maven Central jars on the
machine's Java 17+, resolved once by ``fetch_jars`` (devenv/kafka/pom.xml) into
``devenv/kafka/lib-<version>/`` with a class archive of a broker's start (:func:`archive_classes`,
half the CPU of a quick-start JVM's start). ``KafkaBroker(run_dir)``: ``start`` (format on first
use, wait until ready), ``stop`` (SIGTERM), ``kill`` (SIGKILL), a context manager.

CLI (state in ``.run/kafka`` unless ``--run-dir``): ``python -m devenv.kafka_broker
fetch | start [--port N] [--fresh] | status | create-topics TOPIC... | stop``; ``start`` prints
the bootstrap address as its last line and leaves the broker running.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from cli.topics import ensure_topics
from devenv.harness.jobs import alive
from devenv.harness.ports import free_port

KAFKA_VERSION = "4.1.2"
"""Pinned Apache Kafka version (keep in sync with ``kafka.version`` in devenv/kafka/pom.xml)."""

HOST = "127.0.0.1"
ASSETS_DIR = Path(__file__).resolve().parent / "kafka"
POM_FILE = ASSETS_DIR / "pom.xml"
LOG4J2_CONFIG = ASSETS_DIR / "log4j2.properties"  # quiet: WARN and "Kafka Server started"
BASE_PROPERTIES = ASSETS_DIR / "server.properties"  # the static part of every run's config
DEFAULT_LIB_DIR = ASSETS_DIR / f"lib-{KAFKA_VERSION}"
DEFAULT_RUN_DIR = Path(__file__).resolve().parent.parent / ".run" / "kafka"
_KAFKA_JAR = f"kafka_2.13-{KAFKA_VERSION}.jar"
_CLASS_ARCHIVE = "classes.jsa"  # in the lib dir: the classes a quick-start broker loaded

QUICK_START_JVM = ("-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
"""The broker's default heap, GC and JIT: serial GC and C1 only start with far less CPU on small
CI machines; for tests, not for measuring the broker."""
PRODUCTION_JVM = ("-Xms1g", "-Xmx1g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                  "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent")
"""Kafka's own options (``kafka-server-start.sh``, ``kafka-run-class.sh``): a 1 GB heap, G1,
every JIT tier."""
_JVM_OPTS = ("-XX:+ExitOnOutOfMemoryError", "-XX:-UsePerfData", "-Djava.awt.headless=true",
             "-Djava.net.preferIPv4Stack=true", f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}")

# For clients of brokers that start or stop: hides librdkafka's "Connection refused" noise.
QUIET_RDKAFKA_LOGGER = logging.getLogger(f"{__name__}.rdkafka")
QUIET_RDKAFKA_LOGGER.addHandler(logging.NullHandler())
QUIET_RDKAFKA_LOGGER.propagate = False


class KafkaBrokerError(RuntimeError):
    """The jars cannot be fetched, or the broker cannot be started, stopped or reached."""


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(line for line in text.strip().splitlines()[-lines:] if line.strip())


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if java is None or not os.access(java, os.X_OK):
        raise KafkaBrokerError("Java 17+ not found (apt-get install openjdk-17-jre-headless)")
    return java


def fetch_jars(lib_dir: Path | None = None, *, timeout: float = 900.0) -> Path:
    """Resolve the broker's runtime jars into ``lib_dir`` with Maven once; return the directory."""
    lib = (lib_dir or DEFAULT_LIB_DIR).resolve()
    marker = lib / ".complete"
    with contextlib.suppress(OSError):
        names = marker.read_text().split()
        if _KAFKA_JAR in names and all((lib / name).is_file() for name in names):
            return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaBrokerError("Maven (mvn) is needed once to fetch the jars (apt install maven)")
    for stale in lib.glob("*.jar"):  # an interrupted copy may have left partial jars
        stale.unlink()
    args = ["-q", "-B", "-Dstyle.color=never", "-f", str(POM_FILE),
            f"-Dkafka.version={KAFKA_VERSION}", f"-Dkafka.lib.dir={lib}",
            "dependency:copy-dependencies"]
    env = {**os.environ, "MAVEN_OPTS": os.environ.get("MAVEN_OPTS", "-Xmx512m")}
    for offline in (["-o"], []):
        proc = subprocess.run([mvn, *offline, *args], capture_output=True, text=True,
                              timeout=timeout, check=False, env=env, stdin=subprocess.DEVNULL)
        if proc.returncode == 0:
            break
    else:
        raise KafkaBrokerError(f"Maven could not resolve Kafka {KAFKA_VERSION} (no network?):\n"
                               f"{_tail(proc.stdout + proc.stderr)}")
    names = sorted(p.name for p in lib.glob("*.jar"))
    if _KAFKA_JAR not in names:
        raise KafkaBrokerError(f"Maven succeeded but {_KAFKA_JAR} is missing from {lib}")
    marker.write_text("\n".join(names) + "\n")
    return lib


def archive_classes(lib_dir: Path | None = None) -> Path:
    """Write the lib dir's class archive once: the classes a quick-start broker's start loads.

    A broker in a temporary directory starts, is ready, and stops cleanly; its JVM dumps the
    classes it loaded (JDK 13+ ``-XX:ArchiveClassesAtExit``), renamed into place only when whole.
    """
    lib = fetch_jars(lib_dir)
    archive = lib / _CLASS_ARCHIVE
    if archive.is_file():
        return archive
    partial = lib / f"{_CLASS_ARCHIVE}.{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="kafka-archive-") as run_dir:
        broker = KafkaBroker(run_dir, jvm_options=(
            *QUICK_START_JVM, f"-XX:ArchiveClassesAtExit={partial}"))
        broker.start()
        broker.stop()
    if not partial.is_file():
        raise KafkaBrokerError(f"the JVM wrote no class archive; see {broker.log_path}")
    partial.replace(archive)
    return archive


def _with_archive(options: Sequence[str], lib: Path) -> tuple[str, ...]:
    """``options``, and the lib dir's class archive for quick-start ones when it is there.

    A JVM whose class path no longer matches the archive ignores it (``-Xshare:auto``).
    """
    archive = lib / _CLASS_ARCHIVE
    if tuple(options) != QUICK_START_JVM or not archive.is_file():
        return tuple(options)
    return (*options, f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off")


def new_cluster_id() -> str:
    """A random cluster id in the shape of Kafka's Uuid.toString() (never starting with '-')."""
    return "A" + base64.urlsafe_b64encode(uuid.uuid4().bytes).decode()[1:22]


_COORDINATOR_LOADING = {KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                        KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR}


def _wait_ready(client_config: Mapping[str, Any], deadline: float,
                still_running: Callable[[], None], brokers: int = 1) -> None:
    """Wait for ``brokers`` registered brokers, every partition led, then a group coordinator.

    A consumer joining while the coordinator loads ``__consumer_offsets`` waits about 3 s.
    """
    admin = AdminClient({**client_config, "socket.connection.setup.timeout.ms": 2000,
                         "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 500},
                        logger=QUIET_RDKAFKA_LOGGER)
    last: object = "no metadata yet"
    while (remaining := deadline - time.monotonic()) > 0:
        still_running()
        admin.poll(0)  # drain queued log callbacks
        try:
            md = admin.list_topics(timeout=max(0.1, min(2.0, remaining)))
        except KafkaException as exc:
            last = exc
            continue
        last = f"brokers={sorted(md.brokers)} topics={sorted(md.topics)}"
        if len(md.brokers) < brokers or any(
                t.error is not None or any(p.leader < 0 or p.error is not None
                                           for p in t.partitions.values())
                for t in md.topics.values()):
            time.sleep(0.1)
            continue
        probe = admin.describe_consumer_groups(["devenv-readiness-probe"], request_timeout=max(
            0.5, min(5.0, remaining)))["devenv-readiness-probe"]
        try:
            probe.result()
            return
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or not (
                    err.code() in _COORDINATOR_LOADING or err.retriable()):
                return  # not a loading problem: nothing to wait for
            last = err
        time.sleep(0.05)
    raise TimeoutError(f"Kafka not ready: {last}")


def create_topics(bootstrap: str, topics: Sequence[str], partitions: int = 6) -> None:
    """Create ``topics`` (existing ones are left as they are) and wait until all are led."""
    ensure_topics({"bootstrap.servers": bootstrap}, list(dict.fromkeys(topics)), partitions)


def start_nodes(nodes: Sequence[KafkaBroker], client_config: Mapping[str, Any], *,
                brokers: int = 1, timeout: float = 90.0) -> None:
    """Launch the prepared ``nodes`` and wait until ``brokers`` brokers are ready (``start``)."""
    checks: list[Callable[[], None]] = []

    def all_running() -> None:
        for check in checks:
            check()

    try:
        checks.extend(node.launch() for node in nodes)
        _wait_ready(client_config, time.monotonic() + timeout, all_running, brokers)
    except TimeoutError as exc:
        for node in nodes:
            node.kill()
        tails = "\n".join(f"{node.log_path}:\n{node.log_tail(30 // len(nodes))}"
                          for node in nodes)
        raise KafkaBrokerError(f"Kafka not ready within {timeout:.0f}s ({exc}); see {tails}"
                               ) from exc
    except BaseException:
        for node in nodes:
            node.kill()
        raise


class KafkaBroker:
    """One broker+controller JVM on 127.0.0.1 whose state (ports, data, log) lives in ``run_dir``.

    The JVM gets ``die_with_parent`` when the thread that started it exits (the CLI: None).
    ``jvm_options``: its heap, GC and JIT (:data:`QUICK_START_JVM`; the benchmark's
    :data:`PRODUCTION_JVM`).
    """

    def __init__(self, run_dir: Path | str, *, port: int | None = None,
                 controller_port: int | None = None, cluster_id: str | None = None,
                 server_properties: Mapping[str, str | int | bool] | None = None,
                 start_timeout: float = 90.0,
                 die_with_parent: signal.Signals | None = signal.SIGTERM,
                 jvm_options: Sequence[str] = QUICK_START_JVM) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.data_dir, self.log_path = self.run_dir / "data", self.run_dir / "broker.log"
        self.properties_path = self.run_dir / "server.properties"
        self._state_path = self.run_dir / "state.json"
        self._extra = {k: str(v).lower() if isinstance(v, bool) else str(v)
                       for k, v in (server_properties or {}).items()}
        self.start_timeout, self._die_with_parent = start_timeout, die_with_parent
        self.jvm_options = tuple(jvm_options)
        self._proc: subprocess.Popen[bytes] | None = None
        self._launch_offset = 0  # of broker.log, for the lines of the latest start
        self.cluster_id = cluster_id
        state = self._state()
        self.port = port or int(state.get("port") or 0) or free_port(HOST, below_ephemeral=True)
        self.controller_port = (controller_port or int(state.get("controller_port") or 0)
                                or free_port(HOST, below_ephemeral=True, exclude=self.port))

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients, e.g. ``127.0.0.1:23456``."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Pid of the running broker JVM (started by this or another process), or None."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        pid = self._state().get("pid")
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return None
        ours = "kafka.Kafka" in cmdline and str(self.properties_path) in cmdline  # pid reuse
        return pid if ours and isinstance(pid, int) and alive(pid) else None

    def is_running(self) -> bool:
        """Whether the broker JVM of this run dir is alive (not necessarily ready)."""
        return self.pid is not None

    def start(self, *, fresh: bool = False) -> str:
        """Start the broker, wait until it is ready, return the bootstrap address."""
        self.prepare(fresh=fresh)
        start_nodes([self], {"bootstrap.servers": self.bootstrap}, timeout=self.start_timeout)
        return self.bootstrap

    def prepare(self, *, fresh: bool = False) -> None:
        """Write ``server.properties``; format the data dir on first use (``fresh=True``: anew)."""
        if (running := self.pid) is not None:
            raise KafkaBrokerError(f"broker already running in {self.run_dir} (pid {running})")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lib = fetch_jars()
        if fresh:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self._write_properties()
        if (self.data_dir / "meta.properties").is_file():
            return
        shutil.rmtree(self.data_dir, ignore_errors=True)  # half-formatted: unusable
        cluster_id = self.cluster_id or new_cluster_id()
        offset = self._log_header("format storage")
        with self.log_path.open("ab") as log:
            code = subprocess.run(
                [_java(), *_with_archive(QUICK_START_JVM, lib), *_JVM_OPTS, "-cp", f"{lib}/*",
                 "kafka.tools.StorageTool", "format", "-t", cluster_id,
                 "-c", str(self.properties_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=120,
                check=False, cwd=self.run_dir).returncode
        if code != 0:
            raise KafkaBrokerError(f"kafka-storage format failed (exit {code}):\n"
                                   f"{self._log_from(offset)}")

    def launch(self) -> Callable[[], None]:
        """Start the JVM of a prepared broker without waiting; return a liveness check.

        Call this from a long-lived thread: the JVM dies with it (``die_with_parent``).
        """
        lib = fetch_jars()
        cmd = [_java(), *_with_archive(self.jvm_options, lib), *_JVM_OPTS, "-cp", f"{lib}/*",
               "kafka.Kafka", str(self.properties_path)]
        if self._die_with_parent and (setpriv := shutil.which("setpriv")):
            cmd = [setpriv, "--pdeathsig", self._die_with_parent.name.removeprefix("SIG"), *cmd]
        self._launch_offset = self._log_header(f"start broker on {self.bootstrap}")
        with self.log_path.open("ab") as log:
            self._proc = proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.run_dir, start_new_session=True)  # no terminal SIGINT; CLI detaches it
        self._save_state(proc.pid)

        def still_running() -> None:
            if proc.poll() is not None:
                self._proc = None
                raise KafkaBrokerError(f"Kafka broker exited with code {proc.returncode} during "
                                       f"start-up; see {self.log_path}:\n{self.log_tail()}")

        return still_running

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` non-blank lines its JVM wrote since its latest start."""
        return self._log_from(self._launch_offset, lines)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (clean shutdown), SIGKILL after ``timeout`` s; data and ports are kept."""
        self._terminate(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL the broker at once (a crash; acknowledged writes survive the next start)."""
        self._terminate(signal.SIGKILL, 0.0)

    def __enter__(self) -> Self:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self, pid: int | None) -> None:
        state = {"pid": pid, "port": self.port, "controller_port": self.controller_port}
        self._state_path.write_text(json.dumps(state) + "\n")

    def _write_properties(self) -> None:
        ports = f"PLAINTEXT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}"
        props = {"controller.quorum.voters": f"1@{HOST}:{self.controller_port}",
                 "listeners": ports, "advertised.listeners": f"PLAINTEXT://{HOST}:{self.port}",
                 "log.dirs": str(self.data_dir), **self._extra}
        if any("\n" in v for v in props.values()):
            raise ValueError("property values must be single-line")
        lines = [f"{k}={v}".replace("\\", "\\\\") for k, v in props.items()]
        self.properties_path.write_text(BASE_PROPERTIES.read_text() + "\n".join(lines) + "\n")

    def _log_header(self, what: str) -> int:
        with self.log_path.open("ab") as log:
            log.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} devenv: {what} =====\n".encode())
            return log.tell()

    def _log_from(self, offset: int, lines: int = 30) -> str:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return _tail(log.read().decode(errors="replace"), lines)

    def _terminate(self, sig: signal.Signals, timeout: float) -> None:
        if (pid := self.pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if not self._wait_exit(pid, timeout) and sig != signal.SIGKILL:
                self._log_header(f"SIGKILL after {timeout:.0f}s without a clean shutdown")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not self._wait_exit(pid, 30.0):
                raise KafkaBrokerError(f"Kafka broker pid {pid} did not exit after SIGKILL")
        self._proc = None
        if self._state_path.exists():
            self._save_state(None)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        proc = self._proc if self._proc is not None and self._proc.pid == pid else None
        while (proc.poll() is None) if proc is not None else alive(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (see the module docstring); return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m devenv.kafka_broker")
    parser.add_argument("command", choices=("fetch", "start", "stop", "status", "create-topics"))
    parser.add_argument("topics", nargs="*", metavar="TOPIC", help="for create-topics")
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    parser.add_argument("--port", type=int, default=None, help="start: the port of a new broker")
    parser.add_argument("--fresh", action="store_true", help="start: delete existing data first")
    parser.add_argument("--partitions", type=int, default=6, help="create-topics")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(archive_classes().parent)
            return 0
        broker = KafkaBroker(args.run_dir, port=args.port, die_with_parent=None)
        if args.command == "stop":
            broker.stop()
            return 0
        if args.command == "start" and not broker.is_running():
            began = time.monotonic()
            broker.start(fresh=args.fresh)
            print(f"Kafka {KAFKA_VERSION} ready in {time.monotonic() - began:.1f}s "
                  f"(pid {broker.pid}, log {broker.log_path})", file=sys.stderr)
        if not broker.is_running():
            print(f"not running ({args.run_dir})", file=sys.stderr)
            return 1
        if args.command == "create-topics":
            create_topics(broker.bootstrap, args.topics, args.partitions)
        else:
            print(broker.bootstrap)
    except KafkaBrokerError as exc:
        print(f"kafka_broker: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
