"""The favorites statement for new messages, and when the store sends it (pure)."""

from __future__ import annotations

import pytest

from dataflows.favorite_actions.sql import query
from dataflows.favorite_actions.store import ConflictGuess, without_conflict_clauses


def test_the_statement_for_new_messages_is_record_actions_without_its_two_conflict_clauses(
) -> None:
    statement = query("record_actions")
    fresh = without_conflict_clauses(statement)

    assert statement.count("DO NOTHING") - fresh.count("DO NOTHING") == 2
    removed = [line for line in statement.splitlines() if line not in fresh.splitlines()]
    assert [line.strip() for line in removed] == [
        "ON CONFLICT (key, processed_on) DO NOTHING",
        "ON CONFLICT (source_message_id) WHERE source_message_id IS NOT NULL DO NOTHING",
    ]


def test_a_statement_without_the_clauses_is_refused() -> None:
    with pytest.raises(ValueError, match="ON CONFLICT"):
        without_conflict_clauses(without_conflict_clauses(query("record_actions")))


def _sends(guess: ConflictGuess, count: int) -> list[bool]:
    return [guess.fresh() for _ in range(count)]


def test_fresh_until_a_conflict_then_with_on_conflict_for_a_doubling_number_of_batches() -> None:
    guess = ConflictGuess()
    assert _sends(guess, 3) == [True, True, True]

    guess.conflicted()
    assert _sends(guess, 2) == [False, True]  # one batch with ON CONFLICT, then try again
    guess.conflicted()
    assert _sends(guess, 3) == [False, False, True]
    guess.conflicted()
    assert _sends(guess, 5) == [False] * 4 + [True]

    guess.passed(fresh=True)  # a fresh batch passed: back to a wait of one
    guess.conflicted()
    assert _sends(guess, 2) == [False, True]


def test_a_replay_of_recorded_messages_costs_one_failed_batch_per_max_wait() -> None:
    guess = ConflictGuess()
    failed = 0
    for _ in range(10 * ConflictGuess.MAX_WAIT):
        if guess.fresh():
            failed += 1  # every batch of a replay conflicts
            guess.conflicted()
        else:
            guess.passed(fresh=False)
    assert failed <= 10 + 11  # the doubling up to MAX_WAIT, then one per MAX_WAIT batches
