"""Pods of ``k8s/*.yaml`` as ``docker run`` argument lists on one host (pure translation).

What is translated, as the kubelet would run it:

* every container of the pod template (init containers first, in order): image, ``command``
  (``--entrypoint`` + leading arguments) and ``args``, ``workingDir``;
* the environment: ``envFrom`` (ConfigMap ``data``, Secret ``stringData``/``data``) in order, then
  ``env`` (literal values and the downward-API fields ``metadata.name``, ``metadata.namespace``,
  ``metadata.labels['…']``, ``status.podIP``);
* the security context (pod level, overridden per container): ``--user uid:gid``,
  ``--group-add fsGroup``, ``--read-only``, ``--cap-drop``/``--cap-add``,
  ``--security-opt no-new-privileges``; ``runAsNonRoot`` with uid 0 is refused;
* volumes: each ``emptyDir`` is a directory of the pod (mode 0777, as the kubelet makes it;
  shared by the pod's containers, kept across container restarts, gone with the pod; one of
  ``medium: Memory`` lies on a tmpfs, ``memory_dir``, e.g. under /dev/shm), each
  ``configMap``/``secret`` a directory of its keys' files (``defaultMode``) mounted read-only,
  each ``volumeClaimTemplate`` one host directory per pod, ``<claim>-<pod>``, kept across pod
  replacements (the PersistentVolumeClaim), group-owned by ``fsGroup``;
* ``resources.limits`` (``--memory``, ``--cpus``), ``terminationGracePeriodSeconds``
  (``--stop-timeout``), ``restartPolicy`` (``--restart``), the probes (as :class:`Probe`).

The network: one host, host networking, so pods cannot each have 0.0.0.0. Each pod gets its own
loopback address (its "pod IP", e.g. 127.0.10.1); the StatefulSets' pod DNS names
(``<pod>.<service>[.<namespace>.svc.cluster.local]``) resolve to it with ``--add-host``, so
Timely's worker port (which binds the hostfile address) needs no change. Where code binds a
wildcard address, the translation changes the setting and says so in :attr:`PodRun.changes`:
``USER_ACTIVITY_HTTP_HOST`` 0.0.0.0 becomes the pod IP, and Bytewax's API port (bound on
0.0.0.0 by bytewax 0.21.1, ``src/webserver/mod.rs``) gets a distinct host port per pod.

Nothing here runs a process or touches a file: :mod:`devenv.deploy.docker` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devenv.deploy.manifests import Manifests, Object, TranslationError

__all__ = [
    "WILDCARD_PORT_VARS",
    "ContainerRun",
    "PodRun",
    "Probe",
    "Volume",
    "VolumeMount",
    "pod_hosts",
    "translate_pod",
]

WILDCARD_PORT_VARS: Mapping[str, str] = {
    "BYTEWAX_DATAFLOW_API_PORT": "Bytewax 0.21.1 binds its API server on 0.0.0.0",
}
"""Variables naming a port that the code binds on every address: made distinct per pod."""
_BIND_HOST_VARS = ("USER_ACTIVITY_HTTP_HOST",)
"""Variables naming the address a server binds: 0.0.0.0 becomes the pod IP."""
_WILDCARD = "0.0.0.0"
_CLUSTER_DOMAIN = "svc.cluster.local"
_DEFAULT_GRACE_SECONDS = 30


@dataclass(frozen=True)
class VolumeMount:
    """A ``--mount`` of a pod volume into one container."""

    volume: str
    host_path: Path
    target: str
    read_only: bool

    def docker_args(self) -> list[str]:
        """``--mount type=bind,...`` (``readonly`` when the mount or the volume is read-only)."""
        spec = f"type=bind,source={self.host_path},target={self.target}"
        return ["--mount", spec + (",readonly" if self.read_only else "")]


@dataclass(frozen=True)
class Volume:
    """A host directory backing one pod volume; :mod:`devenv.deploy.docker` creates it.

    ``persistent``: a PersistentVolumeClaim (kept when the pod is replaced); otherwise it is made
    anew for each pod. ``files``: the keys of a configMap/secret volume, written with ``mode``.
    """

    name: str
    kind: str
    host_path: Path
    mode: int
    group: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    persistent: bool = False


@dataclass(frozen=True)
class Probe:
    """An httpGet probe of a container, aimed at the address the kubelet would use."""

    kind: str  # startup | liveness | readiness
    url: str
    period_seconds: float
    timeout_seconds: float
    failure_threshold: int
    initial_delay_seconds: float = 0.0


@dataclass(frozen=True)
class ContainerRun:
    """One container of a pod as ``docker run --detach`` arguments."""

    pod: str
    name: str
    image: str
    entrypoint: str | None
    arguments: tuple[str, ...]
    env: Mapping[str, str]
    user: str
    group_add: tuple[int, ...]
    read_only: bool
    cap_drop: tuple[str, ...]
    cap_add: tuple[str, ...]
    no_new_privileges: bool
    working_dir: str | None
    mounts: tuple[VolumeMount, ...]
    hosts: Mapping[str, str]
    restart: str
    stop_timeout: int
    memory: str | None
    cpus: str | None
    probes: tuple[Probe, ...] = ()
    init: bool = False

    @property
    def container_name(self) -> str:
        """The Docker container's name: ``<pod>.<container>``."""
        return f"{self.pod}.{self.name}"

    def docker_args(self, label: str) -> list[str]:
        """``docker run`` arguments (without ``docker``); ``label`` marks what the test made."""
        args = ["run", "--detach", "--name", self.container_name, "--label", label,
                "--network", "host", "--pull", "never", "--user", self.user,
                "--restart", self.restart, "--stop-timeout", str(self.stop_timeout)]
        for gid in self.group_add:
            args += ["--group-add", str(gid)]
        if self.read_only:
            args.append("--read-only")
        for cap in self.cap_drop:
            args += ["--cap-drop", cap]
        for cap in self.cap_add:
            args += ["--cap-add", cap]
        if self.no_new_privileges:
            args += ["--security-opt", "no-new-privileges"]
        if self.memory:
            args += ["--memory", self.memory]
        if self.cpus:
            args += ["--cpus", self.cpus]
        if self.working_dir:
            args += ["--workdir", self.working_dir]
        for host, ip in sorted(self.hosts.items()):
            args += ["--add-host", f"{host}:{ip}"]
        for name, value in self.env.items():
            args += ["--env", f"{name}={value}"]
        for mount in self.mounts:
            args += mount.docker_args()
        if self.entrypoint is not None:
            args += ["--entrypoint", self.entrypoint]
        return [*args, self.image, *self.arguments]


@dataclass(frozen=True)
class PodRun:
    """A pod: its volumes, init containers (in order), containers, and what was changed."""

    name: str
    ip: str
    volumes: tuple[Volume, ...]
    init_containers: tuple[ContainerRun, ...]
    containers: tuple[ContainerRun, ...]
    changes: tuple[str, ...]

    def container(self, name: str) -> ContainerRun:
        """The (main) container called ``name``."""
        for run in self.containers:
            if run.name == name:
                return run
        raise KeyError(name)


def pod_hosts(statefulset: Object, ips: Sequence[str]) -> dict[str, str]:
    """The DNS names of a StatefulSet's pods (ordinal i at ``ips[i]``) as the headless Service.

    ``<set>-i.<service>``, ``<set>-i.<service>.<namespace>`` and the same under
    ``svc.cluster.local``.
    """
    name = statefulset["metadata"]["name"]
    namespace = statefulset["metadata"].get("namespace", "default")
    service = statefulset["spec"]["serviceName"]
    hosts: dict[str, str] = {}
    for ordinal, ip in enumerate(ips):
        base = f"{name}-{ordinal}.{service}"
        for host in (base, f"{base}.{namespace}", f"{base}.{namespace}.{_CLUSTER_DOMAIN}"):
            hosts[host] = ip
    return hosts


def translate_pod(
    manifests: Manifests,
    workload: Object,
    *,
    pod_name: str,
    pod_ip: str,
    image: str,
    pod_dir: Path,
    claims_dir: Path,
    hosts: Mapping[str, str] | None = None,
    ports: Mapping[int, int] | None = None,
    memory_dir: Path | None = None,
) -> PodRun:
    """Translate the pod template of ``workload`` (StatefulSet or Job) into one :class:`PodRun`.

    ``pod_dir`` holds this pod's non-persistent volumes (``memory_dir``, on a tmpfs, those of
    ``medium: Memory``; default ``pod_dir``), ``claims_dir`` the StatefulSet's claim
    directories. ``ports`` maps a container port bound on a wildcard address to the host port
    this pod uses instead (required for each such port the pod declares).
    """
    kind = workload["kind"]
    if kind not in ("StatefulSet", "Job"):
        raise TranslationError(f"cannot run a {kind}")
    template = workload["spec"]["template"]
    spec = template["spec"]
    labels = {**template.get("metadata", {}).get("labels", {})}
    namespace = workload["metadata"].get("namespace", "default")
    changes: list[str] = []
    context = _PodContext(pod_name, namespace, labels, pod_ip)

    volumes = _volumes(manifests, workload, spec, pod_name, pod_dir=pod_dir,
                       claims_dir=claims_dir, memory_dir=memory_dir)
    by_name = {v.name: v for v in volumes}
    restart = _restart_policy(kind, spec, workload)
    grace = int(spec.get("terminationGracePeriodSeconds", _DEFAULT_GRACE_SECONDS))

    def container(c: Object, *, init: bool) -> ContainerRun:
        env = _environment(manifests, c, context)
        env = _pod_network(env, pod_ip=pod_ip, ports=ports or {}, changes=changes,
                           where=f"{pod_name}/{c['name']}")
        security = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
        uid = security.get("runAsUser")
        if uid is None:
            raise TranslationError(f"{pod_name}/{c['name']}: no runAsUser (the image's user "
                                   "is not known here)")
        if security.get("runAsNonRoot") and int(uid) == 0:
            raise TranslationError(f"{pod_name}/{c['name']}: runAsNonRoot with runAsUser 0")
        gid = security.get("runAsGroup", uid)
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        caps = security.get("capabilities", {})
        profile = security.get("seccompProfile", {}).get("type", "RuntimeDefault")
        if profile != "RuntimeDefault":
            raise TranslationError(f"{pod_name}/{c['name']}: seccompProfile {profile}")
        command = [str(a) for a in c.get("command", [])]
        arguments = [str(a) for a in c.get("args", [])]
        limits = c.get("resources", {}).get("limits", {})
        return ContainerRun(
            pod=pod_name, name=c["name"], image=image,
            entrypoint=command[0] if command else None,
            arguments=tuple(command[1:] + arguments),
            env=env, user=f"{uid}:{gid}",
            group_add=(int(fs_group),) if fs_group is not None else (),
            read_only=bool(security.get("readOnlyRootFilesystem", False)),
            cap_drop=tuple(caps.get("drop", [])), cap_add=tuple(caps.get("add", [])),
            no_new_privileges=security.get("allowPrivilegeEscalation") is False,
            working_dir=c.get("workingDir"),
            mounts=tuple(_mounts(c, by_name, pod_name)),
            hosts=dict(hosts or {}),
            restart="no" if init else restart, stop_timeout=grace,
            memory=_memory(limits.get("memory")), cpus=_cpus(limits.get("cpu")),
            probes=() if init else tuple(_probes(c, pod_ip, ports or {})),
            init=init,
        )

    init_runs = tuple(container(c, init=True) for c in spec.get("initContainers", []))
    runs = tuple(container(c, init=False) for c in spec["containers"])
    originals = {c.get("image") for c in [*spec.get("initContainers", []), *spec["containers"]]}
    changes.insert(0, f"{pod_name}: image {', '.join(sorted(originals))} -> {image} (built "
                      "from this tree; --pull never)")
    return PodRun(pod_name, pod_ip, tuple(volumes), init_runs, runs, tuple(changes))


# ---- helpers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PodContext:
    name: str
    namespace: str
    labels: Mapping[str, str]
    ip: str

    def field(self, path: str) -> str:
        if path == "metadata.name":
            return self.name
        if path == "metadata.namespace":
            return self.namespace
        if path == "status.podIP":
            return self.ip
        match = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if match and match.group(1) in self.labels:
            return str(self.labels[match.group(1)])
        raise TranslationError(f"downward-API field {path!r} is not translated")


def _environment(manifests: Manifests, c: Object, pod: _PodContext) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            values = manifests.data("ConfigMap", source["configMapRef"]["name"])
        elif "secretRef" in source:
            values = manifests.data("Secret", source["secretRef"]["name"])
        else:
            raise TranslationError(f"envFrom source {source} is not translated")
        env.update({prefix + k: v for k, v in values.items()})
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item.get("valueFrom", {})
        if "fieldRef" in ref:
            env[item["name"]] = pod.field(ref["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
            key_ref = ref.get("configMapKeyRef") or ref["secretKeyRef"]
            kind = "ConfigMap" if "configMapKeyRef" in ref else "Secret"
            env[item["name"]] = manifests.data(kind, key_ref["name"])[key_ref["key"]]
        else:
            raise TranslationError(f"env {item['name']}: {ref} is not translated")
    return env


def _pod_network(env: dict[str, str], *, pod_ip: str, ports: Mapping[int, int],
                 changes: list[str], where: str) -> dict[str, str]:
    """Give this pod its own address and ports where the code binds a wildcard (see module)."""
    out = dict(env)
    for name in _BIND_HOST_VARS:
        if out.get(name) == _WILDCARD:
            out[name] = pod_ip
            changes.append(f"{where}: {name} {_WILDCARD} -> {pod_ip} (host networking: "
                           "0.0.0.0 in a pod is the pod's own address)")
    for name, why in WILDCARD_PORT_VARS.items():
        if name not in out:
            continue
        port = int(out[name])
        if port not in ports:
            raise TranslationError(f"{where}: {name}={port} is bound on 0.0.0.0; no host port "
                                   "given for it")
        out[name] = str(ports[port])
        changes.append(f"{where}: {name} {port} -> {ports[port]} ({why}: pods on one host "
                       "need distinct ports)")
    return out


def _volumes(manifests: Manifests, workload: Object, spec: Object, pod: str, *, pod_dir: Path,
             claims_dir: Path, memory_dir: Path | None) -> list[Volume]:
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    volumes: list[Volume] = []
    for v in spec.get("volumes", []):
        path = pod_dir / "volumes" / v["name"]
        if "emptyDir" in v:
            if (v["emptyDir"] or {}).get("medium") == "Memory" and memory_dir is not None:
                path = memory_dir / pod / v["name"]
            volumes.append(Volume(v["name"], "emptyDir", path, 0o777, fs_group))
        elif "configMap" in v or "secret" in v:
            kind, ref = (("ConfigMap", v["configMap"]["name"]) if "configMap" in v
                         else ("Secret", v["secret"]["secretName"]))
            source = v.get("configMap") or v["secret"]
            files = manifests.data(kind, ref)
            items = source.get("items")
            if items:
                files = {i["path"]: files[i["key"]] for i in items}
            volumes.append(Volume(v["name"], kind.lower(), path, int(source.get(
                "defaultMode", 0o644)), fs_group, files))
        else:
            raise TranslationError(f"{pod}: volume {v['name']} of this type is not translated")
    if workload["kind"] == "StatefulSet":
        for claim in workload["spec"].get("volumeClaimTemplates", []):
            name = claim["metadata"]["name"]
            volumes.append(Volume(name, "persistentVolumeClaim", claims_dir / f"{name}-{pod}",
                                  0o2775 if fs_group is not None else 0o755, fs_group,
                                  persistent=True))
    return volumes


def _mounts(c: Object, volumes: Mapping[str, Volume], pod: str) -> list[VolumeMount]:
    mounts = []
    for m in c.get("volumeMounts", []):
        volume = volumes.get(m["name"])
        if volume is None:
            raise TranslationError(f"{pod}/{c['name']}: volume {m['name']} is not declared")
        if "subPath" in m:
            raise TranslationError(f"{pod}/{c['name']}: subPath is not translated")
        read_only = bool(m.get("readOnly", False)) or volume.kind in ("configmap", "secret")
        mounts.append(VolumeMount(volume.name, volume.host_path, m["mountPath"], read_only))
    return mounts


def _restart_policy(kind: str, spec: Object, workload: Object) -> str:
    policy = spec.get("restartPolicy", "Always")
    if policy == "Always":
        return "always"
    if policy == "OnFailure":
        return f"on-failure:{int(workload['spec'].get('backoffLimit', 6))}"
    return "no"


def _probes(c: Object, pod_ip: str, ports: Mapping[int, int]) -> list[Probe]:
    named = {p["name"]: int(p["containerPort"]) for p in c.get("ports", []) if "name" in p}
    probes = []
    for kind in ("startup", "liveness", "readiness"):
        probe = c.get(f"{kind}Probe")
        if probe is None:
            continue
        get = probe.get("httpGet")
        if get is None:
            raise TranslationError(f"{c['name']}: {kind}Probe without httpGet")
        port = get["port"]
        number = named[port] if isinstance(port, str) else int(port)
        number = ports.get(number, number)
        probes.append(Probe(
            kind, f"http://{pod_ip}:{number}{get.get('path', '/')}",
            float(probe.get("periodSeconds", 10)), float(probe.get("timeoutSeconds", 1)),
            int(probe.get("failureThreshold", 3)), float(probe.get("initialDelaySeconds", 0)),
        ))
    return probes


_MEMORY_UNITS = {"Ki": "k", "Mi": "m", "Gi": "g"}


def _memory(quantity: Any) -> str | None:
    if quantity is None:
        return None
    text = str(quantity)
    for unit, docker in _MEMORY_UNITS.items():
        if text.endswith(unit):
            return text[: -len(unit)] + docker
    if text.isdigit():
        return text
    raise TranslationError(f"memory quantity {text!r} is not translated")


def _cpus(quantity: Any) -> str | None:
    if quantity is None:
        return None
    text = str(quantity)
    if text.endswith("m"):
        return f"{int(text[:-1]) / 1000:g}"
    return f"{float(text):g}"
