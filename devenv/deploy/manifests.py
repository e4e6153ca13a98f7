"""The objects of ``k8s/*.yaml`` (pure: parsing and copies, no cluster)."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Manifests", "Object", "TranslationError"]

Object = dict[str, Any]
"""One Kubernetes object as parsed YAML."""


class TranslationError(ValueError):
    """A manifest uses something this translation does not know how to run on one host."""


@dataclass(frozen=True)
class Manifests:
    """The objects of ``k8s/*.yaml`` by (kind, name); ``generateName`` counts as the name."""

    objects: Mapping[tuple[str, str], Object]

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> Manifests:
        """Parse YAML documents (multi-document files); documents without ``kind`` are skipped."""
        objects: dict[tuple[str, str], Object] = {}
        for text in texts:
            for doc in yaml.safe_load_all(text):
                if not isinstance(doc, dict) or "kind" not in doc:
                    continue  # not a Kubernetes object (prometheus-rules.yaml)
                meta = doc.get("metadata", {})
                name = meta.get("name") or meta.get("generateName")
                objects[(doc["kind"], name)] = doc
        return cls(objects)

    @classmethod
    def load(cls, directory: Path) -> Manifests:
        """Every ``*.yaml`` file directly in ``directory`` (not ``k8s/tests/``)."""
        return cls.from_texts(p.read_text() for p in sorted(directory.glob("*.yaml")))

    def get(self, kind: str, name: str) -> Object:
        """A deep copy of the object (callers may edit it, as an operator edits a template)."""
        try:
            return copy.deepcopy(self.objects[(kind, name)])
        except KeyError:
            raise TranslationError(f"no {kind} {name!r} in the manifests") from None

    def data(self, kind: str, name: str) -> dict[str, str]:
        """The keys of a ConfigMap (``data``) or Secret (``data`` decoded, then ``stringData``)."""
        obj = self.get(kind, name)
        values = {str(k): str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "Secret":
            values = {k: base64.b64decode(v).decode() for k, v in values.items()}
            values.update({str(k): str(v) for k, v in (obj.get("stringData") or {}).items()})
        return values

    def with_values(self, kind: str, name: str, values: Mapping[str, str],
                    without: Iterable[str] = ()) -> Manifests:
        """A copy where the ConfigMap/Secret ``name`` has ``values`` and not the keys ``without``.

        This is how a test environment is described: the same keys with local values (the
        example Secret's placeholders, the ConfigMap's Kafka address), nothing else.
        """
        obj = self.get(kind, name)
        merged = {**self.data(kind, name), **values}
        for key in without:
            merged.pop(key, None)
        obj.pop("data", None)
        obj["stringData" if kind == "Secret" else "data"] = merged
        return Manifests({**self.objects, (kind, name): obj})
