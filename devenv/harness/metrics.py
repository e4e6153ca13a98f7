"""A Prometheus ``/metrics`` scrape, parsed by ``prometheus_client.parser``."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


def samples(text: str) -> dict[tuple[str, Labels], float]:
    """Text exposition -> ``{(name, sorted labels): value}``."""
    found: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 5.0
           ) -> dict[tuple[str, Labels], float]:
    """``/metrics`` of ``host:port`` as :func:`samples` (raises if it does not answer)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
        return samples(response.read().decode())


def value(found: dict[tuple[str, Labels], float], name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` in :func:`samples` output, else 0."""
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def parse_metrics(text: str) -> dict[str, float]:
    """Text exposition -> ``{'name{label="value",...}': value}`` (labels in exposed order)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def metric_sum(metrics: dict[str, float] | None, name: str, **labels: str) -> float:
    """The sum of ``name`` over the :func:`parse_metrics` series whose labels include ``labels``."""
    if not metrics:
        return 0.0
    total = 0.0
    for key, sample in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += sample
    return total
