"""Where an undecodable batch ends (:func:`sources.undecodable.find_batch_end`), pure."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from sources.undecodable import find_batch_end


@given(base=st.integers(0, 10**12), records=st.integers(1, 10**6), after=st.integers(0, 10**6))
def test_the_end_is_the_first_offset_after_the_batch_in_logarithmically_many_probes(
    base: int, records: int, after: int,
) -> None:
    end, high = base + records, base + records + after
    asked: list[int] = []

    def inside(offset: int) -> bool:
        asked.append(offset)
        return offset < end

    assert find_batch_end(base, high, inside) == end
    assert all(base < offset < high for offset in asked)  # neither base nor high is asked
    assert len(asked) <= 2 * math.log2(records) + 2
    assert len(set(asked)) == len(asked)  # no offset asked twice


class _Batch:
    """A batch ending before ``end``; remembers the offsets asked."""

    def __init__(self, end: int) -> None:
        self.end = end
        self.asked: list[int] = []

    def inside(self, offset: int) -> bool:
        self.asked.append(offset)
        return offset < self.end


def test_a_batch_of_one_record_costs_one_probe() -> None:
    batch = _Batch(42)
    assert find_batch_end(41, 1_000, batch.inside) == 42
    assert batch.asked == [42]


def test_a_batch_that_reaches_the_high_watermark_ends_there_and_high_is_never_asked() -> None:
    batch = _Batch(10**9)
    assert find_batch_end(10, 17, batch.inside) == 17
    assert 17 not in batch.asked
    nothing = _Batch(0)
    assert find_batch_end(10, 11, nothing.inside) == 11
    assert nothing.asked == []  # nothing to ask
