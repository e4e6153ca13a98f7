"""One harness for the tests, the benchmark and the demo.

- :mod:`.ports`: a free TCP port (optionally below the ephemeral range);
- :mod:`.env`: :class:`~runtime.settings.Settings` as ``USER_ACTIVITY_*`` variables;
- :mod:`.jobs`: the job as a subprocess (start, kill, terminate, restart on a recovery dir,
  HTTP, metrics, log events, ``wait_until``) and a supervisor that leaves none running;
- :mod:`.metrics`: a Prometheus ``/metrics`` scrape parsed by ``prometheus_client.parser``;
- :mod:`.messages`: favorite and sign-in envelopes as the .NET producers write them;
- :mod:`.sessions`: one session row, or many in bulk.
"""
