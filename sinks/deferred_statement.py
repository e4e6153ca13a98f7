"""One statement sent to PostgreSQL without waiting for it (libpq's asynchronous API).

On an autocommit connection one statement is its own transaction. :func:`send` writes it and its
binary parameters and returns; the server executes and commits it while the caller works;
:func:`finish` waits for the answer. Until then the connection must not be used and nothing is
known committed: if :func:`finish` raises, the statement may or may not have committed, so the
caller redoes the work idempotently. psycopg's ``cursor.execute``, split in two halves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import errors, generators
from psycopg.pq import ExecStatus, Format
from psycopg.pq.abc import PGresult

from sinks.binary_codec import BinaryArray
from sinks.db import Connection

_NAMED = re.compile(r"%\((\w+)\)b")


@dataclass(frozen=True, slots=True)
class Positional:
    """A statement written with ``%(name)b`` placeholders, as ``$n`` text and parameter names."""

    text: bytes
    names: tuple[str, ...]

    @classmethod
    def of(cls, statement: str) -> Positional:
        """``statement`` with each ``%(name)b`` (each name once) replaced by ``$1``, ``$2``..."""
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            names.append(match.group(1))
            return f"${len(names)}"

        text = _NAMED.sub(number, statement)
        if len(set(names)) != len(names):
            raise ValueError("each parameter must appear once")
        return cls(text.encode(), tuple(names))


def send(conn: Connection, statement: Positional, params: dict[str, BinaryArray]) -> None:
    """Send ``statement`` with binary ``params`` and return without waiting for the answer.

    ``conn`` must be idle and in autocommit mode (one statement = one transaction).
    """
    if not conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("a deferred statement needs an idle autocommit connection")
    values = [params[name] for name in statement.names]
    pgconn = conn.pgconn
    pgconn.send_query_params(statement.text, [bytes(value.data) for value in values],
                             [value.array_oid for value in values],
                             [Format.BINARY] * len(values), Format.BINARY)
    conn.wait(generators.send(pgconn))


def finish(conn: Connection) -> PGresult:
    """Wait for the answer of the statement :func:`send` sent: committed when this returns.

    Raises the statement's error (with its SQLSTATE), or the connection's when it broke.
    """
    results: Sequence[PGresult] = conn.wait(generators.fetch_many(conn.pgconn))
    failed = next((r for r in results if r.status != ExecStatus.TUPLES_OK), None)
    if failed is not None or not results:
        if failed is None:
            raise psycopg.OperationalError("no answer to the deferred statement")
        raise errors.error_from_result(failed, encoding=conn.info.encoding)
    return results[0]
