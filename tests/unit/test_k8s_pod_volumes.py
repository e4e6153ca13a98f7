"""The host directories behind a translated pod's volumes (devenv/deploy/kubelet.prepare_volume)."""

from __future__ import annotations

import stat
from pathlib import Path

from devenv.deploy.kubelet import prepare_volume
from devenv.deploy.pods import Volume


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_empty_dir_is_made_anew_and_world_writable(tmp_path: Path) -> None:
    volume = Volume("tmp", "emptyDir", tmp_path / "pod" / "tmp", 0o777)
    prepare_volume(volume)
    (volume.host_path / "left-by-the-last-pod").write_text("x")

    prepare_volume(volume)  # the next pod of that name

    assert list(volume.host_path.iterdir()) == []
    assert mode(volume.host_path) == 0o777


def test_a_claim_keeps_what_the_last_pod_wrote(tmp_path: Path) -> None:
    claim = Volume("recovery", "persistentVolumeClaim", tmp_path / "recovery-p-0", 0o2775,
                   persistent=True)
    prepare_volume(claim)
    (claim.host_path / "part-0.sqlite3").write_text("snapshot")

    prepare_volume(claim)  # the replacement pod

    assert (claim.host_path / "part-0.sqlite3").read_text() == "snapshot"
    assert mode(claim.host_path) == 0o2775


def test_config_map_keys_become_files_with_the_default_mode(tmp_path: Path) -> None:
    volume = Volume("scripts", "configmap", tmp_path / "scripts", 0o444,
                    files={"a.sh": "echo a\n", "b.sh": "echo b\n"})

    prepare_volume(volume)

    assert sorted(p.name for p in volume.host_path.iterdir()) == ["a.sh", "b.sh"]
    assert (volume.host_path / "a.sh").read_text() == "echo a\n"
    assert mode(volume.host_path / "b.sh") == 0o444
