"""A ModelDeployment's status, computed from its children (pure: dicts in, a dict out).

phase:
- Failed       the children could not be applied, or a Deployment's rollout gave up
               (ProgressDeadlineExceeded, ReplicaFailure)
- Ready        every engine (with spec.disaggregation: decode and prefill) and router replica asked for is
               ready and up to date
- Pending      nothing is ready yet and the resource has never been ready
- Progressing  a rollout or scale-up is under way
- Degraded     it was serving, and fewer replicas are ready now with no rollout to explain it
"""

from __future__ import annotations

import datetime
from typing import Any, Literal, get_args

from pagedserve.operator.resources import endpoint, label_selector
from pagedserve.operator.spec import CamelModel, Int32, Int64
from pydantic import Field

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
PHASES: tuple[str, ...] = get_args(Phase)


# The models' docstrings and descriptions are the CRD's descriptions (operator/crd.py): write them for
# `kubectl explain` readers.
class Condition(CamelModel):
    """One aspect of the ModelDeployment's state (metav1.Condition's shape)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: datetime.datetime | None = None
    observed_generation: Int64 | None = None


class ReplicaAdapters(CamelModel):
    """The LoRA adapters one ready engine pod serves (its /v1/models), as of the last reconcile."""

    pod: str
    adapters: list[str] = Field(default_factory=list)


class ModelDeploymentStatus(CamelModel):
    """The observed state, written by the operator (compute_status)."""

    phase: Phase | None = None
    replicas: Int32 | None = None
    ready_replicas: Int32 | None = None
    router_ready_replicas: Int32 | None = None
    prefill_replicas: Int32 | None = Field(
        None, description="With spec.disaggregation, the prefill engine replicas (replicas: the decode ones)."
    )
    prefill_ready_replicas: Int32 | None = Field(
        None, description="With spec.disaggregation, the ready prefill engine replicas."
    )
    endpoint: str | None = None
    selector: str | None = Field(
        None, description="The engine pods' label selector (the scale subresource's, for the HPA)."
    )
    observed_generation: Int64 | None = None
    adapter_count: Int32 | None = Field(None, description="The number of spec.adapters (printer column).")
    adapters: list[ReplicaAdapters] | None = Field(
        None, description="Per ready engine pod, the LoRA adapters it serves (read from its /v1/models)."
    )
    # One entry per type, merged by type on server-side apply.
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Rollout:
    """What one child Deployment (or the engine's LeaderWorkerSet: replicas, readyReplicas, updatedReplicas
    and observedGeneration alike) says about itself."""

    def __init__(self, deployment: dict[str, Any] | None, desired: int) -> None:
        deployment = deployment or {}
        status = deployment.get("status") or {}
        self.exists = bool(deployment)
        self.desired = desired
        self.replicas = int(status.get("replicas") or 0)
        self.ready = int(status.get("readyReplicas") or 0)
        self.updated = int(status.get("updatedReplicas") or 0)
        generation = (deployment.get("metadata") or {}).get("generation")
        observed = status.get("observedGeneration")
        self.observed = observed is not None and (generation is None or observed >= generation)
        self.failure = ""
        # A Deployment's Progressing False is a rollout that gave up; a LeaderWorkerSet's only says that none
        # is under way.
        deployment_kind = deployment.get("kind", "Deployment") == "Deployment"
        for condition in status.get("conditions") or []:
            if (deployment_kind and condition.get("type") == "Progressing"
                    and condition.get("status") == "False"):
                self.failure = condition.get("message") or condition.get("reason") or "rollout stuck"
            if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
                self.failure = condition.get("message") or condition.get("reason") or "replica failure"

    @property
    def complete(self) -> bool:
        if self.desired == 0:
            return self.exists and self.replicas == 0
        return self.observed and self.ready >= self.desired and self.updated >= self.desired

    @property
    def rolling(self) -> bool:
        return not self.observed or self.updated < self.desired or self.replicas > self.desired


def _condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(type_) or {}
    changed = before.get("status") != status
    condition = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _now()
        if changed or not before.get("lastTransitionTime")
        else before["lastTransitionTime"],
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def compute_status(
    modeldeployment: dict[str, Any],
    *,
    engine: dict[str, Any] | None,
    router: dict[str, Any] | None,
    replicas: int,
    router_replicas: int,
    error: str | None = None,
    adapters: list[dict[str, Any]] | None = None,
    adapter_count: int = 0,
    prefill: dict[str, Any] | None = None,
    prefill_replicas: int | None = None,
) -> dict[str, Any]:
    """The status the operator writes: engine/router from the live Deployments, error from applying.

    ``prefill_replicas`` (None: not disaggregated): the prefill engines asked for, ``prefill`` their live
    Deployment; ``engine`` is then the decode engines'. Ready needs both roles."""
    meta = modeldeployment.get("metadata") or {}
    name, namespace = meta["name"], meta["namespace"]
    generation = meta.get("generation")
    previous_status = modeldeployment.get("status") or {}
    previous = {c.get("type"): c for c in previous_status.get("conditions") or [] if isinstance(c, dict)}
    was = previous_status.get("phase")

    eng = Rollout(engine, replicas)
    rtr = Rollout(router, router_replicas)
    disaggregated = prefill_replicas is not None
    pre = Rollout(prefill, prefill_replicas or 0)
    failure = (
        error
        or (f"engine: {eng.failure}" if eng.failure else "")
        or (f"prefill engine: {pre.failure}" if disaggregated and pre.failure else "")
        or (f"router: {rtr.failure}" if rtr.failure else "")
    )
    engines = [eng, pre] if disaggregated else [eng]
    if failure:
        phase = "Failed"
    elif all(e.complete for e in engines) and rtr.complete:
        phase = "Ready"
    elif all(e.ready == 0 for e in engines) and rtr.ready == 0 and was in (None, "", "Pending"):
        phase = "Pending"
    elif (
        any(e.rolling for e in engines)
        or rtr.rolling
        or was in (None, "", "Pending", "Progressing", "Failed")
    ):
        phase = "Progressing"
    else:
        phase = "Degraded"

    ready_message = f"engine {eng.ready}/{replicas} ready, router {rtr.ready}/{router_replicas} ready"
    if disaggregated:
        ready_message = (
            f"decode engine {eng.ready}/{replicas} ready, prefill engine {pre.ready}/{prefill_replicas}"
            f" ready, router {rtr.ready}/{router_replicas} ready"
        )
    conditions = [
        _condition(
            "Reconciled",
            error is None,
            "ReconcileFailed" if error else "ReconcileSucceeded",
            error or "all children applied",
            generation,
            previous,
        ),
        _condition(
            "EngineReady",
            eng.complete,
            "ReplicasReady" if eng.complete else ("RolloutFailed" if eng.failure else "ReplicasNotReady"),
            eng.failure or f"{eng.ready}/{replicas} engine replicas ready",
            generation,
            previous,
        ),
        _condition(
            "RouterReady",
            rtr.complete,
            "ReplicasReady" if rtr.complete else ("RolloutFailed" if rtr.failure else "ReplicasNotReady"),
            rtr.failure or f"{rtr.ready}/{router_replicas} router replicas ready",
            generation,
            previous,
        ),
        _condition("Ready", phase == "Ready", phase, failure or ready_message, generation, previous),
    ]
    if disaggregated:
        prefill_ready = _condition(
            "PrefillEngineReady",
            pre.complete,
            "ReplicasReady" if pre.complete else ("RolloutFailed" if pre.failure else "ReplicasNotReady"),
            pre.failure or f"{pre.ready}/{prefill_replicas} prefill engine replicas ready",
            generation,
            previous,
        )
        conditions.insert(2, prefill_ready)
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": eng.replicas,
        "readyReplicas": eng.ready,
        "routerReadyReplicas": rtr.ready,
        "endpoint": endpoint(name, namespace),
        "selector": label_selector(name, "engine"),
        "conditions": conditions,
    }
    if disaggregated:
        status["prefillReplicas"] = pre.replicas
        status["prefillReadyReplicas"] = pre.ready
    elif "prefillReplicas" in previous_status or "prefillReadyReplicas" in previous_status:
        # no longer disaggregated: null removes them (the status is written as a JSON merge patch)
        status["prefillReplicas"] = status["prefillReadyReplicas"] = None
    if generation is not None:
        status["observedGeneration"] = generation
    if adapters is not None or adapter_count:
        status["adapterCount"] = adapter_count
        status["adapters"] = adapters or []
    return status


def status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change anything the operator owns in ``current``."""
    current = current or {}
    return any(current.get(key) != value for key, value in new.items())
