"""End-to-end benchmark of the favorites flow on a real Kafka broker and a real PostgreSQL.

``python -m bench`` (see :mod:`bench.run` for the flags) measures, in one run and on one backlog:

- the real job (``python -m bytewax.run dataflows.favorite_actions:flow``, 1 and 2 workers) on a
  backlog of favorites envelopes until every row is committed and every action-tracked message is
  on the output topic;
- a naive reference consumer (one confluent-kafka consumer + psycopg, one transaction per
  message, the same SQL), time-bounded and extrapolated;
- the bare write-path ceiling (``FavoritesStore.record_batch`` fed pre-decoded batches);
- steady-state latency at a fixed produce rate while the job tails;
- the job's RSS holding N MessageIds in its dedup window, and the time from a restart after
  SIGKILL (with Bytewax recovery) to caught-up on a backlog.

Every phase runs against a database that already holds ``--prefill-rows`` action_events rows
(each phase gets its own copy of one prefilled template database, so phases never see each
other's rows). It prints one table and writes ``bench/results.json``.
"""
