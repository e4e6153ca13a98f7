"""Pods of ``k8s/*.yaml`` as ``docker run`` arguments on one host (pure: no process, no file).

Translated as the kubelet runs them: init containers in order, command and args, ``envFrom``
then ``env`` (downward API included), the security context, emptyDir / configMap / secret
volumes and one host directory per ``volumeClaimTemplate`` (kept across replacements), limits,
grace period, restart policy, httpGet probes. Each pod gets its own loopback address, its pod
DNS names resolve to it, and ``BYTEWAX_DATAFLOW_API_PORT`` a distinct host port.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

Object = dict[str, Any]
LABEL = "user-activity-deploy-test=1"
"""Every container carries it: the test removes exactly what it made."""
API_PORT = "BYTEWAX_DATAFLOW_API_PORT"


class TranslationError(ValueError):
    """A manifest uses something this translation cannot run on one host."""


class Manifests(dict[tuple[str, str], Object]):
    """The objects of ``k8s/*.yaml`` by (kind, name); ``generateName`` counts as the name."""

    @classmethod
    def load(cls, directory: Path) -> Manifests:
        """Every ``*.yaml`` directly in ``directory``; documents without ``kind`` are skipped."""
        found = cls()
        for path in sorted(directory.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if isinstance(doc, dict) and "kind" in doc:
                    meta = doc.get("metadata", {})
                    found[(doc["kind"], meta.get("name") or meta.get("generateName"))] = doc
        return found

    def get_copy(self, kind: str, name: str) -> Object:
        """A deep copy of the object (to edit, as an operator edits a template)."""
        if (kind, name) not in self:
            raise TranslationError(f"no {kind} {name!r} in the manifests")
        return copy.deepcopy(self[(kind, name)])

    def data(self, kind: str, name: str) -> dict[str, str]:
        """The keys of a ConfigMap, or of a Secret (``data`` decoded, then ``stringData``)."""
        obj = self.get_copy(kind, name)
        values = {str(k): str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "Secret":
            values = {k: base64.b64decode(v).decode() for k, v in values.items()}
        return values | {str(k): str(v) for k, v in (obj.get("stringData") or {}).items()}

    def with_values(self, kind: str, name: str, values: Mapping[str, str],
                    without: Iterable[str] = ()) -> Manifests:
        """A copy where ConfigMap/Secret ``name`` has ``values`` and not the keys ``without``."""
        obj = self.get_copy(kind, name)
        merged = {k: v for k, v in (self.data(kind, name) | dict(values)).items()
                  if k not in set(without)}
        obj.pop("data", None)
        obj["stringData" if kind == "Secret" else "data"] = merged
        return Manifests({**self, (kind, name): obj})


@dataclass(frozen=True)
class Volume:
    """The host directory of one pod volume; ``persistent``: a claim, kept across pods."""

    name: str
    kind: str
    host_path: Path
    mode: int
    group: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    persistent: bool = False


class Mount(NamedTuple):
    """A volume mounted into one container."""

    volume: str
    host_path: Path
    target: str
    read_only: bool


class Probe(NamedTuple):
    """An httpGet probe, aimed where the kubelet would aim it."""

    kind: str  # startup | liveness | readiness
    url: str
    period_seconds: float
    timeout_seconds: float
    failure_threshold: int
    initial_delay_seconds: float


@dataclass(frozen=True)
class Container:
    """One container of a pod: its ``docker run`` arguments and what the test reads of it."""

    name: str  # the Docker container's: <pod>.<container>
    args: list[str]  # after ``docker``
    env: Mapping[str, str]
    mounts: tuple[Mount, ...]
    restart: str
    stop_timeout: int
    probes: Mapping[str, Probe]


@dataclass(frozen=True)
class Pod:
    """A pod: volumes, init containers in order, containers, and what the translation changed."""

    name: str
    ip: str
    volumes: tuple[Volume, ...]
    init_containers: tuple[Container, ...]
    containers: Mapping[str, Container]
    hosts: Mapping[str, str]
    changes: tuple[str, ...]


def pod_hosts(statefulset: Object, ips: Sequence[str]) -> dict[str, str]:
    """The DNS names of a StatefulSet's pods (ordinal i at ``ips[i]``), as its headless Service."""
    meta = statefulset["metadata"]
    namespace, service = meta.get("namespace", "default"), statefulset["spec"]["serviceName"]
    return {host: ip for i, ip in enumerate(ips)
            for base in [f"{meta['name']}-{i}.{service}"]
            for host in (base, f"{base}.{namespace}", f"{base}.{namespace}.svc.cluster.local")}


def translate_pod(manifests: Manifests, workload: Object, *, pod_name: str, pod_ip: str, image: str,
                  pod_dir: Path, claims_dir: Path, hosts: Mapping[str, str] | None = None,
                  ports: Mapping[int, int] | None = None, memory_dir: Path | None = None) -> Pod:
    """The pod template of a StatefulSet or Job as one :class:`Pod`."""
    if workload["kind"] not in ("StatefulSet", "Job"):
        raise TranslationError(f"cannot run a {workload['kind']}")
    spec, ports = workload["spec"]["template"]["spec"], dict(ports or {})
    pod_security = spec.get("securityContext", {})
    fs_group = pod_security.get("fsGroup")
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip,
              "metadata.namespace": workload["metadata"].get("namespace", "default")}
    for key, value in workload["spec"]["template"].get("metadata", {}).get("labels", {}).items():
        fields[f"metadata.labels['{key}']"] = str(value)
    volumes = _volumes(manifests, workload, spec, pod_name, pod_dir=pod_dir,
                       claims_dir=claims_dir, memory_dir=memory_dir)
    images = sorted({c["image"] for c in (*spec.get("initContainers", []), *spec["containers"])})
    changes = [f"{pod_name}: image {', '.join(images)} -> {image} (built from this tree; --pull "
               "never)"]
    policy = spec.get("restartPolicy", "Always")
    restart = {"Always": "always", "Never": "no"}.get(
        policy, f"on-failure:{int(workload['spec'].get('backoffLimit', 6))}")
    grace = int(spec.get("terminationGracePeriodSeconds", 30))

    def container(c: Object, init: bool) -> Container:
        where = f"{pod_name}/{c['name']}"
        env = _environment(manifests, c, fields, where)
        if env.get("USER_ACTIVITY_HTTP_HOST") == "0.0.0.0":
            env["USER_ACTIVITY_HTTP_HOST"] = pod_ip
            changes.append(f"{where}: USER_ACTIVITY_HTTP_HOST 0.0.0.0 -> {pod_ip} (host "
                           "networking: 0.0.0.0 in a pod is the pod's own address)")
        if API_PORT in env:
            port = int(env[API_PORT])
            if port not in ports:
                raise TranslationError(f"{where}: {API_PORT}={port} is bound on 0.0.0.0; no "
                                       "host port given for it")
            env[API_PORT] = str(ports[port])
            changes.append(f"{where}: {API_PORT} {port} -> {env[API_PORT]} (Bytewax 0.21.1 binds"
                           " it on 0.0.0.0: pods on one host need distinct ports)")
        security = pod_security | c.get("securityContext", {})
        uid = security.get("runAsUser")
        if uid is None:
            raise TranslationError(f"{where}: no runAsUser (the image's user is not known here)")
        if security.get("runAsNonRoot") and int(uid) == 0:
            raise TranslationError(f"{where}: runAsNonRoot with runAsUser 0")
        if security.get("seccompProfile", {}).get("type", "RuntimeDefault") != "RuntimeDefault":
            raise TranslationError(f"{where}: a seccompProfile other than RuntimeDefault")
        mounts = tuple(_mount(m, volumes, where) for m in c.get("volumeMounts", []))
        command = [str(a) for a in c.get("command", [])]
        limits = c.get("resources", {}).get("limits", {})
        args = ["run", "--detach", "--name", f"{pod_name}.{c['name']}", "--label", LABEL,
                "--network", "host", "--pull", "never",
                "--user", f"{uid}:{security.get('runAsGroup', uid)}",
                "--restart", "no" if init else restart, "--stop-timeout", str(grace)]
        args += ["--group-add", str(fs_group)] if fs_group is not None else []
        args += ["--read-only"] if security.get("readOnlyRootFilesystem") else []
        for flag, caps in (("--cap-drop", "drop"), ("--cap-add", "add")):
            for cap in security.get("capabilities", {}).get(caps, []):
                args += [flag, cap]
        if security.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if "memory" in limits:
            args += ["--memory", _memory(str(limits["memory"]))]
        if "cpu" in limits:
            cpu = str(limits["cpu"])
            args += ["--cpus", f"{int(cpu[:-1]) / 1000:g}" if cpu.endswith("m") else cpu]
        if "workingDir" in c:
            args += ["--workdir", c["workingDir"]]
        for host, ip in sorted((hosts or {}).items()):
            args += ["--add-host", f"{host}:{ip}"]
        for name, value in env.items():
            args += ["--env", f"{name}={value}"]
        for m in mounts:
            args += ["--mount", f"type=bind,source={m.host_path},target={m.target}"
                     + (",readonly" if m.read_only else "")]
        args += ["--entrypoint", command[0]] if command else []
        args += [image, *command[1:], *(str(a) for a in c.get("args", []))]
        probes = {} if init else _probes(c, pod_ip, ports)
        return Container(f"{pod_name}.{c['name']}", args, env, mounts,
                         "no" if init else restart, grace, probes)

    inits = tuple(container(c, True) for c in spec.get("initContainers", []))
    main = {c["name"]: container(c, False) for c in spec["containers"]}
    return Pod(pod_name, pod_ip, tuple(volumes), inits, main, dict(hosts or {}), tuple(changes))


def _environment(manifests: Manifests, c: Object, fields: Mapping[str, str], where: str
                 ) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            values = manifests.data("ConfigMap", source["configMapRef"]["name"])
        elif "secretRef" in source:
            values = manifests.data("Secret", source["secretRef"]["name"])
        else:
            raise TranslationError(f"{where}: envFrom {source} is not translated")
        env.update({source.get("prefix", "") + k: v for k, v in values.items()})
    for item in c.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            if path not in fields:
                raise TranslationError(f"{where}: downward-API field {path!r} is not translated")
            env[item["name"]] = fields[path]
        elif key_ref := ref.get("configMapKeyRef") or ref.get("secretKeyRef"):
            kind = "ConfigMap" if "configMapKeyRef" in ref else "Secret"
            env[item["name"]] = manifests.data(kind, key_ref["name"])[key_ref["key"]]
        else:
            raise TranslationError(f"{where}: env {item['name']}: {ref} is not translated")
    return env


def _volumes(manifests: Manifests, workload: Object, spec: Object, pod: str, *, pod_dir: Path,
             claims_dir: Path, memory_dir: Path | None) -> list[Volume]:
    group = spec.get("securityContext", {}).get("fsGroup")
    volumes: list[Volume] = []
    for v in spec.get("volumes", []):
        path = pod_dir / "volumes" / v["name"]
        if "emptyDir" in v:
            if (v["emptyDir"] or {}).get("medium") == "Memory" and memory_dir is not None:
                path = memory_dir / pod / v["name"]
            volumes.append(Volume(v["name"], "emptyDir", path, 0o777, group))
        elif source := v.get("configMap") or v.get("secret"):
            kind = "ConfigMap" if "configMap" in v else "Secret"
            files = manifests.data(kind, source.get("name") or source["secretName"])
            if items := source.get("items"):
                files = {i["path"]: files[i["key"]] for i in items}
            volumes.append(Volume(v["name"], kind.lower(), path,
                                  int(source.get("defaultMode", 0o644)), group, files))
        else:
            raise TranslationError(f"{pod}: volume {v['name']} of this type is not translated")
    if workload["kind"] == "StatefulSet":
        for claim in workload["spec"].get("volumeClaimTemplates", []):
            name = claim["metadata"]["name"]
            volumes.append(Volume(name, "persistentVolumeClaim", claims_dir / f"{name}-{pod}",
                                  0o2775 if group is not None else 0o755, group, persistent=True))
    return volumes


def _mount(m: Object, volumes: Sequence[Volume], where: str) -> Mount:
    volume = next((v for v in volumes if v.name == m["name"]), None)
    if volume is None or "subPath" in m:
        raise TranslationError(f"{where}: mount {m} is not translated (undeclared, or subPath)")
    read_only = bool(m.get("readOnly")) or volume.kind in ("configmap", "secret")
    return Mount(volume.name, volume.host_path, m["mountPath"], read_only)


def _probes(c: Object, pod_ip: str, ports: Mapping[int, int]) -> dict[str, Probe]:
    named = {p["name"]: int(p["containerPort"]) for p in c.get("ports", []) if "name" in p}
    probes = {}
    for kind in ("startup", "liveness", "readiness"):
        if (probe := c.get(f"{kind}Probe")) is None:
            continue
        if (get := probe.get("httpGet")) is None:
            raise TranslationError(f"{c['name']}: {kind}Probe without httpGet")
        port = named[get["port"]] if isinstance(get["port"], str) else int(get["port"])
        probes[kind] = Probe(kind, f"http://{pod_ip}:{ports.get(port, port)}{get.get('path', '/')}",
                             float(probe.get("periodSeconds", 10)),
                             float(probe.get("timeoutSeconds", 1)),
                             int(probe.get("failureThreshold", 3)),
                             float(probe.get("initialDelaySeconds", 0)))
    return probes


def _memory(quantity: str) -> str:
    for unit, docker in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if quantity.endswith(unit):
            return quantity[:-2] + docker
    if not quantity.isdigit():
        raise TranslationError(f"memory quantity {quantity!r} is not translated")
    return quantity
