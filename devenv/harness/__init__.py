"""One harness for the tests, the benchmark and the demo: ports, env, jobs, metrics, messages."""
