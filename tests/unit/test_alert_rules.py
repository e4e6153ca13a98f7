"""k8s/prometheus-rules.yaml: the required alerts, on metrics the code really exports.

Their behaviour is evaluated by promtool (tests/unit/test_promtool_rules.py, k8s/tests/).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import runtime.metrics
from sources.progress import INPUT_PROGRESS

K8S = Path(__file__).resolve().parents[2] / "k8s"
RULES_FILE = K8S / "prometheus-rules.yaml"
RULE_RESOURCE = K8S / "prometheusrule.yaml"
RUNBOOK = K8S / "README.md"
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
METRIC = re.compile(r"\b(?:user_activity|bytewax)_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}

Rule = dict[str, Any]


def _rules() -> list[Rule]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


RULES = _rules()


def _alert(name: str) -> Rule:
    [rule] = [r for r in RULES if r.get("alert") == name]
    return rule


def _exported_series() -> set[str]:
    series = set()
    for collector in vars(runtime.metrics).values():
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                series |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    for family in INPUT_PROGRESS.collect():  # computed at scrape time, see sources.progress
        series |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return series


def _runbook_anchors() -> set[str]:
    headings = re.findall(r"(?m)^#+ (.+)$", RUNBOOK.read_text())
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


EXPECTED_ALERTS = {
    "UserActivityFavoritesLagHigh",
    "UserActivityFavoritesDeadLettered",
    "UserActivityFavoritesInvalidOwnerBurst",
    "UserActivityFavoritesNoSessionBurst",
    "UserActivityStreamPausedTooLong",
    "UserActivityStreamDown",
    "UserActivityOutboxPublishFailing",
    "UserActivitySessionLinkingLagHigh",
    "UserActivitySessionLinkingDeadLettered",
    "UserActivitySessionLinkingLateConflict",
    "UserActivityOutboxStalled",
    "UserActivityOutboxRowsParked",
    "UserActivityOutboxTopicHeld",
    "UserActivityOutboxTransactionHanging",
    "UserActivityInputStalled",
    "UserActivityInputRecordsExpired",
    "UserActivityInputRecordsUndecodable",
    "UserActivityInputConsumerErrors",
    "UserActivityInputTopicUnavailable",
    "UserActivityInputTopicRecreated",
    "UserActivityInputTopicCompacted",
    "UserActivityHousekeepingTaskFailing",
    "UserActivityRecoveryVolumeLow",
    "UserActivityStorageNotReclaimed",
    "UserActivityPartitionsMissingAhead",
}
# Alerts whose gauge is itself a duration, so that a `for` would only add delay.
WITHOUT_FOR = {"UserActivityOutboxStalled", "UserActivityOutboxTopicHeld",
               "UserActivityOutboxTransactionHanging"}


def _expr(name: str) -> str:
    return " ".join(str(_alert(name)["expr"]).split())


def test_the_rules_hold_exactly_the_required_alerts() -> None:
    assert {rule["alert"] for rule in RULES} == EXPECTED_ALERTS


def test_lag_alert_fires_once_a_favorite_has_waited_five_minutes() -> None:
    rule = _alert("UserActivityFavoritesLagHigh")

    assert _expr("UserActivityFavoritesLagHigh") == (
        "max by (namespace, pod) (user_activity_favorites_lag_seconds) > 240")
    assert rule["for"] == "30s"


def test_outbox_stalled_compares_the_oldest_unpublished_row_with_the_threshold_at_once() -> None:
    rule = _alert("UserActivityOutboxStalled")

    assert _expr("UserActivityOutboxStalled") == (
        "max by (namespace) (user_activity_outbox_oldest_unpublished_seconds"
        " - user_activity_outbox_stall_threshold_seconds) > 0"
    )
    assert "for" not in rule


def test_a_held_topic_is_compared_with_the_stall_threshold_per_topic_at_once() -> None:
    assert _expr("UserActivityOutboxTopicHeld") == (
        "max by (namespace, topic) (user_activity_outbox_held_seconds"
        " - on (namespace, pod) group_left user_activity_outbox_stall_threshold_seconds) > 0"
    )


@pytest.mark.parametrize(
    ("name", "counter"),
    [("UserActivityOutboxRowsParked", "user_activity_outbox_parked_total"),
     ("UserActivityHousekeepingTaskFailing", "user_activity_background_errors_total"),
     ("UserActivityInputRecordsExpired", "user_activity_input_records_expired_total")],
)
def test_counter_alerts_fire_on_any_increase_also_of_a_series_first_seen_at_one(
    name: str, counter: str
) -> None:
    expr = _expr(name)

    assert re.search(rf"increase\({counter}\[15m\]\)\) > 0", expr)
    assert f"{counter} unless {counter} offset 15m" in expr


def test_input_stalled_needs_a_backlog_and_five_minutes_without_progress_while_not_paused() -> None:
    expr = _expr("UserActivityInputStalled")

    assert "user_activity_input_seconds_since_progress > 300" in expr
    assert "and user_activity_input_records_behind > 0" in expr
    assert "unless on (namespace, pod)" in expr and "user_activity_paused_seconds" in expr


def test_dlq_alert_fires_on_any_increase_of_favorites_dead_letters() -> None:
    rule = _alert("UserActivityFavoritesDeadLettered")

    assert re.search(r"increase\(user_activity_favorites_dlq_total\[\d+m\]\)\) > 0$", rule["expr"])


def test_invalid_owner_alert_watches_the_rate_of_invalid_owner_skips() -> None:
    rule = _alert("UserActivityFavoritesInvalidOwnerBurst")

    assert re.search(
        r'rate\(user_activity_favorites_skipped_total\{reason="invalid-owner"\}\[\d+m\]\)',
        rule["expr"],
    )


def test_paused_alert_fires_when_the_stream_waits_on_a_dependency_too_long() -> None:
    rule = _alert("UserActivityStreamPausedTooLong")

    assert "user_activity_paused_seconds" in rule["expr"]
    assert rule["labels"]["severity"] == "critical"


def test_every_rule_names_only_series_the_service_exports() -> None:
    exported = _exported_series()

    for rule in RULES:
        for name in METRIC.findall(rule["expr"]):
            assert name in exported, f"{rule['alert']}: {name} is not exported by runtime.metrics"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: str(r.get("alert")))
def test_every_alert_has_expr_duration_severity_summary_and_a_runbook_section(rule: Rule) -> None:
    if rule["alert"] in WITHOUT_FOR:
        assert set(rule) == {"alert", "expr", "labels", "annotations"}
    else:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
        assert DURATION.match(rule["for"])
    assert re.fullmatch(r"UserActivity[A-Za-z]+", rule["alert"])
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"]
    assert rule["annotations"]["description"]
    path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
    assert path == "k8s/README.md"
    assert anchor == rule["alert"].lower()
    assert anchor in _runbook_anchors()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: str(r.get("alert")))
def test_every_expression_has_balanced_brackets_and_valid_range_durations(rule: Rule) -> None:
    expr = rule["expr"]
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"[^"]*"', '""', expr):  # label values may hold anything
        if char in "([{":
            stack.append(char)
        elif char in pairs:
            assert stack and stack.pop() == pairs[char], expr
    assert not stack, expr
    for window in re.findall(r"\[([^\]]+)\]", expr):
        assert DURATION.match(window), window


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in RULES]

    assert len(names) == len(set(names))


def test_prometheus_rule_resource_carries_exactly_the_plain_rules_file() -> None:
    resource = yaml.safe_load(RULE_RESOURCE.read_text())

    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]
