"""Contracts of every message the service reads or writes, as pydantic models.

Pure data: nothing here imports Kafka, PostgreSQL or Bytewax. Field names on the wire are
PascalCase (the producers are .NET services); unknown fields are ignored (minor versions are
additive-only).

Input bounds
------------

Everything an input record can push into an event we emit (action-tracked, session-linked,
session-started, session-ended) has a maximum, decided in the pure decode step
(``dataflows/*/decode.py``, :func:`schemas.outbox.propagated_headers`) before anything is
written. A field over its bound makes the message a contract violation, dead-lettered with
``schema-mismatch``; a header over its bound is dropped, never a reason to dead-letter.

=======================  ===================================  ==================================
copied into the output   maximum                              over the bound / invalid
=======================  ===================================  ==================================
``CorrelationId``        256 characters (code points),        ``schema-mismatch`` (DLQ), on
(envelope, every event)  :data:`MAX_CORRELATION_ID_LENGTH`;    favorites and user-signed-in
                         JSON Schema ``maxLength``; msgspec   alike (the envelope is shared)
                         ``Meta(max_length)`` on the fast
                         path
``traceparent`` header   55 characters: W3C version 00 only   dropped (event emitted without
(every event)            (a later version is passed on as     it); :mod:`schemas.outbox`
                         00, its first 55 characters)
``tracestate`` header    not passed through                   —
``FavoriteId``,          UUID (36 characters as written)      not a UUID: ``schema-mismatch``
``PropertyObjectId``,
``UserId``,
``AnonymousId``
``OccurredAt``           aware datetime (years 1-9999,        not one: ``schema-mismatch``
                         offset at most ±14:00, written in
                         at most 32 characters)
=======================  ===================================  ==================================

Not copied into any output, so bounded only by the record size the broker accepts:
``AggregateId`` and ``AggregateType`` (ours are the new ActionEvent id / SessionId and a
constant), ``Version`` (we write 1), ``CreatedAt`` (we write the server time), ``MessageId``
(only the dedup key and ``source_message_id``; a UUID), unknown fields and payload extras such
as a Note (dropped on parse). The user-signed-in payload (``UserId``, ``AnonymousId``,
``SignedInAt``) is UUIDs and a datetime; the session events take SessionId from the database
and their timestamps from the server clock. Kafka keys of what we emit are UUIDs (36 bytes);
the DLQ is the one output that carries input bytes as they came (its own limits apply there).

So an emitted value is at most about 2.1 KB (2,106 bytes for an action-tracked whose
CorrelationId is 256 control characters, each escaped in six bytes), and its headers at most
one 55-byte ``traceparent`` (``tests/unit/test_input_bounds.py`` checks both).
"""

from schemas.envelope import MAX_CORRELATION_ID_LENGTH

__all__ = ["MAX_CORRELATION_ID_LENGTH"]
