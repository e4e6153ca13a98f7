"""The Grafana dashboard of the user-activity stream, generated with grafana-foundation-sdk.

``python k8s/dashboard.py`` writes ``k8s/grafana-dashboard.json`` and the ConfigMap
``k8s/configmap-grafana-dashboard.yaml`` (labelled ``grafana_dashboard: "1"`` for the Grafana
sidecar); ``python k8s/dashboard.py --check`` exits 1 when the committed files differ from what
this code generates (tests/unit/test_dashboard.py does the same). Edit this file, never the JSON.

Every query is PromQL on the series the service exports (runtime/metrics.py,
sources/progress.py) and on Bytewax's own ``bytewax_*`` metrics (its API server, :3030).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableOption,
    VariableRefresh,
)

K8S = Path(__file__).resolve().parent
JSON_FILE = K8S / "grafana-dashboard.json"
CONFIGMAP_FILE = K8S / "configmap-grafana-dashboard.yaml"
UID = "user-activity-stream"
CONFIGMAP_KEY = "user-activity-stream.json"
NAMESPACE = "user-activity"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SELECTOR = 'namespace=~"$namespace", pod=~"$pod"'
"""The label filter of every service series (both variables default to All = ``.*``)."""
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel."""

    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    """One time-series panel."""

    title: str
    unit: str
    description: str
    queries: tuple[Query, ...]
    width: int = 12


def _s(metric: str, extra: str = "") -> str:
    """``metric{<the dashboard's namespace/pod filter>, extra}``."""
    return f"{metric}{{{SELECTOR}{', ' + extra if extra else ''}}}"


def _p99(metric: str) -> Query:
    return Query(
        f"histogram_quantile(0.99, sum by (le, step_id) (rate({metric}_bucket[{RATE}])))",
        "p99 {{step_id}}",
    )


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Input (per Kafka partition, measured at the source)", (
        PanelSpec(
            "Input lag per partition", "s",
            "now - Kafka CreateTime of the last record read while records wait behind the high"
            " watermark (0 when caught up). UserActivityFavoritesLagHigh fires above 300 s.",
            (Query(f"max by (topic, partition) ({_s('user_activity_input_lag_seconds')})",
                   "{{topic}}[{{partition}}]"),),
        ),
        PanelSpec(
            "Records behind", "short",
            "High watermark - next offset to read, per input partition.",
            (Query(f"sum by (topic, partition) ({_s('user_activity_input_records_behind')})",
                   "{{topic}}[{{partition}}]"),),
        ),
        PanelSpec(
            "Seconds since progress", "s",
            "Seconds since a record was last read while records wait (0 while caught up)."
            " UserActivityInputStalled fires above 300 s.",
            (Query("max by (topic, partition) "
                   f"({_s('user_activity_input_seconds_since_progress')})",
                   "{{topic}}[{{partition}}]"),),
        ),
        PanelSpec(
            "Paused time", "s",
            "Seconds the stream has been paused waiting for PostgreSQL or Kafka (0 when"
            " running). UserActivityStreamPausedTooLong fires above 900 s.",
            (Query(f"max by (pod) ({_s('user_activity_paused_seconds')})", "{{pod}}"),),
        ),
    )),
    ("Outcomes", (
        PanelSpec(
            "Favorites throughput by outcome", "ops",
            "Favorites messages per second: recorded by action type, skipped by reason,"
            " dead-lettered.",
            (
                Query("sum by (action_type) "
                      f"(rate({_s('user_activity_favorites_recorded_total')}[{RATE}]))",
                      "recorded {{action_type}}"),
                Query("sum by (reason) "
                      f"(rate({_s('user_activity_favorites_skipped_total')}[{RATE}]))",
                      "skipped {{reason}}"),
                Query(f"sum (rate({_s('user_activity_favorites_dlq_total')}[{RATE}]))",
                      "dead-lettered"),
            ),
        ),
        PanelSpec(
            "Dead letters and parked outbox rows", "short",
            "Records sent to the dead-letter topics, and outbox rows the broker refused for"
            " good (parked for an operator), per interval.",
            (
                Query(f"sum (increase({_s('user_activity_favorites_dlq_total')}[{RATE}]))",
                      "favorites DLQ"),
                Query("sum (increase("
                      f"{_s('user_activity_session_linking_dlq_total')}[{RATE}]))",
                      "session-linking DLQ"),
                Query("sum by (topic) (increase("
                      f"{_s('user_activity_outbox_parked_total')}[{RATE}]))",
                      "parked {{topic}}"),
            ),
        ),
        PanelSpec(
            "Session-linking outcomes", "ops",
            "user-signed-in messages per second by outcome.",
            (Query("sum by (outcome) "
                   f"(rate({_s('user_activity_session_linking_outcomes_total')}[{RATE}]))",
                   "{{outcome}}"),),
        ),
        PanelSpec(
            "Dedup windows", "short",
            "MessageIds held in the in-memory dedup windows (at most USER_ACTIVITY_DEDUP_MAX_IDS"
            " per flow), and those forgotten before the TTL because the windows were full, per"
            " interval (their redeliveries go to the database, which decides).",
            (
                Query(f"sum by (flow) ({_s('user_activity_dedup_ids')})", "held {{flow}}"),
                Query("sum by (flow) (increase("
                      f"{_s('user_activity_dedup_forgotten_early_total')}[{RATE}]))",
                      "forgotten early {{flow}}"),
            ),
        ),
        PanelSpec(
            "Housekeeping task failures", "short",
            "Unexpected exceptions of a periodic housekeeping task (it runs again at its next"
            " time). UserActivityHousekeepingTaskFailing fires on any.",
            (Query("sum by (pod, task) (increase("
                   f"{_s('user_activity_background_errors_total')}[{RATE}]))",
                   "{{pod}} {{task}}"),),
        ),
    )),
    ("Outbox", (
        PanelSpec(
            "Oldest unpublished outbox row vs stall threshold", "s",
            "Age of the oldest committed, unpublished, unparked outbox row; above the threshold"
            " /readyz is 503 and UserActivityOutboxStalled fires.",
            (
                Query(f"max ({_s('user_activity_outbox_oldest_unpublished_seconds')})",
                      "oldest unpublished"),
                Query(f"max ({_s('user_activity_outbox_stall_threshold_seconds')})",
                      "stall threshold"),
            ),
        ),
        PanelSpec(
            "Outbox published rate", "ops",
            "Outbox rows acknowledged by the broker per second, by topic, and failed attempts.",
            (
                Query("sum by (topic) "
                      f"(rate({_s('user_activity_outbox_published_total')}[{RATE}]))",
                      "published {{topic}}"),
                Query("sum (rate("
                      f"{_s('user_activity_outbox_publish_failures_total')}[{RATE}]))",
                      "failed attempts"),
            ),
        ),
    )),
    ("Bytewax steps (API server :3030)", (
        PanelSpec(
            "Items out per step", "ops",
            "Items each Bytewax step emitted per second (bytewax_item_out_count_total).",
            (Query(f"sum by (step_id) (rate(bytewax_item_out_count_total[{RATE}]))",
                   "{{step_id}}"),),
            width=24,
        ),
        PanelSpec(
            "Input next_batch duration (p99)", "s",
            "Kafka input partitions: duration of one next_batch call.",
            (_p99("bytewax_inp_part_next_batch_duration_seconds"),),
        ),
        PanelSpec(
            "flat_map_batch duration (p99)", "s",
            "Mapper duration per batch (decode, classify).",
            (_p99("bytewax_flat_map_batch_duration_seconds"),),
        ),
        PanelSpec(
            "stateful_batch on_batch duration (p99)", "s",
            "Stateful steps (dedup window) per batch.",
            (_p99("bytewax_stateful_batch_on_batch_duration_seconds"),),
        ),
        PanelSpec(
            "Output write_batch duration (p99)", "s",
            "Partitioned sinks (the PostgreSQL transaction per batch).",
            (_p99("bytewax_out_part_write_batch_duration_seconds"),),
        ),
    )),
)


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel:
    panel = (
        timeseries.Panel().id(panel_id).title(spec.title).description(spec.description)
        .datasource(DATASOURCE).unit(spec.unit).min(0).height(8).span(spec.width)
        .legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM).calcs([]))
    )
    for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
        panel = panel.with_target(
            prometheus.Dataquery().ref_id(ref).expr(query.expr).legend_format(query.legend)
            .range().datasource(DATASOURCE)
        )
    return panel


def _all() -> VariableOption:
    return VariableOption(selected=True, text="All", value="$__all")


def build() -> dict[str, Any]:
    """The dashboard model as Grafana's JSON (a dict)."""
    board = (
        dash.Dashboard("User activity stream")
        .uid(UID)
        .description("Favorites and session linking: input lag and progress per partition,"
                     " outcomes, outbox, Bytewax steps. Generated by k8s/dashboard.py.")
        .tags(["user-activity", "bytewax", "kafka"]).editable()
        .tooltip(DashboardCursorSync.CROSSHAIR).time("now-3h", "now").refresh("30s")
        .timezone("utc")
        .with_variable(dash.DatasourceVariable("datasource").label("Data source")
                       .type("prometheus"))
        .with_variable(
            dash.QueryVariable("namespace").label("Namespace").datasource(DATASOURCE)
            .query("label_values(user_activity_paused_seconds, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True).all_value(".*").current(_all())
        )
        .with_variable(
            dash.QueryVariable("pod").label("Pod").datasource(DATASOURCE)
            .query('label_values(user_activity_paused_seconds{namespace=~"$namespace"}, pod)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True).all_value(".*").multi(True).current(_all())
        )
    )
    panel_id = 0
    for title, specs in ROWS:
        panel_id += 1
        board = board.with_row(dash.Row(title).id(panel_id))
        for spec in specs:
            panel_id += 1
            board = board.with_panel(_panel(spec, panel_id))
    model: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return model


def render_json() -> str:
    """``k8s/grafana-dashboard.json``."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def render_configmap() -> str:
    """``k8s/configmap-grafana-dashboard.yaml``: the JSON for the Grafana sidecar."""
    body = "".join(f"    {line}\n" if line else "\n" for line in render_json().splitlines())
    return (
        "# Generated by k8s/dashboard.py (python k8s/dashboard.py); do not edit.\n"
        "# The Grafana sidecar (grafana.sidecar.dashboards in the Grafana Helm chart) loads\n"
        "# every ConfigMap labelled grafana_dashboard: \"1\"; let it search this namespace\n"
        "# (searchNamespace: ALL or user-activity). The panels read the Prometheus data source\n"
        "# chosen in the dashboard's \"datasource\" variable.\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: user-activity-stream-dashboard\n"
        f"  namespace: {NAMESPACE}\n"
        "  labels:\n"
        "    app.kubernetes.io/name: user-activity-stream\n"
        "    app.kubernetes.io/part-of: user-activity\n"
        '    grafana_dashboard: "1"\n'
        "data:\n"
        f"  {CONFIGMAP_KEY}: |\n"
        f"{body}"
    )


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    return {JSON_FILE: render_json(), CONFIGMAP_FILE: render_configmap()}


def main(argv: list[str] | None = None) -> int:
    """Write the files, or with ``--check`` report (exit 1) those that differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = [path for path, text in outputs().items()
             if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(K8S.parent)} (run python k8s/dashboard.py)")
        return 1 if stale else 0
    for path, text in outputs().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
