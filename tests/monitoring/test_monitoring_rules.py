"""The chart's alert rules: `promtool check rules`, and `promtool test rules` with synthetic series that
make each alert fire (and a neighbour that must stay quiet)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedserve.testing.helm import find_tool, one, render

pytestmark = pytest.mark.skipif(
    find_tool("helm") is None or find_tool("promtool") is None,
    reason="helm/promtool missing: run `make tools`",
)

RULES_ON = {"monitoring": {"prometheusRule": {"enabled": True}}}


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return one(render(values or RULES_ON, include_crds=False), "PrometheusRule")["spec"]["groups"]


def promtool(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        [find_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.parametrize(
    "values",
    [
        RULES_ON,
        {"monitoring": {"prometheusRule": {"enabled": True, "additionalAlertLabels": {"team": "ml"}}}},
    ],
    ids=["default", "extra-labels"],
)
def test_promtool_check_rules(tmp_path: Path, values: dict[str, Any]) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(values)}))
    output = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert "SUCCESS" in output and "rules found" in output, output


def _alert(severity: str, **labels: str) -> dict[str, Any]:
    return {"exp_labels": {"severity": severity, **labels}}


def test_alerts_fire_on_synthetic_series(tmp_path: Path) -> None:
    """Each alert fires where it should and stays quiet next door (annotations are left to
    `promtool check rules`: their text is prose, checked for template syntax there)."""
    groups = rule_groups()
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))

    ns = 'namespace="ml"'
    series = [
        # Queue: model a waits 20 (alert), model b waits 2 (quiet).
        (f'vllm:num_requests_waiting{{{ns}, model_name="a", pod="a-1"}}', "20x30"),
        (f'vllm:num_requests_waiting{{{ns}, model_name="b", pod="b-1"}}', "2x30"),
        # KV cache: pod a-1 at 97 % (alert), a-2 at 50 % (quiet).
        (f'vllm:kv_cache_usage_perc{{{ns}, model_name="a", pod="a-1"}}', "0.97x30"),
        (f'vllm:kv_cache_usage_perc{{{ns}, model_name="a", pod="a-2"}}', "0.5x30"),
        # TTFT: model a's first tokens land in (1s, 5s] (p95 4.8 s, alert); model b's within 1 s (quiet).
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="a", le="1"}}', "0x30"),
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="a", le="5"}}', "0+10x30"),
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="a", le="+Inf"}}', "0+10x30"),
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="b", le="1"}}', "0+10x30"),
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="b", le="5"}}', "0+10x30"),
        (f'vllm:time_to_first_token_seconds_bucket{{{ns}, model_name="b", le="+Inf"}}', "0+10x30"),
        # Replica down: engine pod a-1 stops answering after 2 minutes; router pod r-1 is not an engine.
        (f'up{{{ns}, job="ml/a", container="engine", pod="a-1"}}', "1 1 0x28"),
        (f'up{{{ns}, job="ml/a", container="engine", pod="a-2"}}', "1x30"),
        (f'up{{{ns}, job="ml/a", container="router", pod="r-1"}}', "0x30"),
        # Router: r-1 has no ready backend (alert), r-2 has two (quiet).
        (f'pagedserve_router_ready_backends{{{ns}, modeldeployment="a", pod="r-1"}}', "0x30"),
        (f'pagedserve_router_ready_backends{{{ns}, modeldeployment="a", pod="r-2"}}', "2x30"),
        # Scale from zero: r-3 is idle at 0 engines, holding nothing (quiet); r-4 holds requests that
        # no engine comes to serve (alert).
        (f'pagedserve_router_ready_backends{{{ns}, modeldeployment="z", pod="r-3"}}', "0x30"),
        (f'pagedserve_router_max_held_requests{{{ns}, modeldeployment="z", pod="r-3"}}', "100x30"),
        (f'pagedserve_router_held_requests{{{ns}, modeldeployment="z", pod="r-3"}}', "0x30"),
        (f'pagedserve_router_ready_backends{{{ns}, modeldeployment="z", pod="r-4"}}', "0x30"),
        (f'pagedserve_router_max_held_requests{{{ns}, modeldeployment="z", pod="r-4"}}', "100x30"),
        (f'pagedserve_router_held_requests{{{ns}, modeldeployment="z", pod="r-4"}}', "3x30"),
        # Backend errors: 10 % of e1's requests fail (alert); e2 only 0.5 % (quiet).
        (
            f'pagedserve_router_requests_total{{{ns}, modeldeployment="a", backend="e1", status="200"}}',
            "0+90x30",
        ),
        (
            f'pagedserve_router_requests_total{{{ns}, modeldeployment="a", backend="e1", status="502"}}',
            "0+5x30",
        ),
        (
            f'pagedserve_router_requests_total{{{ns}, modeldeployment="a", backend="e1", status="error"}}',
            "0+5x30",
        ),
        (
            f'pagedserve_router_requests_total{{{ns}, modeldeployment="a", backend="e2", status="200"}}',
            "0+199x30",
        ),
        (
            f'pagedserve_router_requests_total{{{ns}, modeldeployment="a", backend="e2", status="503"}}',
            "0+1x30",
        ),
    ]
    ml = {"namespace": "ml"}
    expected = {
        "PagedserveQueueBuildingUp": [_alert("warning", **ml, model_name="a")],
        "PagedserveKVCacheNearFull": [_alert("warning", **ml, model_name="a", pod="a-1")],
        "PagedserveTTFTHigh": [_alert("warning", **ml, model_name="a")],
        "PagedserveReplicaDown": [_alert("critical", **ml, job="ml/a", container="engine", pod="a-1")],
        "PagedserveRouterNoReadyBackends": [
            _alert("critical", **ml, modeldeployment="a", pod="r-1"),
            _alert("critical", **ml, modeldeployment="z", pod="r-4"),
        ],
        "PagedserveRouterBackendErrors": [_alert("warning", **ml, modeldeployment="a", backend="e1")],
    }
    alert_names = {r["alert"] for g in groups for r in g["rules"]}
    assert alert_names == set(expected)
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {"eval_time": "25m", "alertname": name, "exp_alerts": alerts}
                    for name, alerts in expected.items()
                ],
            },
            {
                # Before each alert's `for` has elapsed nothing fires.
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": name, "exp_alerts": []} for name in expected
                ],
            },
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    output = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in output, output
