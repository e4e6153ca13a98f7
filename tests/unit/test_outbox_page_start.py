"""The outbox page's one lower bound (sinks.outbox.table.page_start) selects what two did.

A page reads the transactions started after the watermark ``delivered`` past the cursor
``after``: ``txid >= xmax(delivered) AND (txid, id) > after``. One row bound, ``(txid, id) >
page_start(...)``, lets the btree scan start there instead of at the cursor; it must select the
same rows, or a row is skipped (lost) or sent again.
"""

from __future__ import annotations

from uuid import UUID

from hypothesis import given
from hypothesis import strategies as st

from sinks.outbox.table import page_start

_IDS = st.sampled_from([UUID(int=0), UUID(int=1), UUID(int=2**127), UUID(int=2**128 - 1)])


@given(window=st.tuples(st.integers(1, 50), st.integers(0, 50)),
       after=st.tuples(st.integers(0, 120), _IDS), row=st.tuples(st.integers(1, 120), _IDS))
def test_one_bound_selects_what_the_two_bounds_did(
    window: tuple[int, int], after: tuple[int, UUID], row: tuple[int, UUID],
) -> None:
    xmin, span = window
    (after_txid, after_id), (txid, row_id) = after, row
    xmax = xmin + span
    delivered = f"{xmin}:{xmax}:"
    start = page_start(delivered, (after_txid, after_id))

    two_bounds = txid >= xmax and (txid, row_id) > (after_txid, after_id)
    one_bound = (txid, row_id) > start

    assert one_bound == two_bounds


def test_the_start_is_the_cursor_once_the_window_is_past_xmax() -> None:
    cursor = (105, UUID(int=7))

    assert page_start("90:100:95,97", cursor) == cursor
    assert page_start("90:100:95,97", (3, UUID(int=7))) == (99, UUID(int=2**128 - 1))
