"""Reading Prometheus' text format in tests and benchmarks: one helper, so each test says what it sums,
not how it parses."""

from __future__ import annotations

import httpx


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples (a counter's ``_total`` name as exposed) whose labels include
    ``labels``; 0 when there are none."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def scrape(url: str) -> str:
    """``url``'s /metrics text."""
    return httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
