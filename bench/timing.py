"""``--phases timing``: every timing contract alone, ``--timing-rounds`` times, with its target.

:data:`CONTRACTS` lists each time the README's guarantees and the docs promise, its target and
its scenario (bench/contracts.py). The rounds run one after another with nothing else running;
``results["timing"]`` keeps each round's seconds (or why it failed), their median and max, the
target, and whether the max meets it; :func:`print_timing` prints the table. Outages and
freezes stop the run's own broker and PostgreSQL: with ``--external`` they are not measured.
"""

from __future__ import annotations

import logging
import operator
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench import contracts
from bench.contracts import Context, Measured, RoundFailed
from bench.services import Services
from devenv.harness import stream

Log = Callable[[str], None]
_OPS = {"<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Contract:
    """A promised time: its scenario, and ``op`` ``target`` seconds each round must meet."""

    name: str
    what: str
    op: str
    target: float
    measure: Callable[[Context], Measured]
    own_services: bool = False  # it stops or freezes the run's broker or PostgreSQL


CONTRACTS = (
    Contract("standstill_leaders_sigkilled", "stand-still past the failover: leaders SIGKILLed",
             "<=", 3.0, contracts.stand_still("leaders-sigkilled")),
    Contract("standstill_rolling_restart", "stand-still past the failover: rolling restart",
             "<=", 3.0, contracts.stand_still("rolling-restart")),
    Contract("standstill_broker_frozen", "stand-still past the failover: a broker frozen 30 s",
             "<=", 3.0, contracts.stand_still("broker-frozen")),
    Contract("clean_stop", "SIGTERM mid-stream -> exit 0 (the job's clock)", "<", 10.0,
             contracts.clean_stop),
    Contract("postgres_down_stop", "SIGTERM, PostgreSQL down -> exit 75 (grace 20 s + 5)", "<",
             25.0, contracts.outage_stop("postgres"), own_services=True),
    Contract("kafka_down_stop", "SIGTERM, Kafka down -> exit 75 (grace 20 s + 5)", "<", 25.0,
             contracts.outage_stop("kafka"), own_services=True),
    Contract("postgres_frozen_stop", "SIGTERM, PostgreSQL frozen -> exit 75 (pod killed at 30)",
             "<", 30.0, contracts.frozen_postgres_stop, own_services=True),
    Contract("restart_caught_up", "restart after SIGKILL -> caught up (--restart-backlog)", "<",
             10.0, contracts.restart_caught_up),
    Contract("lag_alert_fires", "lag alert fires after an outage (rule 10 s + 30 s hold, + 30)",
             "<=", contracts.LAG_THRESHOLD + contracts.LAG_HOLD + 30, contracts.lag_alert,
             own_services=True),
    Contract("stuck_consumer", "stuck consumer -> restart asked (2 checks of 5 s, + 1 s)", "<=",
             2 * contracts.STUCK_SECONDS + 1, contracts.stuck_consumer),
    Contract("frozen_broker_paused", "broker frozen -> /readyz paused on kafka (check 5 s + 2)",
             "<=", contracts.STUCK_SECONDS + 2, contracts.frozen_broker_paused,
             own_services=True),
    Contract("silent_postgres_command", "migrate, PostgreSQL never answers -> exit 75 (10 s)",
             "<", 15.0, contracts.silent_server_command("migrate")),
    Contract("silent_kafka_command", "create-topics, Kafka never answers -> exit 75 (10 s)",
             "<", 15.0, contracts.silent_server_command("create-topics")),
    Contract("migration_lock_wait", "a migration behind a transaction holds reads (5 s lock)",
             "<", 6.0, contracts.migration_behind_a_transaction),
)


def run_timing(services: Services, *, rounds: int, only: Sequence[str], restart_backlog: int,
               log: Log) -> dict[str, Any]:
    """Each contract of ``only`` (all when empty) ``rounds`` times; ``results["timing"]``."""
    wanted = [c for c in CONTRACTS if not only or c.name in only]
    ctx = Context(services, log, restart_backlog)
    logging.getLogger(stream.__name__).setLevel(logging.CRITICAL)  # librdkafka under the faults
    found: dict[str, Any] = {"rounds": rounds, "contracts": {}}
    try:
        for contract in wanted:
            found["contracts"][contract.name] = _run(contract, ctx, rounds, log)
    finally:
        ctx.close()
    return found


def _run(contract: Contract, ctx: Context, rounds: int, log: Log) -> dict[str, Any]:
    if contract.own_services and ctx.services.postgres is None:
        return summarise(contract, [], rounds, not_measured="external services")
    outcomes: list[Measured | str] = []
    for number in range(1, rounds + 1):
        log(f"  timing {contract.name}: round {number}/{rounds}")
        try:
            measured = contract.measure(ctx)
        except (RoundFailed, AssertionError) as exc:
            outcomes.append(str(exc)[:2000])
            log(f"    failed: {str(exc)[:300]}")
            continue
        outcomes.append(measured)
        log(f"    {measured.seconds:.2f} s {measured.detail or ''}")
    return summarise(contract, outcomes, rounds)


def summarise(contract: Contract, outcomes: Sequence[Measured | str], rounds: int, *,
              not_measured: str = "") -> dict[str, Any]:
    """A contract's entry: each round (seconds, or why it failed), median, max, ``met``.

    ``met`` is ``met`` when every round's seconds meet the target, ``not met`` when one does
    not, ``failed`` when a round failed or is missing, ``not measured`` with ``not_measured``.
    """
    entry: dict[str, Any] = {"what": contract.what, "target": f"{contract.op} {contract.target:g}"}
    if not_measured:
        return {**entry, "met": "not measured", "why": not_measured}
    seconds = [o.seconds for o in outcomes if isinstance(o, Measured)]
    entry |= {"seconds": seconds, "rounds": [
        {"seconds": o.seconds, **o.detail} if isinstance(o, Measured) else {"failed": o}
        for o in outcomes]}
    if seconds:
        entry |= {"median": round(statistics.median(seconds), 2), "max": round(max(seconds), 2)}
    if len(seconds) < rounds:
        return {**entry, "met": "failed"}
    met = all(_OPS[contract.op](s, contract.target) for s in seconds)
    return {**entry, "met": "met" if met else "not met"}


def print_timing(timing: dict[str, Any]) -> None:
    """The contracts' table: median and max of the rounds, the target, met or not."""
    rows = [(c.get("what", name), _fmt(c.get("median")), _fmt(c.get("max")), c.get("target", ""),
             c.get("met", "")) for name, c in (timing.get("contracts") or {}).items()]
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    print(f"\ntiming contracts, {timing.get('rounds')} round(s) each\n"
          f"{'contract':<{width}}  {'median s':>8}  {'max s':>7}  {'target':>7}  met\n"
          f"{'-' * (width + 40)}")
    for what, median, worst, target, met in rows:
        print(f"{what:<{width}}  {median:>8}  {worst:>7}  {target:>7}  {met}")


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"
