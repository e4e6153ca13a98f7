"""Run translated pods (:mod:`devenv.deploy.pods`) with the Docker CLI, as a kubelet would.

A pod starts by making its volumes' host directories (non-persistent ones anew, claims only if
missing), then running each init container to completion in order (a failure fails the start),
then its containers (``docker run --detach``; Docker's restart policy restarts a container that
exits, like the kubelet's ``restartPolicy``). Replacing a pod (:meth:`Kubelet.delete_pod`, then
:meth:`Kubelet.start_pod`) keeps only its claims, as a StatefulSet's replacement pod does.
Every container carries the label :data:`LABEL`, so :meth:`Kubelet.remove_all` removes exactly
what this test made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from devenv.deploy.pods import ContainerRun, PodRun, Probe, Volume

__all__ = ["LABEL", "ContainerFailed", "Kubelet", "ProbeResult", "http_probe", "prepare_volume"]

LABEL = "user-activity-deploy-test=1"


class ContainerFailed(RuntimeError):
    """A container (an init container or a Job's) exited non-zero; the message has its log."""


@dataclass(frozen=True)
class ProbeResult:
    """One httpGet probe: its HTTP status (None: no answer) and body."""

    probe: Probe
    status: int | None
    body: str

    @property
    def ok(self) -> bool:
        """200-399 is success for the kubelet."""
        return self.status is not None and 200 <= self.status < 400


def http_probe(probe: Probe) -> ProbeResult:
    """GET the probe's URL once with its timeout, as the kubelet does."""
    try:
        with urllib.request.urlopen(probe.url, timeout=probe.timeout_seconds) as answer:  # noqa: S310
            return ProbeResult(probe, answer.status, answer.read(4096).decode(errors="replace"))
    except urllib.error.HTTPError as error:
        return ProbeResult(probe, error.code, error.read(4096).decode(errors="replace"))
    except (OSError, urllib.error.URLError):
        return ProbeResult(probe, None, "")


class Kubelet:
    """Starts, signals and replaces pods through ``docker`` (``binary``)."""

    def __init__(self, binary: str = "docker") -> None:
        self.binary = binary

    def docker(self, *args: str, timeout: float = 120.0, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        """One ``docker`` call; raises with its stderr when ``check`` and it fails."""
        done = subprocess.run([self.binary, *args], capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])}: {done.stderr.strip()[-2000:]}")
        return done

    # ---- pods --------------------------------------------------------------------------------

    def start_pod(self, pod: PodRun, *, init_timeout: float = 300.0) -> dict[str, float]:
        """Volumes, init containers in order (each must exit 0), then the containers.

        Returns the seconds each init container took.
        """
        for volume in pod.volumes:
            prepare_volume(volume)
        took: dict[str, float] = {}
        for init in pod.init_containers:
            started = time.monotonic()
            self.run_to_completion(init, timeout=init_timeout)
            took[init.name] = round(time.monotonic() - started, 1)
        for container in pod.containers:
            self.run(container)
        return took

    def delete_pod(self, pod: PodRun) -> None:
        """Remove the pod's containers at once (SIGKILL) and its non-persistent volumes."""
        names = [c.container_name for c in (*pod.init_containers, *pod.containers)]
        self.docker("rm", "--force", *names, check=False)
        for volume in pod.volumes:
            if not volume.persistent:
                shutil.rmtree(volume.host_path, ignore_errors=True)

    # ---- containers --------------------------------------------------------------------------

    def run(self, container: ContainerRun) -> None:
        """``docker run --detach`` (a leftover container of that name is removed first)."""
        self.docker("rm", "--force", container.container_name, check=False)
        self.docker(*container.docker_args(LABEL))

    def run_to_completion(self, container: ContainerRun, *, timeout: float) -> str:
        """Run ``container`` until it exits; its log. Raises :class:`ContainerFailed`."""
        self.run(container)
        code = self.wait(container.container_name, timeout)
        log = self.logs(container.container_name)
        if code != 0:
            raise ContainerFailed(f"{container.container_name} exited {code}:\n{log[-3000:]}")
        return log

    def wait(self, name: str, timeout: float) -> int | None:
        """The exit code once the container stopped for good, or None after ``timeout``.

        A container with a restart policy counts as stopped only while it is not running and
        not restarting.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(name)
            if state and not state["Running"] and not state["Restarting"]:
                return int(state["ExitCode"])
            time.sleep(0.2)
        return None

    def state(self, name: str) -> dict[str, Any] | None:
        """``docker inspect``'s ``.State`` plus ``RestartCount`` (None: no such container)."""
        done = self.docker("inspect", "--format",
                           "{{json .State}}|{{.RestartCount}}", name, check=False)
        if done.returncode != 0:
            return None
        state_json, _sep, restarts = done.stdout.strip().rpartition("|")
        state: dict[str, Any] = json.loads(state_json)
        state["RestartCount"] = int(restarts)
        return state

    def logs(self, name: str, *, since: str | None = None) -> str:
        """The container's stdout and stderr (all its runs; ``since``: an RFC 3339 time)."""
        args = ["logs", *(["--since", since] if since else []), name]
        done = self.docker(*args, check=False, timeout=60)
        return done.stdout + done.stderr

    def stop(self, name: str, timeout: int) -> None:
        """``docker stop``: SIGTERM, SIGKILL after ``timeout`` s; no restart afterwards."""
        self.docker("stop", "--time", str(timeout), name, timeout=timeout + 30)

    def remove_all(self) -> list[str]:
        """Remove every container this test made; their names."""
        listed = self.docker("ps", "--all", "--quiet", "--filter", f"label={LABEL}",
                             "--format", "{{.Names}}", check=False)
        names = listed.stdout.split()
        if names:
            self.docker("rm", "--force", *names, check=False)
        return names


def prepare_volume(volume: Volume) -> None:
    """Make the host directory of ``volume``; a claim's is kept, others are made anew."""
    path = volume.host_path
    if volume.persistent and path.is_dir():
        return
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    for name, text in volume.files.items():
        file = path / name
        file.write_text(text)
        file.chmod(volume.mode)
    if not volume.files:
        path.chmod(volume.mode)  # chmod after mkdir: umask does not apply
    else:
        path.chmod(0o755)
    if volume.group is not None:
        os.chown(path, -1, volume.group)
        for child in path.iterdir():
            os.chown(child, -1, volume.group)
