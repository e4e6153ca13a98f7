"""A real N-node Apache Kafka cluster (KRaft, each node broker + controller) on loopback.

Nodes are :class:`~devenv.kafka_broker.KafkaBroker` s with production-like replication (RF 3,
min ISR 2, no unclean election, fenced after 3 s without heartbeat). With ``users``: SASL/PLAIN
and ACLs (super user ``admin``, no ACL: denied). Faults per node: kill, stop, start, freeze.

CLI (state in ``.run/kafka-cluster`` unless ``--run-dir``): ``python -m devenv.kafka_cluster
start [NODE] [--nodes N] [--user NAME=PASSWORD]... [--fresh] | stop [NODE] | status``; ``start``
prints the bootstrap servers as its last line and leaves the cluster running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any, Self

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from cli.topics import ensure_topics
from devenv.harness.jobs import wait_until
from devenv.harness.ports import free_port
from devenv.kafka_broker import (
    HOST,
    QUIET_RDKAFKA_LOGGER,
    KafkaBroker,
    KafkaBrokerError,
    new_cluster_id,
    start_nodes,
)

ADMIN = "admin"
"""The super user the harness itself connects as (when the cluster has users)."""

DEFAULT_RUN_DIR = Path(__file__).resolve().parent.parent / ".run" / "kafka-cluster"
_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SIMPLE = re.compile(r"[A-Za-z0-9_.-]+")  # user names and passwords fit in the JAAS line as is


def _replication(nodes: int) -> dict[str, str | int | bool]:
    rf, min_isr = min(3, nodes), min(2, nodes)
    return {"default.replication.factor": rf, "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": rf, "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            "unclean.leader.election.enable": False, "broker.heartbeat.interval.ms": 500,
            "broker.session.timeout.ms": 3000}


class KafkaCluster:
    """``nodes`` KRaft nodes (ids 1..N) on 127.0.0.1 whose state lives in ``run_dir``.

    ``cluster.json`` keeps its id, ports and users, so another instance drives the same
    cluster. ``users`` None: PLAINTEXT, no authorizer. Timed-out waits raise AssertionError.
    """

    def __init__(self, run_dir: Path | str, *, nodes: int = 3,
                 users: Mapping[str, str] | None = None,
                 server_properties: Mapping[str, str | int | bool] | None = None,
                 start_timeout: float = 120.0,
                 die_with_parent: signal.Signals | None = signal.SIGKILL) -> None:
        self.run_dir = Path(run_dir).resolve()
        self._state_path = self.run_dir / "cluster.json"
        try:
            state = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            if users is not None and not all(map(_SIMPLE.fullmatch, [*users, *users.values()])):
                raise ValueError(f"user names and passwords must match {_SIMPLE.pattern}"
                                 ) from None
            ports: list[int] = []
            while len(ports) < 2 * nodes:  # distinct: none is bound before its node starts
                if (port := free_port(HOST, below_ephemeral=True)) not in ports:
                    ports.append(port)
            state = {"cluster_id": new_cluster_id(), "ports": [ports[::2], ports[1::2]],
                     "users": None if users is None else {ADMIN: secrets.token_hex(8), **users}}
        self._state = state
        self.users: dict[str, str] | None = state["users"]
        client_ports, controller_ports = state["ports"]
        voters = ",".join(f"{i}@{HOST}:{port}" for i, port in enumerate(controller_ports, 1))
        common = {**_replication(len(client_ports)), "controller.quorum.voters": voters,
                  **self._security()}
        self.start_timeout = start_timeout
        self._frozen: set[int] = set()
        self.nodes = {
            i: KafkaBroker(self.run_dir / f"node-{i}", port=port, controller_port=controller,
                           cluster_id=state["cluster_id"], start_timeout=start_timeout,
                           die_with_parent=die_with_parent,
                           server_properties={**common, "node.id": i,
                                              **self._listeners(port, controller),
                                              **(server_properties or {})})
            for i, (port, controller) in enumerate(zip(client_ports, controller_ports,
                                                       strict=True), 1)}

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` listing every node, e.g. ``127.0.0.1:2001,127.0.0.1:2003,...``."""
        return ",".join(node.bootstrap for node in self.nodes.values())

    @property
    def replication_factor(self) -> int:
        """The replication factor of new topics: 3 (the node count if smaller)."""
        return min(3, len(self.nodes))

    def client_config(self, user: str = ADMIN) -> dict[str, Any]:
        """confluent-kafka settings to connect as ``user`` (KeyError: an unknown user)."""
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap}
        if self.users is None:
            return config
        return {**config, "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                "sasl.username": user, "sasl.password": self.users[user]}

    def start(self, node: int | None = None, *, fresh: bool = False) -> str:
        """Start ``node`` (default: every node not running, in parallel); wait until ready."""
        targets = ([n for n in self.nodes.values() if not n.is_running()] if node is None
                   else [self.nodes[node]])
        if not self._state_path.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._state_path.write_text(json.dumps(self._state, indent=1) + "\n")
        if targets:
            with ThreadPoolExecutor(len(targets)) as pool:  # formats in parallel; launches here
                list(pool.map(lambda target: target.prepare(fresh=fresh), targets))
            start_nodes(targets, self.client_config(), brokers=len(self._live()) + len(targets),
                        timeout=self.start_timeout)
        return self.bootstrap

    def stop(self, node: int | None = None, timeout: float = 30.0) -> None:
        """SIGTERM ``node`` (default: all at once; thawed first), SIGKILL after ``timeout`` s."""
        targets = list(self.nodes.values()) if node is None else [self.nodes[node]]
        for target in targets:
            if (pid := target.pid) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGTERM)
        for target in targets:
            target.stop(timeout)
        self._frozen -= {i for i, n in self.nodes.items() if n in targets}

    def kill(self, node: int) -> None:
        """SIGKILL ``node``'s JVM at once (a crash); its data is kept."""
        self.nodes[node].kill()
        self._frozen.discard(node)

    def restart(self, node: int) -> None:
        """Stop ``node`` cleanly, then :meth:`start` it again on its data."""
        self.stop(node)
        self.start(node)

    def freeze(self, node: int) -> None:
        """SIGSTOP ``node``'s JVM: it holds its connections, answers nothing, is fenced."""
        self._signal(node, signal.SIGSTOP)
        self._frozen.add(node)

    def thaw(self, node: int) -> None:
        """SIGCONT ``node``'s JVM."""
        self._signal(node, signal.SIGCONT)
        self._frozen.discard(node)

    def heal(self) -> None:
        """Thaw frozen nodes, start stopped ones: every node runs again (a test's clean-up)."""
        for node in list(self._frozen):
            self.thaw(node)
        self.start()

    def close(self) -> None:
        """Stop every node (frozen ones too); the data stays in ``run_dir``."""
        self.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def create_topics(self, topics: Sequence[str], partitions: int = 6) -> None:
        """Create the missing ``topics`` with :attr:`replication_factor`, as ``admin``."""
        ensure_topics(self.client_config(), topics, partitions, self.replication_factor)

    def leader_of(self, topic: str, partition: int) -> int:
        """The id of the live node leading ``topic[partition]`` (waits until there is one)."""
        self.wait_leaders_available([topic])  # a new topic or a failover: known everywhere soon
        leader: int = self._partitions([topic])[(topic, partition)].leader
        return leader

    def wait_leaders_available(self, topics: Iterable[str], timeout: float = 30.0) -> float:
        """Wait until each partition of ``topics`` is led by a running, unfrozen node; seconds."""
        live = self._live()
        return self._wait_partitions(topics, lambda p: p.leader in live, "leaders", timeout)

    def wait_isr_full(self, topics: Iterable[str], timeout: float = 60.0) -> float:
        """Wait until each partition of ``topics`` has all its replicas in sync; seconds."""

        def full(p: Any) -> bool:
            return p.leader >= 0 and sorted(p.isrs) == sorted(p.replicas)

        return self._wait_partitions(topics, full, "full ISRs", timeout)

    def grant(self, principal: str, resource_type: ResourceType, name: str,
              operation: AclOperation, pattern: ResourcePatternType = ResourcePatternType.LITERAL,
              *, timeout: float = 30.0) -> None:
        """Allow ``principal`` (``User:job``) ``operation`` on a resource from any host."""
        binding = AclBinding(resource_type, name, pattern, principal, "*", operation,
                             AclPermissionType.ALLOW)
        for future in self._admin.create_acls([binding]).values():
            future.result(timeout)
        self._wait_acl(binding, True, timeout)

    def revoke(self, principal: str, resource_type: ResourceType, name: str,
               operation: AclOperation, pattern: ResourcePatternType = ResourcePatternType.LITERAL,
               *, timeout: float = 30.0) -> None:
        """Delete what :meth:`grant` allowed; returns once a broker no longer describes it."""
        binding = AclBinding(resource_type, name, pattern, principal, "*", operation,
                             AclPermissionType.ALLOW)
        for future in self._admin.delete_acls([_filter(binding)]).values():
            future.result(timeout)
        self._wait_acl(binding, False, timeout)

    @cached_property
    def _admin(self) -> Any:
        # A request to a frozen node fails after 3 s (not the 60 s default), so the next
        # metadata request goes to another node.
        return AdminClient({**self.client_config(), "socket.timeout.ms": 3000},
                           logger=QUIET_RDKAFKA_LOGGER)

    def _security(self) -> dict[str, str]:
        if self.users is None:
            return {}
        jaas = " ".join([f'{_PLAIN_LOGIN} required username="{ADMIN}"',
                         f'password="{self.users[ADMIN]}"',
                         *(f'user_{name}="{password}"' for name, password in self.users.items())])
        return {"listener.security.protocol.map":
                "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
                "inter.broker.listener.name": "SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": "PLAIN",
                "sasl.mechanism.inter.broker.protocol": "PLAIN",
                "sasl.mechanism.controller.protocol": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config": f"{jaas};",
                "listener.name.controller.plain.sasl.jaas.config": f"{jaas};",
                "authorizer.class.name": _AUTHORIZER, "super.users": f"User:{ADMIN}",
                "allow.everyone.if.no.acl.found": "false"}

    def _listeners(self, port: int, controller: int) -> dict[str, str]:
        client = "PLAINTEXT" if self.users is None else "SASL_PLAINTEXT"
        return {"listeners": f"{client}://{HOST}:{port},CONTROLLER://{HOST}:{controller}",
                "advertised.listeners": f"{client}://{HOST}:{port}"}

    def _live(self) -> set[int]:
        return {i for i, n in self.nodes.items() if n.is_running() and i not in self._frozen}

    def _signal(self, node: int, sig: signal.Signals) -> None:
        if (pid := self.nodes[node].pid) is None:
            raise KafkaBrokerError(f"node {node} is not running")
        os.kill(pid, sig)

    def _partitions(self, topics: Iterable[str]) -> dict[tuple[str, int], Any]:
        metadata = self._admin.list_topics(timeout=10)
        found: dict[tuple[str, int], Any] = {}
        for topic in topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise KafkaBrokerError(f"{topic} is not in the metadata ({meta and meta.error})")
            found.update({(topic, p): partition for p, partition in meta.partitions.items()})
        return found

    def _wait_partitions(self, topics: Iterable[str], ok: Callable[[Any], bool], what: str,
                         timeout: float) -> float:
        topics = list(topics)
        last: list[object] = ["no metadata yet"]

        def all_ok() -> bool:
            try:
                partitions = self._partitions(topics)
            except (KafkaException, KafkaBrokerError) as exc:
                last[0] = exc
                return False
            last[0] = {f"{t}[{p}]": f"leader {m.leader} replicas {m.replicas} isr {m.isrs}"
                       for (t, p), m in partitions.items() if not ok(m)}
            return not last[0]

        return wait_until(all_ok, timeout, f"{what} of {topics}", interval=0.1,
                          context=lambda: str(last[0]))

    def _wait_acl(self, binding: AclBinding, present: bool, timeout: float) -> None:
        """Until every live node describes ``binding`` as ``present`` (each applies it apart)."""
        config = self.client_config()
        admins = [AdminClient({**config, "bootstrap.servers": self.nodes[i].bootstrap},
                              logger=QUIET_RDKAFKA_LOGGER) for i in sorted(self._live())]

        def effective() -> bool:
            return all((binding in admin.describe_acls(_filter(binding)).result(10)) == present
                       for admin in admins)

        wait_until(effective, timeout, f"{binding} {'granted' if present else 'revoked'}",
                   interval=0.1)


def _filter(binding: AclBinding) -> AclBindingFilter:
    return AclBindingFilter(binding.restype, binding.name, binding.resource_pattern_type,
                            binding.principal, binding.host, binding.operation,
                            binding.permission_type)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (see the module docstring); return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m devenv.kafka_cluster")
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("node", nargs="?", type=int, help="start/stop: only this node id")
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    parser.add_argument("--nodes", type=int, default=3, help="start: nodes of a new cluster")
    parser.add_argument("--user", action="append", default=None, metavar="NAME=PASSWORD",
                        help="start: SASL/PLAIN + ACLs with this user (repeatable)")
    parser.add_argument("--fresh", action="store_true", help="start: a new cluster (deletes it)")
    args = parser.parse_args(argv)
    if args.fresh and args.command == "start" and (args.run_dir / "cluster.json").exists():
        KafkaCluster(args.run_dir).stop()
        shutil.rmtree(args.run_dir)
    users = None if args.user is None else dict(u.partition("=")[::2] for u in args.user)
    try:
        cluster = KafkaCluster(args.run_dir, nodes=args.nodes, users=users, die_with_parent=None)
        if args.command == "stop":
            cluster.stop(args.node)
            return 0
        if args.command == "start" and (args.node is None
                                        or not cluster.nodes[args.node].is_running()):
            began = time.monotonic()
            cluster.start(args.node)
            print(f"Kafka cluster ready in {time.monotonic() - began:.1f}s", file=sys.stderr)
        for i, node in cluster.nodes.items():
            print(f"node {i}: {node.bootstrap} pid {node.pid} (log {node.log_path})",
                  file=sys.stderr)
        if not any(node.is_running() for node in cluster.nodes.values()):
            print(f"not running ({args.run_dir})", file=sys.stderr)
            return 1
        if cluster.users is not None:
            print(f"SASL_PLAINTEXT/PLAIN users {', '.join(cluster.users)} (passwords in "
                  f"{cluster.run_dir / 'cluster.json'})", file=sys.stderr)
        print(cluster.bootstrap)
    except KafkaBrokerError as exc:
        print(f"kafka_cluster: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
