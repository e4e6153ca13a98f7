"""The Quix Streams peer: the favorites backlog through a Quix Streams 3.28 app (bench only).

Runs in its own venv (``.venv-peer``), imports nothing of this project, configured by ``PEER_*``
(set by :func:`bench.baselines.run_peer`). Per topic, one StreamingDataFrame: JSON (orjson); the
owner filter (exactly one of UserId and AnonymousId, neither the empty GUID); MessageId dedup in
RocksDB state with a TTL (event time); the session by ``PostgresLookup`` (cached 60 s, 200k
entries), messages without one dropped; the row as JSON to the output topic, and
``PostgreSQLSink`` inserting the rows at each checkpoint (1 s, ``ON CONFLICT DO NOTHING``). No
outbox (the output goes before its row commits), no idempotency mark, no single transaction,
no DLQ; ``PostgreSQLSink`` takes a batch's columns from its first row (UserId may be dropped).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from quixstreams import Application
from quixstreams.dataframe.joins.lookups.postgresql import PostgresLookup
from quixstreams.models.topics.exceptions import TopicNotFoundError
from quixstreams.sinks.community.postgresql import PostgreSQLSink

_EMPTY = "00000000-0000-0000-0000-000000000000"
_SESSION = (
    "SELECT id, anonymous_id, user_id, linked_at FROM user_activity.sessions"
    " WHERE (anonymous_id = %(anon)s::uuid OR (%(anon)s IS NULL AND user_id = %(user)s::uuid))"
    " ORDER BY (status = 'Active') DESC, last_activity_at DESC, id DESC LIMIT 1"
)


def _owner(value: dict[str, Any]) -> bool:
    payload = value.get("Payload") or {}
    user, anon = payload.get("UserId"), payload.get("AnonymousId")
    return (user is None) != (anon is None) and _EMPTY not in (user, anon)


def _flat(value: dict[str, Any]) -> dict[str, Any]:
    payload = value["Payload"]
    return {"message_id": value["MessageId"], "anon": payload.get("AnonymousId"),
            "user": payload.get("UserId") if payload.get("AnonymousId") is None else None,
            "favorite_id": payload["FavoriteId"], "property_object_id":
            payload["PropertyObjectId"], "occurred_at": payload["OccurredAt"]}


def _first_time(ttl: timedelta) -> Any:
    def seen(value: dict[str, Any], state: Any) -> bool:
        if state.exists(value["message_id"]):
            return False
        state.set(value["message_id"], 1, ttl=ttl)
        return True

    return seen


def _row(action_type: str) -> Any:
    def row(value: dict[str, Any]) -> dict[str, Any]:
        session_id, anonymous_id, user_id, linked_at = value["session"]
        occurred = datetime.fromisoformat(value["occurred_at"])
        linked = linked_at is not None and linked_at <= occurred
        return {"id": str(uuid.uuid4()), "action_type": action_type, "session_id": str(session_id),
                "anonymous_id": str(anonymous_id), "user_id": str(user_id) if linked else None,
                "occurred_at": value["occurred_at"], "favorite_id": value["favorite_id"].lower(),
                "property_object_id": value["property_object_id"],
                "source_message_id": value["message_id"],
                "recorded_at": datetime.now(UTC).isoformat()}

    return row


def main() -> None:
    """Run the app until SIGTERM.

    Quix Streams describes a changelog topic right after creating it; on a busy single broker
    the topic may not be listed yet (TopicNotFoundError). Built again, it finds the topic.
    """
    for attempt in range(10):
        try:
            app = _app()
        except TopicNotFoundError:
            if attempt == 9:
                raise
            time.sleep(0.5)
        else:
            app.run()
            return


def _app() -> Application:
    """The app's two pipelines, its topics created (module doc)."""
    env = os.environ
    db = {"host": env["PEER_PG_HOST"], "port": int(env["PEER_PG_PORT"]),
          "dbname": env["PEER_PG_DBNAME"], "user": env["PEER_PG_USER"],
          "password": env.get("PEER_PG_PASSWORD", "")}
    app = Application(broker_address=env["PEER_BOOTSTRAP"], consumer_group=env["PEER_GROUP"],
                      auto_offset_reset="earliest", state_dir=env["PEER_STATE_DIR"],
                      commit_interval=1.0, loglevel="WARNING")
    ttl = timedelta(seconds=float(env["PEER_DEDUP_TTL_SECONDS"]))
    output = app.topic(env["PEER_OUTPUT_TOPIC"], value_serializer="json")
    for topic, action_type in ((env["PEER_ADDED_TOPIC"], "AddToFavorites"),
                               (env["PEER_REMOVED_TOPIC"], "RemoveFromFavorites")):
        sdf = app.dataframe(app.topic(topic, value_deserializer="json"))
        sdf = sdf.filter(_owner).apply(_flat).filter(_first_time(ttl), stateful=True)
        lookup = PostgresLookup(**db, cache_size=200_000)  # every owner of a full run
        field = lookup.query_field(query=_SESSION, first_match_only=True)
        sdf = sdf.join_lookup(lookup, {"session": field},
                              on=lambda v, _k: f"{v['anon']}/{v['user']}")
        sdf = sdf.filter(lambda v: v["session"] is not None).apply(_row(action_type))
        sdf = sdf.to_topic(output)
        sdf.sink(PostgreSQLSink(**db, table_name="action_events", schema_name="user_activity",
                                schema_auto_update=False, include_metadata=False,
                                on_conflict_do_nothing=True))
    return app


if __name__ == "__main__":
    main()
