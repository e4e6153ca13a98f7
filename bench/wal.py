"""What a stretch of WAL is made of: positions, and a breakdown read with ``pg_walinspect``.

``pg_walinspect`` (PostgreSQL 15+) is created if missing, which needs a superuser; each
breakdown returns ``None`` when it is not available or the WAL of the range is gone (a
checkpoint may recycle segments older than its redo point). Reading the WAL is read-only.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

WINDOW_BYTES = 128 * 2**20
"""The most WAL :func:`wal_composition` reads by record; a longer range is sampled in its middle."""

_BY_RELATION = """
SELECT coalesce(c.relname, 'other: ' || r.resource_manager),
       count(*), sum(r.record_length), sum(r.fpi_length)
  FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) r
  LEFT JOIN pg_class c ON c.relfilenode::text
       = substring(r.block_ref FROM 'rel \\d+/\\d+/(\\d+)')
 GROUP BY 1 ORDER BY 3 DESC
"""


def wal_lsn(conn: psycopg.Connection[Any]) -> int:
    """The current WAL insert position in bytes."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def lsn_text(conn: psycopg.Connection[Any]) -> str:
    """The current WAL insert position as an LSN (``'16/B374D848'``)."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    return str(row[0]) if row else "0/0"


def wal_by_relation(conn: psycopg.Connection[Any], start: str, end: str, events: int
                    ) -> dict[str, float] | None:
    """WAL bytes per event between two LSNs by relation (record bytes, page images included).

    ``page images`` is the part of the total that full-page images take.
    """
    rows = _records_by_relation(conn, start, end)
    if rows is None:
        return None
    result = {name: round(size / events, 1) for name, _count, size, _fpi in rows}
    result["page images"] = round(sum(fpi for *_r, fpi in rows) / events, 1)
    result["total"] = round(sum(size for _n, _c, size, _f in rows) / events, 1)
    return result


def wal_composition(conn: psycopg.Connection[Any], start: str, end: str, events: int,
                    window_bytes: int = WINDOW_BYTES) -> dict[str, Any] | None:
    """The WAL between ``start`` and ``end`` per event: record data vs full-page images.

    ``records`` / ``page_images`` / ``total`` (bytes per event) cover the whole range, from
    ``pg_get_wal_stats`` (one pass, no per-record rows). ``by_relation`` splits each relation's
    share the same way (``records`` + ``page_images`` per event, and records per event), from
    ``pg_get_wal_records_info``: over the whole range when it is at most ``window_bytes``,
    else over a window of that size in its middle, scaled by the window's share of the range's
    events (``sampled`` says which; a sample assumes the middle of a run is like the rest of it,
    and the first touch of a page after a checkpoint happens mostly early, so a middle window
    undercounts page images against the whole range). ``read_s``: the seconds reading took.
    """
    if events <= 0:
        return None
    t0 = time.monotonic()
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        # pg_walinspect reads only flushed WAL: an insert position just taken may be ahead
        row = conn.execute("SELECT least(%s::pg_lsn, pg_current_wal_flush_lsn())::text",
                           (end,)).fetchone()
        end = str(row[0]) if row else end
        stats = conn.execute(
            "SELECT coalesce(sum(combined_size), 0), coalesce(sum(fpi_size), 0),"
            " coalesce(sum(count), 0), %s::pg_lsn - %s::pg_lsn"
            " FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, per_record => false)",
            (end, start, start, end)).fetchone()
        assert stats is not None
        total_bytes, fpi_bytes, records, span = (int(v) for v in stats)
        sampled = span > window_bytes
        w_start, w_end = start, end
        if sampled:
            row = conn.execute(
                "SELECT %s::pg_lsn + %s::numeric, %s::pg_lsn + %s::numeric",
                (start, (span - window_bytes) // 2, start, (span + window_bytes) // 2),
            ).fetchone()
            assert row is not None
            w_start, w_end = str(row[0]), str(row[1])
        rows = _records_by_relation(conn, w_start, w_end)
    except psycopg.Error:
        return None
    if rows is None:
        return None
    window_records = sum(count for _n, count, _s, _f in rows) or 1
    window_events = events * window_records / max(records, 1)  # the window's share of events
    by_relation = {
        name: {"records": round((size - fpi) / window_events, 1),
               "page_images": round(fpi / window_events, 1),
               "wal_records_per_event": round(count / window_events, 3)}
        for name, count, size, fpi in rows
    }
    return {
        "records": round((total_bytes - fpi_bytes) / events, 1),
        "page_images": round(fpi_bytes / events, 1),
        "total": round(total_bytes / events, 1),
        "wal_records_per_event": round(records / events, 2),
        "range_bytes": span,
        "sampled": {"from": w_start, "to": w_end, "bytes": window_bytes} if sampled else None,
        "by_relation": by_relation,
        "read_s": round(time.monotonic() - t0, 2),
    }


def _records_by_relation(conn: psycopg.Connection[Any], start: str, end: str
                         ) -> list[tuple[str, int, int, int]] | None:
    """(relation, WAL records, bytes incl. page images, page-image bytes), largest first."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        rows = conn.execute(_BY_RELATION, (start, end)).fetchall()
    except psycopg.Error:
        return None
    return [(str(name), int(count), int(size), int(fpi)) for name, count, size, fpi in rows]


def describe_composition(composition: dict[str, Any] | None, top: int = 6) -> str:
    """One line: records + page images per event, and the largest relations."""
    if composition is None:
        return "no breakdown (pg_walinspect unavailable, or the range's WAL is gone)"
    largest = sorted(composition["by_relation"].items(),
                     key=lambda item: -(item[1]["records"] + item[1]["page_images"]))[:top]
    parts = ", ".join(f"{name} {v['records']:.0f}+{v['page_images']:.0f}" for name, v in largest)
    window = " (by relation: a middle window)" if composition["sampled"] else ""
    return (f"records {composition['records']:.0f} + page images "
            f"{composition['page_images']:.0f} = {composition['total']:.0f}{window}; "
            f"{parts}; read in {composition['read_s']} s")
