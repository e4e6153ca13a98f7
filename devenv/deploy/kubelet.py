"""Translated pods (:mod:`devenv.deploy.pods`) run with the Docker CLI, as a kubelet runs them.

A pod starts by making its volumes' directories (a claim's only if missing), then runs each init
container to exit 0 in order (else :class:`ContainerFailed`), then its containers detached;
Docker's restart policy restarts an exited one, like ``restartPolicy``. Deleting a pod SIGKILLs
its containers and keeps only its claims, as a StatefulSet's replacement pod finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from devenv.deploy.pods import LABEL, Container, Pod, Probe, Volume


class ContainerFailed(RuntimeError):
    """A container that must exit 0 did not; the message has its log's end."""


def prepare_volume(volume: Volume) -> None:
    """Make the host directory of ``volume``: a claim's is kept, others are made anew."""
    path = volume.host_path
    if volume.persistent and path.is_dir():
        return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name, text in volume.files.items():
        (path / name).write_text(text)
        (path / name).chmod(volume.mode)
    path.chmod(0o755 if volume.files else volume.mode)  # after mkdir: no umask
    if volume.group is not None:
        for each in (path, *path.iterdir()):
            os.chown(each, -1, volume.group)


def http_probe(probe: Probe) -> tuple[bool, str]:
    """One GET of the probe's URL with its timeout: (200-399, the body's start)."""
    try:
        with urllib.request.urlopen(probe.url, timeout=probe.timeout_seconds) as answer:  # noqa: S310
            return 200 <= answer.status < 400, answer.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as error:
        return False, error.read(4096).decode(errors="replace")
    except OSError as error:
        return False, str(error)


def probe_until(probe: Probe, budget: float | None = None) -> float:
    """Probe every ``periodSeconds`` until success; the seconds it took."""
    started, failures = time.monotonic(), 0
    time.sleep(probe.initial_delay_seconds)
    while True:
        ok, body = http_probe(probe)
        took = round(time.monotonic() - started, 1)
        if ok:
            return took
        failures += 1
        if (took > budget) if budget is not None else failures >= probe.failure_threshold:
            raise TimeoutError(f"{probe.kind}Probe {probe.url} failed after {took} s: {body[:200]}")
        time.sleep(probe.period_seconds)


class Kubelet:
    """Starts, signals and replaces pods through the ``docker`` CLI ``binary``."""

    def __init__(self, binary: str = "docker") -> None:
        self.binary = binary

    def docker(self, *args: str, timeout: float = 120.0, check: bool = True) -> str:
        """One ``docker`` call's stdout + stderr; raises with it when ``check`` and it fails."""
        done = subprocess.run([self.binary, *args], capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])}: {done.stderr.strip()[-2000:]}")
        return done.stdout + done.stderr

    def start_pod(self, pod: Pod, init_timeout: float = 300.0) -> dict[str, float]:
        """Volumes, init containers in order (each must exit 0), containers; init seconds."""
        for volume in pod.volumes:
            prepare_volume(volume)
        took = {}
        for init in pod.init_containers:
            started = time.monotonic()
            self.run(init)
            self.completed(init.name, init_timeout)
            took[init.name.split(".")[-1]] = round(time.monotonic() - started, 1)
        for container in pod.containers.values():
            self.run(container)
        return took

    def delete_pod(self, pod: Pod) -> None:
        """SIGKILL and remove the pod's containers; remove its volumes but its claims."""
        self.docker("rm", "--force", *(c.name for c in (*pod.init_containers,
                                                         *pod.containers.values())), check=False)
        for volume in pod.volumes:
            if not volume.persistent:
                shutil.rmtree(volume.host_path, ignore_errors=True)

    def run(self, container: Container) -> None:
        """``docker run --detach`` (a leftover container of that name is removed first)."""
        self.docker("rm", "--force", container.name, check=False)
        self.docker(*container.args)

    def completed(self, name: str, timeout: float) -> str:
        """The log once ``name`` stopped for good with exit 0, else :class:`ContainerFailed`."""
        deadline = time.monotonic() + timeout
        while (state := self.state(name)) and (state["Running"] or state["Restarting"]):
            if time.monotonic() > deadline:
                raise ContainerFailed(f"{name} still running after {timeout} s")
            time.sleep(0.2)
        log = self.logs(name)
        if not state or state["ExitCode"] != 0:
            raise ContainerFailed(f"{name} exited {state and state['ExitCode']}:\n{log[-3000:]}")
        return log

    def state(self, name: str) -> dict[str, Any] | None:
        """``docker inspect``'s ``.State`` plus ``RestartCount`` (None: no such container)."""
        try:
            text = self.docker("inspect", "--format", "{{json .State}}|{{.RestartCount}}", name)
        except RuntimeError:
            return None
        state_json, _sep, restarts = text.strip().rpartition("|")
        return {**json.loads(state_json), "RestartCount": int(restarts)}

    def logs(self, name: str, since: str | None = None) -> str:
        """The container's output, every run of it (``since``: an RFC 3339 time)."""
        return self.docker("logs", *(["--since", since] if since else []), name, check=False,
                           timeout=60)

    def stop(self, name: str, timeout: int) -> int:
        """``docker stop``: SIGTERM, SIGKILL after ``timeout`` s, no restart; the exit code."""
        self.docker("stop", "--time", str(timeout), name, timeout=timeout + 30)
        return int((self.state(name) or {}).get("ExitCode", -1))

    def remove_all(self) -> int:
        """Remove every container this test made; how many."""
        names = self.docker("ps", "--all", "--quiet", "--filter", f"label={LABEL}", "--format",
                            "{{.Names}}", check=False).split()
        if names:
            self.docker("rm", "--force", *names, check=False)
        return len(names)
