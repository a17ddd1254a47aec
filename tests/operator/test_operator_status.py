"""Status from the children (pure), and the drift comparison reconcile uses."""

from __future__ import annotations

from typing import Any

from pagedserve.operator.reconcile import contains
from pagedserve.operator.spec import quantity
from pagedserve.operator.status import compute_status, status_changed

MD = {"metadata": {"name": "m", "namespace": "ml", "generation": 3}}


def deployment(replicas: int, ready: int, updated: int | None = None, **extra: Any) -> dict[str, Any]:
    status = {
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": replicas if updated is None else updated,
    }
    status.update(observedGeneration=2, **extra)
    return {"metadata": {"generation": 2}, "status": status}


def status(engine: Any, router: Any, previous: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    md = {**MD, "status": previous or {}}
    return compute_status(
        md,
        engine=engine,
        router=router,
        replicas=kw.pop("replicas", 2),
        router_replicas=kw.pop("router_replicas", 2),
        **kw,
    )


def test_pending_then_progressing_then_ready() -> None:
    pending = status({"metadata": {"generation": 1}}, {"metadata": {"generation": 1}})
    assert pending["phase"] == "Pending"
    assert pending["endpoint"] == "http://m.ml.svc/v1"
    assert pending["observedGeneration"] == 3
    assert pending["selector"] == (
        "app.kubernetes.io/name=pagedserve,app.kubernetes.io/instance=m,app.kubernetes.io/component=engine"
    )
    progressing = status(deployment(2, 1), deployment(2, 2), previous=pending)
    assert progressing["phase"] == "Progressing"
    ready = status(deployment(2, 2), deployment(2, 2), previous=progressing)
    assert ready["phase"] == "Ready"
    assert (ready["replicas"], ready["readyReplicas"], ready["routerReadyReplicas"]) == (2, 2, 2)
    conditions = {c["type"]: c for c in ready["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Reconciled"]["status"] == "True"


def test_degraded_when_a_ready_deployment_loses_replicas() -> None:
    ready = status(deployment(2, 2), deployment(2, 2))
    degraded = status(deployment(2, 1), deployment(2, 2), previous=ready)
    assert degraded["phase"] == "Degraded"
    assert {c["type"]: c["status"] for c in degraded["conditions"]}["EngineReady"] == "False"
    # a rollout (new pods not yet updated) is progress, not degradation
    rolling = status(deployment(3, 2, updated=1), deployment(2, 2), previous=ready)
    assert rolling["phase"] == "Progressing"


def test_failed_on_errors_and_stuck_rollouts() -> None:
    failed = status(None, None, error="Deployment/m-engine: 403 Forbidden")
    assert failed["phase"] == "Failed"
    reconciled = {c["type"]: c for c in failed["conditions"]}["Reconciled"]
    assert reconciled["status"] == "False" and "403" in reconciled["message"]
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": "stuck",
    }
    stuck = deployment(2, 0, conditions=[deadline])
    assert status(stuck, deployment(2, 2))["phase"] == "Failed"
    quota = deployment(
        2, 0, conditions=[{"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}]
    )
    assert "exceeded quota" in {c["type"]: c for c in status(quota, None)["conditions"]}["Ready"]["message"]


def test_transition_times_only_move_on_transitions() -> None:
    first = status(deployment(2, 2), deployment(2, 2))
    for condition in first["conditions"]:
        condition["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    again = status(deployment(2, 2), deployment(2, 2), previous=first)
    assert not status_changed(first, again)  # nothing to write: idempotent
    later = status(deployment(2, 1), deployment(2, 2), previous=first)
    times = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert times["Reconciled"] == "2020-01-01T00:00:00Z"
    assert times["EngineReady"] != "2020-01-01T00:00:00Z"
    assert status_changed(first, later)


def test_scaled_to_zero() -> None:
    zero = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}
    assert status(zero, deployment(2, 2), replicas=0)["phase"] == "Ready"


def test_quantities_are_written_as_the_api_server_stores_them() -> None:
    """Otherwise the drift check would see a difference after every round trip."""
    assert [quantity(v) for v in (8, 8.0, 0.5, "0.5", "1.0", "500m", "32Gi", "1e3")] == [
        "8", "8", "500m", "500m", "1", "500m", "32Gi", "1e3",
    ]  # fmt: skip


def test_contains_is_a_deep_subset() -> None:
    want = {"spec": {"replicas": 2, "ports": [{"port": 80}], "selector": {"a": "b"}}}
    have = {
        "spec": {"replicas": 2, "ports": [{"port": 80, "protocol": "TCP"}], "selector": {"a": "b"}, "x": 1}
    }
    assert contains(want, have)
    assert not contains(want, {"spec": {**have["spec"], "replicas": 3}})
    assert not contains(want, {"spec": {**have["spec"], "ports": [{"port": 80}, {"port": 81}]}})
    assert not contains(want, {"spec": {"replicas": 2, "ports": [{"port": 80}]}})
    assert contains({"a": 1.0}, {"a": 1}) and not contains({"a": True}, {"a": 1})


def test_quantities_the_api_server_normalised_are_no_drift() -> None:
    """The API server stores quantities in canonical form; the drift check compares their values."""
    want = {
        "resources": {"requests": {"cpu": "1500m", "memory": "1024Mi"}, "limits": {"nvidia.com/gpu": "1"}},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "0.5Gi"}}],
        "target": {"type": "AverageValue", "averageValue": "1e3"},
    }
    stored = {
        "resources": {"requests": {"cpu": "1.5", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "512Mi"}}],
        "target": {"type": "AverageValue", "averageValue": "1k"},
    }
    assert contains(want, stored)
    changed = {**stored, "resources": {**stored["resources"], "requests": {"cpu": "2", "memory": "1Gi"}}}
    assert not contains(want, changed)
    # only quantity fields: elsewhere "1k" and "1e3" stay different strings
    assert not contains({"env": [{"name": "N", "value": "1e3"}]}, {"env": [{"name": "N", "value": "1k"}]})


def test_a_leaderworkerset_engine_reads_as_a_deployment() -> None:
    """spec.nodes > 1: the engine's LeaderWorkerSet reports groups as replicas; its Progressing False only
    says no rollout is under way (a Deployment's says the rollout gave up)."""
    done = [{"type": "Available", "status": "True"}, {"type": "Progressing", "status": "False"}]
    groups = {**deployment(2, 2, conditions=done), "kind": "LeaderWorkerSet"}
    ready = status(groups, deployment(2, 2))
    assert ready["phase"] == "Ready"
    gave_up = [{"type": "Progressing", "status": "False", "message": "gave up"}]
    stuck = deployment(2, 1, conditions=gave_up)
    assert status(stuck, deployment(2, 2))["phase"] == "Failed"


def test_a_disaggregated_deployment_is_ready_when_both_roles_are() -> None:
    """spec.disaggregation: the engine Deployment is the decode role, the prefill Deployment the other;
    Ready needs both, and the status reports the prefill role's replicas and a condition of its own."""
    prefill_pending = status(deployment(2, 2), deployment(2, 2), prefill=deployment(1, 0), prefill_replicas=1)
    assert prefill_pending["phase"] == "Progressing"
    assert (prefill_pending["prefillReplicas"], prefill_pending["prefillReadyReplicas"]) == (1, 0)
    conditions = {c["type"]: c for c in prefill_pending["conditions"]}
    assert conditions["EngineReady"]["status"] == "True"
    assert conditions["PrefillEngineReady"]["status"] == "False"
    assert conditions["PrefillEngineReady"]["message"] == "0/1 prefill engine replicas ready"
    assert "prefill engine 0/1 ready" in conditions["Ready"]["message"]

    ready = status(deployment(2, 2), deployment(2, 2), prefill=deployment(1, 1), prefill_replicas=1)
    assert ready["phase"] == "Ready" and ready["prefillReadyReplicas"] == 1
    assert {c["type"]: c["status"] for c in ready["conditions"]} == {
        "Reconciled": "True",
        "EngineReady": "True",
        "PrefillEngineReady": "True",
        "RouterReady": "True",
        "Ready": "True",
    }
    # the prefill engines lost one: Degraded, as for the decode engines
    lost = status(deployment(2, 2), deployment(2, 2), ready, prefill=deployment(1, 0), prefill_replicas=1)
    assert lost["phase"] == "Degraded"
    # nothing ready at all yet: Pending; the prefill Deployment's rollout gave up: Failed, naming the role
    nothing = status(deployment(2, 0), deployment(2, 0), prefill=deployment(1, 0), prefill_replicas=1)
    assert nothing["phase"] == "Pending"
    stuck = [{"type": "Progressing", "status": "False", "message": "gave up"}]
    failed = status(
        deployment(2, 2), deployment(2, 2), prefill=deployment(1, 0, conditions=stuck), prefill_replicas=1
    )
    assert failed["phase"] == "Failed"
    assert {c["type"]: c for c in failed["conditions"]}["Ready"]["message"] == "prefill engine: gave up"
    # no prefill Deployment yet (just created): not ready
    assert status(deployment(2, 2), deployment(2, 2), prefill_replicas=1)["phase"] == "Progressing"


def test_colocated_status_has_no_prefill_fields_and_clears_old_ones() -> None:
    colocated = status(deployment(2, 2), deployment(2, 2))
    assert "prefillReplicas" not in colocated and "prefillReadyReplicas" not in colocated
    assert "PrefillEngineReady" not in {c["type"] for c in colocated["conditions"]}
    # disaggregation removed: null removes the old fields (the status is written as a JSON merge patch)
    was = status(deployment(2, 2), deployment(2, 2), prefill=deployment(1, 1), prefill_replicas=1)
    after = status(deployment(2, 2), deployment(2, 2), was)
    assert after["prefillReplicas"] is None and after["prefillReadyReplicas"] is None
    assert status_changed(was, after)
