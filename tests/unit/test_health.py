"""runtime.health: running / paused / dead, and the HTTP endpoints Kubernetes probes use.

The handler is tested on its own ``ThreadingHTTPServer`` (port 0) bound to a fresh
:class:`Health`.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import orjson
import pytest
from prometheus_client import REGISTRY

from runtime.health import Health, _Handler, serve_http


@pytest.fixture
def health() -> Health:
    return Health(stall_seconds=0.2)


@pytest.fixture
def base_url(health: Health) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"health": health})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    # shutdown() waits for the loop's next poll: 0.5 s by default, at every test's teardown
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def paused_gauge() -> float:
    value = REGISTRY.get_sample_value("user_activity_paused_seconds")
    assert value is not None
    return value


# ---- the state -------------------------------------------------------------------------------


def test_a_fresh_process_is_running() -> None:
    snap = Health().snapshot()

    assert (snap.state, snap.dependency, snap.paused_since, snap.attempt) == (
        "running", None, None, 0,
    )


def test_a_retry_pauses_on_its_dependency_with_the_attempt_and_error_class(
    health: Health,
) -> None:
    before = time.time()

    health.paused("postgres", 1, "OperationalError", waiter="sink-0")
    health.paused("postgres", 2, "AdminShutdown", waiter="sink-0")
    snap = health.snapshot()

    assert (snap.state, snap.dependency, snap.attempt, snap.last_error) == (
        "paused", "postgres", 2, "AdminShutdown",
    )
    assert snap.paused_since is not None and before <= snap.paused_since <= time.time()
    assert snap.waiting == (("sink-0", "postgres"),)


def test_later_attempts_keep_the_time_the_pause_began(health: Health) -> None:
    health.paused("kafka", 1, "_TRANSPORT", waiter="outbox")
    since = health.snapshot().paused_since
    time.sleep(0.01)

    health.paused("kafka", 5, "_TRANSPORT", waiter="outbox")
    health.paused("postgres", 6, "OperationalError", waiter="outbox")  # its dependency changed

    assert health.snapshot().paused_since == since
    assert health.snapshot().dependency == "postgres"


def test_the_dependency_paused_longest_is_reported(health: Health) -> None:
    health.paused("postgres", 3, "OperationalError", waiter="sink-0")
    time.sleep(0.01)
    health.paused("kafka", 1, "_TRANSPORT", waiter="favorite-added[0]")

    assert health.snapshot().dependency == "postgres"
    health.resumed(waiter="sink-0")
    assert (health.snapshot().state, health.snapshot().dependency) == ("paused", "kafka")


def test_one_waiter_resuming_leaves_the_others_paused_on_the_same_dependency(
    health: Health,
) -> None:
    # Twelve input partitions wait for Kafka on their own: the first to reconnect must not
    # make the process ready while another still waits.
    for partition in range(3):
        health.paused("kafka", 1, "_TRANSPORT", waiter=f"favorite-added[{partition}]")

    health.resumed(waiter="favorite-added[0]")
    health.resumed(waiter="favorite-added[1]")
    still = health.snapshot()
    health.resumed(waiter="favorite-added[2]")

    assert (still.state, still.dependency) == ("paused", "kafka")
    assert still.waiting == (("favorite-added[2]", "kafka"),)
    assert health.snapshot().state == "running"


def test_resuming_every_waiter_is_running_again(health: Health) -> None:
    health.paused("postgres", 1, "OperationalError", waiter="sink-0")

    health.resumed(waiter="sink-0")
    health.resumed(waiter="favorite-added[0]")  # never paused: harmless

    assert health.snapshot().state == "running"
    assert health.snapshot().waiting == ()


def test_no_progress_for_longer_than_the_stall_limit_is_dead(health: Health) -> None:
    time.sleep(0.25)
    dead = health.snapshot()

    health.beat()

    assert dead.state == "dead" and dead.seconds_since_progress > 0.2
    assert health.snapshot().state == "running"


def test_a_long_pause_is_never_dead(health: Health) -> None:
    health.paused("postgres", 1, "OperationalError", waiter="sink-0")
    time.sleep(0.25)

    assert health.snapshot().state == "paused"


def test_a_stall_while_a_waiter_is_paused_is_a_pause_on_its_dependency(health: Health) -> None:
    # A Kafka outage outlasting the outbox's stall bound: the stall is the outage's as long as
    # a waiter (an input partition, the outbox publisher) still waits for Kafka.
    health.paused("kafka", 3, "_TRANSPORT", waiter="favorite-added[0]")
    health.paused("kafka", 1, "DeliveryFailedError", waiter="outbox")
    health.stalled("outbox", "oldest unpublished outbox row is 65s old (> 60s)")

    health.resumed(waiter="favorite-added[0]")  # its metadata probe answered
    snap = health.snapshot()
    assert (snap.state, snap.dependency, snap.waiting) == ("paused", "kafka",
                                                           (("outbox", "kafka"),))
    assert snap.stalled == (("outbox", "oldest unpublished outbox row is 65s old (> 60s)"),)

    health.resumed(waiter="outbox")  # the broker acknowledged its records: the backlog drains
    assert (health.snapshot().state, health.snapshot().dependency) == ("stalled", None)
    health.unstalled("outbox")
    assert health.snapshot().state == "running"


def test_the_paused_seconds_gauge_counts_while_paused_and_returns_to_zero(
    health: Health,
) -> None:
    health.paused("postgres", 1, "OperationalError", waiter="sink-0")
    time.sleep(0.05)
    health.refresh_gauge()
    during = paused_gauge()

    health.resumed(waiter="sink-0")

    assert during >= 0.05
    assert paused_gauge() == 0


def test_the_json_body_names_state_dependency_since_attempt_and_waiters(
    health: Health,
) -> None:
    health.paused("kafka", 4, "_ALL_BROKERS_DOWN", waiter="favorite-added[3]")
    health.paused("kafka", 1, "KafkaException", waiter="outbox")

    body = orjson.loads(health.snapshot().as_json())

    assert body["state"] == "paused"
    assert (body["dependency"], body["attempt"], body["last_error"]) == (
        "kafka", 4, "_ALL_BROKERS_DOWN",
    )
    assert body["waiting"] == {"favorite-added[3]": "kafka", "outbox": "kafka"}
    assert body["paused_since"].endswith("Z")
    assert isinstance(body["seconds_since_progress"], float)


def test_concurrent_pauses_and_resumes_leave_a_consistent_state(health: Health) -> None:
    def churn(waiter: str) -> None:
        for attempt in range(1, 300):
            health.paused("postgres", attempt, "OperationalError", waiter=waiter)
            health.snapshot()
            health.resumed(waiter=waiter)

    threads = [threading.Thread(target=churn, args=(f"sink-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert health.snapshot().state == "running"


# ---- the endpoints ---------------------------------------------------------------------------


def test_running_is_live_and_ready(base_url: str, health: Health) -> None:
    health.beat()

    live = get(f"{base_url}/livez")
    ready = get(f"{base_url}/readyz")

    assert (live[0], ready[0]) == (200, 200)
    assert live[1] == ready[1] == "application/json"
    assert orjson.loads(ready[2])["state"] == "running"


def test_paused_stays_live_but_is_not_ready(base_url: str, health: Health) -> None:
    health.paused("postgres", 7, "OperationalError", waiter="sink-0")

    live = get(f"{base_url}/livez")
    ready = get(f"{base_url}/readyz")

    assert (live[0], ready[0]) == (200, 503)
    body = orjson.loads(ready[2])
    assert (body["state"], body["dependency"], body["attempt"]) == ("paused", "postgres", 7)


def test_dead_is_neither_live_nor_ready(base_url: str, health: Health) -> None:
    time.sleep(0.25)

    live = get(f"{base_url}/livez")
    ready = get(f"{base_url}/readyz")

    assert (live[0], ready[0]) == (503, 503)
    assert orjson.loads(live[2])["state"] == "dead"


def test_a_query_string_is_ignored(base_url: str, health: Health) -> None:
    health.beat()

    assert get(f"{base_url}/readyz?verbose=1")[0] == 200


def test_metrics_serves_the_prometheus_registry_with_a_fresh_paused_gauge(
    base_url: str, health: Health,
) -> None:
    health.paused("postgres", 1, "OperationalError", waiter="sink-0")
    time.sleep(0.05)

    status, content_type, body = get(f"{base_url}/metrics")

    assert status == 200 and content_type.startswith("text/plain")
    lines = body.decode().splitlines()
    [gauge] = [line for line in lines if line.startswith("user_activity_paused_seconds ")]
    assert float(gauge.split()[1]) >= 0.05
    assert any(line.startswith("user_activity_favorites_retries_total") for line in lines)
    health.resumed(waiter="sink-0")


def test_an_unknown_path_is_404(base_url: str) -> None:
    status, _type, body = get(f"{base_url}/healthz")

    assert status == 404
    assert orjson.loads(body) == {"error": "not found"}


def test_port_zero_disables_the_process_server() -> None:
    assert serve_http("127.0.0.1", 0, Health()) is None
