"""The Kubernetes manifests in k8s/: schema-valid offline, and keeping the runbook's promises."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cli import check as cli_check
from cli import replay
from runtime.settings import ENV_PREFIX, Settings
from runtime.shutdown import DEADLINE_MARGIN
from runtime.tracing import Sampling, tracing_wanted

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
NAMESPACE = "user-activity"
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule"}
NOT_MANIFESTS = {"prometheus-rules.yaml"}  # a plain Prometheus rules file, see test_alert_rules
DATAFLOW_CONTAINER = "stream"
RECOVERY_DIR = "/var/lib/user-activity/recovery"
# Settings deliberately left unset in the ConfigMap: mutual TLS is not used (SASL_SSL).
UNSET_SETTINGS = {"kafka_ssl_certificate_location", "kafka_ssl_key_location"}

Doc = dict[str, Any]


def _documents() -> list[tuple[str, Doc]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in NOT_MANIFESTS:
            continue
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCUMENTS = _documents()


def _name(doc: Doc) -> str:
    meta = doc["metadata"]
    return str(meta.get("name") or meta["generateName"])


def _id(file: str, doc: Doc) -> str:
    return f"{file}:{doc['kind']}/{_name(doc)}"


def _one(kind: str, name: str) -> Doc:
    [doc] = [d for _, d in DOCUMENTS if d["kind"] == kind and _name(d) == name]
    return doc


def _workloads() -> list[Doc]:
    return [d for _, d in DOCUMENTS if d["kind"] in {"StatefulSet", "Job", "CronJob"}]


def _pod_template(workload: Doc) -> Doc:
    spec = workload["spec"]["jobTemplate"]["spec"] if workload["kind"] == "CronJob" else (
        workload["spec"])
    template: Doc = spec["template"]
    return template


def _pod_spec(workload: Doc) -> Doc:
    spec: Doc = _pod_template(workload)["spec"]
    return spec


def _containers(workload: Doc) -> Iterator[Doc]:
    spec = _pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def _container(workload: Doc, name: str) -> Doc:
    [container] = [c for c in _containers(workload) if c["name"] == name]
    return container


def _env(container: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _plain_env(workload: Doc, container: str) -> dict[str, str]:
    """The literal values (not the downward-API ones) of a container's env."""
    return {k: v for k, v in _env(_container(workload, container)).items() if isinstance(v, str)}


def _labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = _pod_template(workload)["metadata"]["labels"]
    return labels


def _configmap_data(name: str) -> dict[str, str]:
    data: dict[str, str] = _one("ConfigMap", name)["data"]
    return data


def _secret_keys(name: str) -> set[str]:
    return set(_one("Secret", name)["stringData"])


STATEFULSETS = {d["metadata"]["name"]: d for _, d in DOCUMENTS if d["kind"] == "StatefulSet"}
CONFIG = _configmap_data("user-activity-stream-config")
WORKLOADS = pytest.mark.parametrize("workload", _workloads(), ids=_name)
FAVORITES = STATEFULSETS["user-activity-favorites"]
SESSION_LINKING = STATEFULSETS["user-activity-session-linking"]


def test_k8s_holds_every_kind_the_deployment_needs() -> None:
    kinds = {doc["kind"] for _, doc in DOCUMENTS}

    assert kinds >= {
        "Namespace", "ConfigMap", "Secret", "Service", "StatefulSet", "Job",
        "PodDisruptionBudget", "PodMonitor", "PrometheusRule",
    }
    assert {_name(d) for _, d in DOCUMENTS if d["kind"] == "Job"} == {
        "user-activity-migrate", "user-activity-create-topics", "user-activity-backfill-",
    }


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize(
    ("name", "doc"),
    [(n, d) for n, d in DOCUMENTS if d["kind"] not in CUSTOM_KINDS],
    ids=[_id(n, d) for n, d in DOCUMENTS if d["kind"] not in CUSTOM_KINDS],
)
def test_manifest_is_valid_against_the_strict_kubernetes_schema(
    name: str, doc: Doc, version: str
) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_custom_resources_name_their_kind_api_version_and_a_spec() -> None:
    custom = [d for _, d in DOCUMENTS if d["kind"] in CUSTOM_KINDS]

    assert {d["kind"] for d in custom} == CUSTOM_KINDS
    for doc in custom:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert doc["metadata"]["name"]
        assert doc["spec"]


def test_every_namespaced_object_lives_in_the_user_activity_namespace() -> None:
    for name, doc in DOCUMENTS:
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == NAMESPACE
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, _id(name, doc)


@WORKLOADS
def test_every_container_runs_non_root_on_a_read_only_root_without_capabilities(
    workload: Doc,
) -> None:
    pod = _pod_spec(workload)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False

    for container in _containers(workload):
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True, container["name"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]


@WORKLOADS
def test_every_container_has_requests_and_a_memory_limit_and_a_writable_tmp(workload: Doc) -> None:
    empty_dirs = {v["name"] for v in _pod_spec(workload)["volumes"] if "emptyDir" in v}

    for container in _containers(workload):
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]
        [tmp] = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp["name"] in empty_dirs


@pytest.mark.parametrize("statefulset", STATEFULSETS.values(), ids=list(STATEFULSETS))
def test_dataflow_is_probed_on_livez_and_readyz_of_the_configured_http_port(
    statefulset: Doc,
) -> None:
    stream = _container(statefulset, DATAFLOW_CONTAINER)
    ports = {p["name"]: p["containerPort"] for p in stream["ports"]}
    http_port = int(CONFIG["USER_ACTIVITY_HTTP_PORT"])

    assert ports["http"] == http_port
    for probe, path in (
        ("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz"),
    ):
        assert stream[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 0


@pytest.mark.parametrize("statefulset", STATEFULSETS.values(), ids=list(STATEFULSETS))
def test_dataflow_runs_bytewax_with_recovery_on_a_volume_claim_template(statefulset: Doc) -> None:
    stream = _container(statefulset, DATAFLOW_CONTAINER)
    args = stream["args"]
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in stream["volumeMounts"]}
    init = _container(statefulset, "init-recovery")

    assert args[:2] == ["-m", "bytewax.run"]
    assert re.fullmatch(r"dataflows\.\w+:flow", args[2])
    assert dict(zip(args[3::2], args[4::2], strict=True)) == {
        "-r": RECOVERY_DIR, "-s": "30", "-b": "300",
    }
    assert mounts[RECOVERY_DIR] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert _env(init)["RECOVERY_DIR"] == RECOVERY_DIR
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    assert init_mounts[RECOVERY_DIR] == mounts[RECOVERY_DIR]
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain", "whenScaled": "Retain",
    }
    empty_dirs = {v["name"] for v in _pod_spec(statefulset)["volumes"] if "emptyDir" in v}
    assert mounts[stream["workingDir"]] in empty_dirs  # Bytewax's API writes dataflow.json there


def test_recovery_partitions_cover_the_largest_planned_worker_count() -> None:
    for statefulset in STATEFULSETS.values():
        partitions = int(_plain_env(statefulset, "init-recovery")["RECOVERY_PARTITIONS"])
        stream = _plain_env(statefulset, DATAFLOW_CONTAINER)

        workers = statefulset["spec"]["replicas"] * int(stream["BYTEWAX_WORKERS_PER_PROCESS"])
        assert partitions >= workers


def test_favorites_runs_as_a_bytewax_cluster_of_parallel_pods_behind_a_headless_service() -> None:
    spec = FAVORITES["spec"]
    service = _one("Service", spec["serviceName"])
    stream = _container(FAVORITES, DATAFLOW_CONTAINER)
    env = _env(stream)
    hostfile_env = _plain_env(FAVORITES, "write-hostfile")

    assert spec["replicas"] == 2
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"] == {"type": "OnDelete"}  # never two images in one cluster
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= _labels(FAVORITES).items()
    assert env["BYTEWAX_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["BYTEWAX_STATEFULSET_NAME"] == FAVORITES["metadata"]["name"]
    assert hostfile_env["BYTEWAX_STATEFULSET_NAME"] == FAVORITES["metadata"]["name"]
    assert hostfile_env["BYTEWAX_SERVICE_NAME"] == spec["serviceName"]
    assert int(hostfile_env["BYTEWAX_REPLICAS"]) == spec["replicas"]
    assert hostfile_env["BYTEWAX_HOSTFILE_PATH"] == env["BYTEWAX_HOSTFILE_PATH"]
    worker_port = int(hostfile_env["BYTEWAX_WORKER_PORT"])
    assert {"name": "worker", "containerPort": worker_port} in stream["ports"]


def test_session_linking_runs_one_single_process_dataflow() -> None:
    env = _env(_container(SESSION_LINKING, DATAFLOW_CONTAINER))

    assert SESSION_LINKING["spec"]["replicas"] == 1
    assert "BYTEWAX_POD_NAME" not in env
    assert "BYTEWAX_HOSTFILE_PATH" not in env
    assert _plain_env(SESSION_LINKING, "init-recovery")["RECOVERY_INIT_REPLICAS"] == "1"


def _run_script(name: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = _configmap_data("user-activity-stream-scripts")[name]
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(
        ["/bin/sh", "-c", script, name], env={"PATH": path, **env}, cwd=cwd,
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_bytewax_run_derives_each_pods_process_id_and_the_cluster_addresses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bytewax.run import _parse_args

    spec = FAVORITES["spec"]
    name = FAVORITES["metadata"]["name"]
    stream = _container(FAVORITES, DATAFLOW_CONTAINER)
    stream_env = _plain_env(FAVORITES, DATAFLOW_CONTAINER)
    hostfile = tmp_path / "hostfile.txt"
    for variable in ("BYTEWAX_PROCESS_ID", "BYTEWAX_ADDRESSES"):
        monkeypatch.delenv(variable, raising=False)

    for ordinal in range(spec["replicas"]):
        pod = f"{name}-{ordinal}"
        result = _run_script(
            "write-hostfile.sh",
            {**_plain_env(FAVORITES, "write-hostfile"), "POD_NAME": pod,
             "BYTEWAX_HOSTFILE_PATH": str(hostfile), "DNS_WAIT_SECONDS": "0"},
            ROOT,
        )
        assert result.returncode == 0, result.stderr
        monkeypatch.setattr(sys, "argv", ["bytewax.run", *stream["args"][2:]])
        monkeypatch.setenv("BYTEWAX_POD_NAME", pod)
        monkeypatch.setenv("BYTEWAX_STATEFULSET_NAME", stream_env["BYTEWAX_STATEFULSET_NAME"])
        monkeypatch.setenv("BYTEWAX_HOSTFILE_PATH", str(hostfile))

        args = _parse_args()

        assert args.process_id == ordinal
        assert args.addresses == ";".join(
            f"{name}-{n}.{spec['serviceName']}:2101" for n in range(spec["replicas"])
        )


def test_write_hostfile_refuses_a_pod_beyond_the_declared_replicas(tmp_path: Path) -> None:
    env = _plain_env(FAVORITES, "write-hostfile")
    ordinal = FAVORITES["spec"]["replicas"]

    result = _run_script(
        "write-hostfile.sh",
        {**env, "POD_NAME": f"user-activity-favorites-{ordinal}",
         "BYTEWAX_HOSTFILE_PATH": str(tmp_path / "hostfile.txt"), "DNS_WAIT_SECONDS": "0"},
        ROOT,
    )

    assert result.returncode == 1
    assert "BYTEWAX_REPLICAS" in result.stderr


def test_init_recovery_gives_each_pod_a_disjoint_share_once_and_later_pods_none(
    tmp_path: Path,
) -> None:
    env = _plain_env(FAVORITES, "init-recovery")
    partitions, init_replicas = int(env["RECOVERY_PARTITIONS"]), int(env["RECOVERY_INIT_REPLICAS"])
    held: dict[int, set[str]] = {}

    for _ in range(2):  # the second start of every pod changes nothing
        for ordinal in range(init_replicas + 1):  # + a pod added by a later scale-out
            volume = tmp_path / str(ordinal)
            volume.mkdir(exist_ok=True)
            pod = f"user-activity-favorites-{ordinal}"
            result = _run_script(
                "init-recovery.sh", {**env, "RECOVERY_DIR": str(volume), "POD_NAME": pod}, ROOT
            )
            assert result.returncode == 0, result.stderr
            held[ordinal] = {p.name for p in volume.glob("part-*.sqlite3")}

    assert held[init_replicas] == set()
    assert sum(len(parts) for parts in held.values()) == partitions
    assert set().union(*held.values()) == {f"part-{n}.sqlite3" for n in range(partitions)}
    assert held[0] == {f"part-{n}.sqlite3" for n in range(0, partitions, init_replicas)}


def _setting_env_names() -> dict[str, str]:
    return {name: ENV_PREFIX + name.upper() for name in Settings.model_fields}


def test_configmap_sets_every_non_secret_setting_and_the_secret_every_secret_one() -> None:
    config = CONFIG
    secret = _secret_keys("user-activity-stream-secrets")
    names = _setting_env_names()
    fields = Settings.model_fields
    secret_fields = {n for n, f in fields.items() if "SecretStr" in str(f.annotation)}

    settings_keys = {key for key in config if not key.startswith("OTEL_")}  # OpenTelemetry's own
    assert settings_keys | secret <= set(names.values())  # no typo, no stale name
    assert not set(config) & {names[n] for n in secret_fields}
    assert {names[n] for n in set(names) - secret_fields - UNSET_SETTINGS} - {
        "USER_ACTIVITY_KAFKA_SASL_USERNAME"
    } <= set(config)
    assert {"USER_ACTIVITY_DATABASE_URL", "USER_ACTIVITY_KAFKA_SASL_PASSWORD",
            "USER_ACTIVITY_KAFKA_SASL_USERNAME"} <= secret


def test_configmap_names_only_standard_otel_variables_and_leaves_tracing_off() -> None:
    otel = {key: value for key, value in CONFIG.items() if key.startswith("OTEL_")}

    assert set(otel) == {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME",
                         "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED"}
    assert not tracing_wanted(otel)  # the endpoint is empty until an operator sets it
    assert tracing_wanted({**otel, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert Sampling.from_env(otel) == Sampling.ratio(0.01)


def test_configmap_and_example_secret_form_valid_settings_for_sasl_ssl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {
        **CONFIG,
        **_one("Secret", "user-activity-stream-secrets")["stringData"],
    }.items():
        monkeypatch.setenv(key, value)

    settings = Settings()

    client = settings.kafka_client_config()
    assert client["security.protocol"] == "SASL_SSL"
    assert {"sasl.mechanism", "sasl.username", "sasl.password", "ssl.ca.location"} <= set(client)


@WORKLOADS
def test_every_main_container_reads_settings_from_the_configmap_and_the_secret(
    workload: Doc,
) -> None:
    ca_location = Path(CONFIG["USER_ACTIVITY_KAFKA_SSL_CA_LOCATION"])
    ca_volumes = {
        v["name"] for v in _pod_spec(workload)["volumes"]
        if v.get("secret", {}).get("secretName") == "user-activity-kafka-ca"
    }

    for container in _pod_spec(workload)["containers"]:
        assert container["envFrom"] == [
            {"configMapRef": {"name": "user-activity-stream-config"}},
            {"secretRef": {"name": "user-activity-stream-secrets"}},
        ]
        if container["name"] not in {"migrate", "maintain"}:  # the others talk to Kafka
            [mount] = [m for m in container["volumeMounts"] if m["name"] in ca_volumes]
            assert Path(mount["mountPath"]) == ca_location.parent
    assert ca_location.name in _secret_keys("user-activity-kafka-ca")


def test_jobs_run_the_operator_commands() -> None:
    assert _pod_spec(_one("Job", "user-activity-migrate"))["containers"][0]["args"] == [
        "-m", "cli", "migrate",
    ]
    assert _pod_spec(_one("Job", "user-activity-create-topics"))["containers"][0]["args"] == [
        "-m", "cli", "create-topics",
    ]


@pytest.mark.parametrize(("statefulset", "flow"),
                         [(FAVORITES, "favorites"), (SESSION_LINKING, "session-linking")],
                         ids=["favorites", "session-linking"])
def test_each_dataflow_pod_checks_what_its_flow_needs_last_before_the_stream_starts(
    statefulset: Doc, flow: str,
) -> None:
    stream = _container(statefulset, DATAFLOW_CONTAINER)
    check = _pod_spec(statefulset)["initContainers"][-1]

    assert check["name"] == "check"
    assert check["args"] == ["-m", "cli", "check", "--flow", flow]
    assert flow in cli_check.FLOWS
    assert check["image"] == stream["image"]
    assert check["envFrom"] == stream["envFrom"]  # the job's settings: TLS, SASL, topics
    ca = [m for m in stream["volumeMounts"] if m["name"] == "kafka-ca"]
    assert [m for m in check["volumeMounts"] if m["name"] == "kafka-ca"] == ca


def test_the_maintenance_cronjob_runs_the_maintain_command_one_at_a_time() -> None:
    cronjob = _one("CronJob", "user-activity-maintenance")

    assert _pod_spec(cronjob)["containers"][0]["args"] == ["-m", "cli", "maintain"]
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    assert _pod_spec(cronjob)["restartPolicy"] == "Never"


def test_backfill_job_is_a_dry_run_replay_with_its_own_recovery_store_on_a_volume() -> None:
    job = _one("Job", "user-activity-backfill-")
    [container] = _pod_spec(job)["containers"]
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)

    assert container["args"][:3] == ["-m", "cli", "replay"]
    args = parser.parse_args(container["args"][3:])  # the flags exist in cli/replay.py
    assert args.dry_run is True
    assert args.from_ts is not None
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.recovery_dir) in mounts
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "backfill"


def test_removing_the_dry_run_line_turns_the_backfill_template_into_a_real_replay() -> None:
    text = (K8S / "job-backfill.yaml").read_text()
    real = re.sub(r"(?m)^ *- --dry-run\n", "", text)  # the runbook's sed '/^ *- --dry-run$/d'

    [container] = _pod_spec(yaml.safe_load(real))["containers"]
    assert "--dry-run" not in container["args"]
    kubernetes_validate.validate(yaml.safe_load(real), SCHEMA_VERSIONS[-1], strict=True)


def test_pod_disruption_budget_lets_one_favorites_pod_go_at_a_time() -> None:
    pdb = _one("PodDisruptionBudget", "user-activity-favorites")

    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= _labels(FAVORITES).items()


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_pod_monitor_scrapes_both_dataflows_on_their_named_ports_but_not_the_jobs() -> None:
    monitor = _one("PodMonitor", "user-activity-stream")
    selector = monitor["spec"]["selector"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]

    for statefulset in STATEFULSETS.values():
        assert _selects(selector, _labels(statefulset))
        ports = {p["name"] for p in _container(statefulset, DATAFLOW_CONTAINER)["ports"]}
        assert {e["port"] for e in endpoints} <= ports
    for job in (d for _, d in DOCUMENTS if d["kind"] == "Job"):
        assert not _selects(selector, _labels(job))
    [bytewax] = [e for e in endpoints if e["port"] == "bytewax-api"]
    assert bytewax["metricRelabelings"] == [
        {"sourceLabels": ["__name__"], "regex": "bytewax_.*", "action": "keep"},
    ]


def test_dockerfile_builds_a_non_root_python_image_from_the_app_directories() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()

    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    assert "USER 10001:10001" in dockerfile
    assert 'ENTRYPOINT ["python"]' in dockerfile
    assert "PYTHONDONTWRITEBYTECODE=1" in dockerfile
    assert "pip install ." in dockerfile
    assert "[dev]" not in dockerfile
    for directory in ("schemas", "dataflows", "sinks", "sources", "runtime", "migrations"):
        assert re.search(rf"(?m)^COPY {directory} \./{directory}$", dockerfile), directory


@pytest.mark.parametrize("statefulset", STATEFULSETS.values(), ids=list(STATEFULSETS))
def test_the_pods_grace_outlasts_the_stops_own_deadline(statefulset: Doc) -> None:
    """A stop ends itself at the grace plus the deadline's margin (exit 75), before the kill."""
    grace = float(CONFIG["USER_ACTIVITY_STOP_GRACE_SECONDS"])
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        grace + DEADLINE_MARGIN)
