"""k8s/'s pods translated into docker run calls (devenv/deploy/pods.py), on the real manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devenv.deploy.manifests import Manifests, TranslationError
from devenv.deploy.pods import PodRun, pod_hosts, translate_pod

K8S = Path(__file__).resolve().parents[2] / "k8s"
IMAGE = "user-activity-stream:test"
FAVORITES = "user-activity-favorites"


@pytest.fixture(scope="module")
def manifests() -> Manifests:
    return Manifests.load(K8S)


def favorites_pod(manifests: Manifests, ordinal: int, tmp: Path) -> PodRun:
    workload = manifests.get("StatefulSet", FAVORITES)
    hosts = pod_hosts(workload, ["127.0.10.1", "127.0.10.2"])
    return translate_pod(
        manifests, workload, pod_name=f"{FAVORITES}-{ordinal}", pod_ip=f"127.0.10.{ordinal + 1}",
        image=IMAGE, pod_dir=tmp / "pods" / f"{FAVORITES}-{ordinal}", claims_dir=tmp / "claims",
        hosts=hosts, ports={3030: 40000 + ordinal},
    )


def job_pod(manifests: Manifests, name: str, tmp: Path) -> PodRun:
    return translate_pod(manifests, manifests.get("Job", name), pod_name=f"{name}-x",
                         pod_ip="127.0.12.1", image=IMAGE, pod_dir=tmp / "job",
                         claims_dir=tmp / "claims")


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def test_init_containers_come_first_in_manifest_order(manifests: Manifests, tmp_path: Path) -> None:
    pod = favorites_pod(manifests, 1, tmp_path)

    assert [c.name for c in pod.init_containers] == ["write-hostfile", "init-recovery", "check"]
    assert [c.name for c in pod.containers] == ["stream"]
    assert all(c.restart == "no" for c in pod.init_containers)
    assert pod.container("stream").restart == "always"


def test_downward_api_fields_are_the_pod_name(manifests: Manifests, tmp_path: Path) -> None:
    pod = favorites_pod(manifests, 1, tmp_path)

    assert pod.init_containers[0].env["POD_NAME"] == f"{FAVORITES}-1"
    stream = pod.container("stream")
    assert stream.env["BYTEWAX_POD_NAME"] == f"{FAVORITES}-1"
    assert stream.env["BYTEWAX_STATEFULSET_NAME"] == FAVORITES


def test_env_from_config_map_and_secret_then_env(manifests: Manifests, tmp_path: Path) -> None:
    test = manifests.with_values(
        "ConfigMap", "user-activity-stream-config",
        {"USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092"},
        without=["USER_ACTIVITY_KAFKA_SASL_MECHANISM"],
    ).with_values("Secret", "user-activity-stream-secrets",
                  {"USER_ACTIVITY_DATABASE_URL": "postgresql://local/db"})

    stream = favorites_pod(test, 0, tmp_path).container("stream")

    assert stream.env["USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS"] == "127.0.0.1:9092"
    assert "USER_ACTIVITY_KAFKA_SASL_MECHANISM" not in stream.env
    assert stream.env["USER_ACTIVITY_DATABASE_URL"] == "postgresql://local/db"
    assert stream.env["USER_ACTIVITY_TOPIC_PARTITIONS"] == "6"  # untouched ConfigMap key
    assert stream.env["MALLOC_ARENA_MAX"] == "2"  # env, after envFrom


def test_security_context_becomes_user_read_only_and_no_capabilities(
        manifests: Manifests, tmp_path: Path) -> None:
    for container in (*favorites_pod(manifests, 0, tmp_path).init_containers,
                      favorites_pod(manifests, 0, tmp_path).container("stream")):
        args = container.docker_args("test=1")

        assert flag_values(args, "--user") == ["10001:10001"]
        assert flag_values(args, "--group-add") == ["10001"]  # fsGroup
        assert "--read-only" in args
        assert flag_values(args, "--cap-drop") == ["ALL"]
        assert flag_values(args, "--security-opt") == ["no-new-privileges"]
        assert flag_values(args, "--network") == ["host"]


def test_run_as_root_is_refused_when_run_as_non_root(manifests: Manifests, tmp_path: Path) -> None:
    job: dict[str, Any] = manifests.get("Job", "user-activity-migrate")
    job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0

    with pytest.raises(TranslationError, match="runAsNonRoot"):
        translate_pod(manifests, job, pod_name="m", pod_ip="127.0.12.1", image=IMAGE,
                      pod_dir=tmp_path, claims_dir=tmp_path)


def test_claims_are_one_host_directory_per_pod_and_kept(manifests: Manifests, tmp_path: Path
                                                         ) -> None:
    pods = [favorites_pod(manifests, i, tmp_path) for i in (0, 1)]

    claims = [next(v for v in p.volumes if v.name == "recovery") for p in pods]
    assert [c.host_path for c in claims] == [tmp_path / "claims" / f"recovery-{FAVORITES}-{i}"
                                             for i in (0, 1)]
    assert all(c.persistent and c.group == 10001 for c in claims)
    stream = pods[1].container("stream")
    mount = next(m for m in stream.mounts if m.volume == "recovery")
    assert (mount.host_path, mount.target, mount.read_only) == (
        claims[1].host_path, "/var/lib/user-activity/recovery", False)


def test_empty_dirs_are_shared_by_the_pods_containers(manifests: Manifests, tmp_path: Path
                                                      ) -> None:
    pod = favorites_pod(manifests, 0, tmp_path)

    hostfile = next(v for v in pod.volumes if v.name == "hostfile")
    assert hostfile.kind == "emptyDir" and not hostfile.persistent and hostfile.mode == 0o777
    writer = next(m for m in pod.init_containers[0].mounts if m.volume == "hostfile")
    reader = next(m for m in pod.container("stream").mounts if m.volume == "hostfile")
    assert writer.host_path == reader.host_path == hostfile.host_path
    assert (writer.read_only, reader.read_only) == (False, True)


def test_a_memory_empty_dir_lies_in_the_memory_dir(manifests: Manifests, tmp_path: Path) -> None:
    workload = manifests.get("StatefulSet", FAVORITES)
    pod = translate_pod(manifests, workload, pod_name=f"{FAVORITES}-0", pod_ip="127.0.10.1",
                        image=IMAGE, pod_dir=tmp_path / "pod", claims_dir=tmp_path / "claims",
                        ports={3030: 40000}, memory_dir=tmp_path / "shm")

    paths = {v.name: v.host_path for v in pod.volumes}
    assert paths["hostfile"] == tmp_path / "shm" / f"{FAVORITES}-0" / "hostfile"  # medium: Memory
    assert paths["tmp"] == tmp_path / "pod" / "volumes" / "tmp"


def test_config_map_volume_holds_the_scripts_read_only(manifests: Manifests, tmp_path: Path
                                                       ) -> None:
    pod = favorites_pod(manifests, 0, tmp_path)

    scripts = next(v for v in pod.volumes if v.name == "scripts")
    assert set(scripts.files) == {"write-hostfile.sh", "init-recovery.sh"}
    assert scripts.mode == 0o444
    assert "BYTEWAX_HOSTFILE_PATH" in scripts.files["write-hostfile.sh"]
    init = pod.init_containers[0]
    assert init.entrypoint == "/bin/sh"
    assert init.arguments == ("/opt/user-activity/scripts/write-hostfile.sh",)
    assert next(m for m in init.mounts if m.volume == "scripts").read_only


def test_statefulset_pod_names_resolve_to_each_pods_own_address(manifests: Manifests) -> None:
    hosts = pod_hosts(manifests.get("StatefulSet", FAVORITES), ["127.0.10.1", "127.0.10.2"])

    assert hosts[f"{FAVORITES}-0.{FAVORITES}"] == "127.0.10.1"
    assert hosts[f"{FAVORITES}-1.{FAVORITES}"] == "127.0.10.2"
    assert hosts[f"{FAVORITES}-1.{FAVORITES}.user-activity.svc.cluster.local"] == "127.0.10.2"


def test_wildcard_binds_get_the_pod_address_and_a_distinct_port(manifests: Manifests,
                                                                 tmp_path: Path) -> None:
    pods = [favorites_pod(manifests, i, tmp_path) for i in (0, 1)]

    streams = [p.container("stream") for p in pods]
    assert [s.env["USER_ACTIVITY_HTTP_HOST"] for s in streams] == ["127.0.10.1", "127.0.10.2"]
    assert [s.env["BYTEWAX_DATAFLOW_API_PORT"] for s in streams] == ["40000", "40001"]
    assert [s.env["USER_ACTIVITY_HTTP_PORT"] for s in streams] == ["9100", "9100"]
    changes = "\n".join(pods[1].changes)
    assert "BYTEWAX_DATAFLOW_API_PORT 3030 -> 40001" in changes
    assert "USER_ACTIVITY_HTTP_HOST 0.0.0.0 -> 127.0.10.2" in changes
    assert "-> user-activity-stream:test" in pods[1].changes[0]


def test_a_wildcard_port_without_a_host_port_is_refused(manifests: Manifests, tmp_path: Path
                                                        ) -> None:
    with pytest.raises(TranslationError, match="BYTEWAX_DATAFLOW_API_PORT"):
        translate_pod(manifests, manifests.get("StatefulSet", FAVORITES),
                      pod_name=f"{FAVORITES}-0", pod_ip="127.0.10.1", image=IMAGE,
                      pod_dir=tmp_path, claims_dir=tmp_path)


def test_probes_aim_at_the_pod_address_like_the_kubelet(manifests: Manifests, tmp_path: Path
                                                         ) -> None:
    stream = favorites_pod(manifests, 1, tmp_path).container("stream")

    probes = {p.kind: p for p in stream.probes}
    assert probes["startup"].url == "http://127.0.10.2:9100/livez"
    assert (probes["startup"].period_seconds, probes["startup"].failure_threshold) == (5, 60)
    assert probes["liveness"].url == "http://127.0.10.2:9100/livez"
    assert probes["readiness"].url == "http://127.0.10.2:9100/readyz"


def test_docker_args_end_with_image_command_and_args(manifests: Manifests, tmp_path: Path
                                                     ) -> None:
    stream = favorites_pod(manifests, 0, tmp_path).container("stream")

    args = stream.docker_args("test=1")

    assert args[:2] == ["run", "--detach"]
    image_at = args.index(IMAGE)
    assert args[image_at + 1:image_at + 4] == [
        "-m", "bytewax.run", "dataflows.favorite_actions:flow"]
    assert "--entrypoint" not in args  # only args: the image's ENTRYPOINT (python) stays
    assert flag_values(args, "--workdir") == ["/var/run/bytewax"]
    assert flag_values(args, "--stop-timeout") == ["30"]
    assert flag_values(args, "--memory") == ["1g"] and flag_values(args, "--cpus") == ["2"]
    assert f"{FAVORITES}-1.{FAVORITES}:127.0.10.2" in flag_values(args, "--add-host")


def test_job_restart_policies(manifests: Manifests, tmp_path: Path) -> None:
    migrate = job_pod(manifests, "user-activity-migrate", tmp_path).containers[0]
    backfill = job_pod(manifests, "user-activity-backfill-", tmp_path).containers[0]

    assert migrate.restart == "no"  # restartPolicy: Never
    assert backfill.restart == "on-failure:4"  # OnFailure, backoffLimit 4
    assert migrate.cpus == "0.5" and migrate.memory == "256m"


def test_an_unknown_downward_api_field_is_refused(manifests: Manifests, tmp_path: Path) -> None:
    job: dict[str, Any] = manifests.get("Job", "user-activity-migrate")
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]

    with pytest.raises(TranslationError, match=r"spec\.nodeName"):
        translate_pod(manifests, job, pod_name="m", pod_ip="127.0.12.1", image=IMAGE,
                      pod_dir=tmp_path, claims_dir=tmp_path)
