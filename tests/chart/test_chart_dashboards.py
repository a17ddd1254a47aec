"""The Grafana dashboards' structure (their PromQL runs against a live Prometheus in tests/monitoring)."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.testing.helm import CHART

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# The selector variable of each dashboard besides the namespace.
SELECTOR = {"pagedserve-engine": "model_name", "pagedserve-router": "modeldeployment"}
# vLLM's info metrics carry no model_name label.
INFO_METRICS = ("cache_config_info", "lora_requests_info")


def load(path):
    return json.loads(path.read_text())


def test_both_dashboards_exist() -> None:
    assert [p.stem for p in DASHBOARDS] == ["pagedserve-engine", "pagedserve-router"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path) -> None:
    board = load(path)
    assert board["uid"] == path.stem and "pagedserve" in board["tags"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", SELECTOR[path.stem]):
        var = variables[name]
        # "All" must match series that lack the label too (a Prometheus outside Kubernetes).
        assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_is_templated(path) -> None:
    """Every query filters by namespace (and model, where the metric has that label) and uses
    $__rate_interval rather than a fixed window, so short ranges and fast scrapes work."""
    for panel in load(path)["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            assert 'namespace=~"$namespace"' in expr, (panel["title"], expr)
            if not any(info in expr for info in INFO_METRICS):
                assert f'{SELECTOR[path.stem]}=~"${SELECTOR[path.stem]}"' in expr, (panel["title"], expr)
            windows = re.findall(r"\[([^\]]+)\]", expr)
            assert all(w == "$__rate_interval" for w in windows), (panel["title"], expr)


def test_engine_dashboard_has_per_adapter_panels() -> None:
    """LoRA adapters (spec.adapters): requests per second by adapter, and each replica's running and
    waiting adapters (the live metrics are checked in tests/monitoring, scraped from a fake engine)."""
    board = load(CHART / "dashboards" / "pagedserve-engine.json")
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"] if p["type"] != "row"}
    per_adapter = [
        title for title, found in exprs.items() if any("pagedserve:lora_requests_total" in e for e in found)
    ]
    assert per_adapter, "no panel of pagedserve:lora_requests_total"
    assert any("by (model_name, lora_name)" in e for e in exprs[per_adapter[0]])
    assert any("vllm:lora_requests_info" in e for found in exprs.values() for e in found)
