"""The fast path's choice (sinks.outbox.fast_path.sendable) and its queue (Offers): pure.

An ordered offer never overtakes a transaction the window has still to send; an offer already
covered is sent by no one again; a held topic's rows always go the window's way.
"""

from __future__ import annotations

from uuid import uuid4

from schemas.outbox import OutboxRow
from sinks.outbox.fast_path import Offer, Offers, sendable
from sinks.outbox.progress import Progress


def _offer(txid: int, topic: str = "action-tracked", *, ordered: bool = True,
           rows: int = 1) -> Offer:
    made = [OutboxRow(uuid4(), topic, b"k", b"v", {}) for _ in range(rows)]
    return Offer(txid, made, ordered)


_CAUGHT_UP = Progress("100:100:")


def test_every_fresh_offer_goes_when_the_fast_path_is_caught_up() -> None:
    offers = [_offer(100), _offer(101, ordered=False)]

    assert sendable(offers, _CAUGHT_UP, behind=False, held=set()) == (offers, False)


def test_behind_only_unordered_offers_go_and_the_rest_is_left_to_the_window() -> None:
    ordered, unordered = _offer(100), _offer(101, ordered=False)

    assert sendable([ordered, unordered], _CAUGHT_UP, behind=True, held=set()) == (
        [unordered], True)


def test_a_window_under_way_holds_ordered_offers_back_as_behind_does() -> None:
    under_way = Progress("100:100:", target="105:110:105,106", after=(102, uuid4()))
    ordered, unordered = _offer(105), _offer(106, ordered=False)

    assert sendable([ordered, unordered], under_way, behind=False, held=set()) == (
        [unordered], True)


def test_an_offer_the_progress_covers_is_neither_sent_nor_left() -> None:
    progress = Progress("100:100:").with_sent([100])
    delivered_before = _offer(99)  # visible to ``delivered``: a window sent it
    sent_already = _offer(100)

    assert sendable([delivered_before, sent_already], progress, behind=True, held=set()) == (
        [], False)


def test_an_offer_with_a_held_topics_row_waits_even_unordered() -> None:
    held = _offer(100, "crm-held", ordered=False)
    free = _offer(101, ordered=False)

    assert sendable([held, free], _CAUGHT_UP, behind=False, held={"crm-held"}) == ([free], True)


def test_the_queue_hands_out_offers_in_order_up_to_a_row_budget_but_one_at_least() -> None:
    offers = Offers(limit=10)
    big, small = _offer(1, rows=7), _offer(2, rows=2)
    offers.put(big)
    offers.put(small)

    assert offers.take(rows=5) == ([big], None)  # over the budget alone: still handed out
    assert offers.take(rows=5) == ([small], None)
    assert offers.take() == ([], None)


def test_a_full_queue_drops_the_offer_and_says_when() -> None:
    offers = Offers(limit=1)
    first, dropped = _offer(1), _offer(2)
    offers.put(first)
    offers.put(dropped)

    taken, dropped_at = offers.take()
    assert taken == [first]
    assert dropped_at is not None
    assert offers.take() == ([], None)  # said once
