"""Reconciliation: make a ModelDeployment's children match render(), then report status.

Idempotent by construction: each rendered child carries ``pagedserve.io/spec-hash``; a live child is
patched only when its hash differs or when a rendered field no longer holds its rendered value (someone
edited it), and a missing child is created. Re-running on an unchanged spec and unchanged children makes
no writes at all, and the status is written only when it changes.
"""

from __future__ import annotations

import copy
import datetime
import logging
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kubernetes.utils.quantity import parse_quantity
from pagedserve.common.resource import API_VERSION, PLURAL
from pagedserve.operator.adapters import AdapterSync, sync_adapters
from pagedserve.operator.idle import scale_down_due
from pagedserve.operator.kube import Kube, KubeError
from pagedserve.operator.policy import Policy, refusals
from pagedserve.operator.resources import (
    CHILD_KINDS,
    DEFAULT_CPU_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    ENGINE_PORT,
    HASH_ANNOTATION,
    MANAGER,
    STARTUP_ADAPTERS_ANNOTATION,
    adapter_path,
    adapter_set_json,
    engine_name,
    label_selector,
    potential_children,
    prefill_name,
    render,
    router_name,
)
from pagedserve.operator.spec import (
    ModelDeploymentSpec,
    format_validation_error,
    parse_spec,
)
from pagedserve.operator.status import compute_status, status_changed

PODMONITOR_API = ("monitoring.coreos.com/v1", "podmonitors")


@dataclass
class Options:
    default_image: str = DEFAULT_IMAGE
    default_cpu_image: str = DEFAULT_CPU_IMAGE
    default_router_image: str = DEFAULT_ROUTER_IMAGE
    policy: Policy = field(default_factory=Policy)
    engine_port: int = ENGINE_PORT  # where the operator reaches engine pods (adapter load/unload)


@dataclass
class Result:
    status: dict[str, Any]
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class SpecError(Exception):
    """The spec cannot be rendered (a permanent error until the spec changes)."""

    reason = "InvalidSpec"  # of the Warning Event


class PolicyRefusal(SpecError):
    """The spec asks for what the operator's policy refuses (operator/policy.py)."""

    reason = "Refused"


# Fields that hold Kubernetes quantities, which the API server stores in canonical form (1024Mi -> 1Gi,
# 0.5 -> 500m, 2000m -> 2, the number 1 -> "1"): compared by value, or every resync would patch them
# again. "requests" and "limits" are resource lists (every value a quantity; a PVC's storage too).
QUANTITY_FIELDS = frozenset({"requests", "limits", "sizeLimit", "averageValue"})


def same_quantity(want: Any, have: Any) -> bool:
    try:
        return bool(parse_quantity(want) == parse_quantity(have))
    except (ValueError, TypeError):
        return bool(want == have)


def contains(want: Any, have: Any, *, quantity: bool = False) -> bool:
    """Whether ``have`` holds every field of ``want`` with the same value (lists element by element).

    ``quantity``: ``want`` is (or holds) quantities, equal when their values are, whatever their form.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            key in have and contains(value, have[key], quantity=quantity or key in QUANTITY_FIELDS)
            for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(contains(w, h, quantity=quantity) for w, h in zip(want, have, strict=True))
        )
    if isinstance(want, bool) or isinstance(have, bool):  # True == 1 in Python, not in JSON
        return want is have
    if quantity:
        return same_quantity(want, have)
    return bool(want == have)


def _ref(manifest: dict[str, Any]) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def _owned(live: dict[str, Any], uid: str, name: str) -> bool:
    """Ours: owned by this ModelDeployment, or labelled as this instance's by this operator (adoption)."""
    meta = live.get("metadata") or {}
    if any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or []):
        return True
    found = meta.get("labels") or {}
    return (
        found.get("app.kubernetes.io/managed-by") == MANAGER
        and found.get("app.kubernetes.io/instance") == name
    )


async def ensure(kube: Kube, manifest: dict[str, Any], uid: str, name: str, result: Result) -> dict[str, Any]:
    """Create the child, or patch it when it drifted from the manifest; return the live object."""
    plural = CHILD_KINDS[(manifest["apiVersion"], manifest["kind"])]
    meta = manifest["metadata"]
    live = await kube.get(manifest["apiVersion"], plural, meta["namespace"], meta["name"])
    if live is None:
        try:
            live = await kube.create(plural, manifest)
            result.created.append(_ref(manifest))
            return live or manifest
        except KubeError as error:
            if error.status != 409:  # lost a race with another reconcile: compare with theirs
                raise
            live = await kube.get(manifest["apiVersion"], plural, meta["namespace"], meta["name"])
            if live is None:
                raise
    if not _owned(live, uid, name):
        raise KubeError(
            409, f"{_ref(manifest)} exists and is not owned by this ModelDeployment", "AlreadyExists"
        )
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
    if live_hash == meta["annotations"][HASH_ANNOTATION] and contains(manifest, live):
        return live
    live = await kube.apply(plural, manifest)
    result.patched.append(_ref(manifest))
    return live or manifest


async def reconcile(
    kube: Kube, modeldeployment: dict[str, Any], options: Options | None = None, logger: Any = None
) -> Result:
    """Apply every child, remove the ones the spec no longer asks for, and write the status.

    Raises SpecError for a spec that cannot be rendered (after writing a Failed status). Errors on
    single children are collected in ``Result.errors`` (and in the status); the caller reports them.
    """
    options = options or Options()
    logger = logger or logging.getLogger(__name__)
    meta = modeldeployment["metadata"]
    name, uid = meta["name"], meta["uid"]

    def render_children(md: dict[str, Any]) -> list[dict[str, Any]]:
        return render(
            md,
            with_podmonitor=with_podmonitor,
            default_image=options.default_image,
            default_cpu_image=options.default_cpu_image,
            default_router_image=options.default_router_image,
        )

    try:
        spec = parse_spec(modeldeployment.get("spec"))
        modeldeployment, spec = await scale_down_if_idle(kube, modeldeployment, spec, logger)
        with_podmonitor = await kube.served(*PODMONITOR_API)
        children = render_children(modeldeployment)
    except ValueError as error:  # pydantic.ValidationError is a ValueError
        await fail(kube, modeldeployment, SpecError(f"invalid spec: {format_validation_error(error)}"), error)
    refused = refusals(spec, options.policy)
    if refused:
        await fail(kube, modeldeployment, PolicyRefusal(f"refused: {'; '.join(refused)}"))
    # Adapters first, so that a fallback (a new startup set) is rendered in this same round.
    pinned, adapters = await reconcile_adapters(kube, modeldeployment, spec, options.engine_port, logger)
    if pinned is not modeldeployment:
        modeldeployment, children = pinned, render_children(pinned)

    result = Result(status={})
    if adapters is not None and adapters.list_error:
        result.errors.append(adapters.list_error)
    live: dict[str, dict[str, Any]] = {}
    for manifest in children:
        try:
            live[_ref(manifest)] = await ensure(kube, manifest, uid, name, result)
        except KubeError as error:
            result.errors.append(f"{_ref(manifest)}: {error}")

    rendered = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in children}
    for api_version, kind, child in potential_children(name):
        if (api_version, kind, child) in rendered:
            continue
        try:
            if await _delete_owned(kube, modeldeployment, api_version, kind, child, with_podmonitor):
                result.deleted.append(f"{kind}/{child}")
        except KubeError as error:
            result.errors.append(f"{kind}/{child}: {error}")

    error = "; ".join(result.errors) or None
    engine = engine_name(name)
    result.status = compute_status(
        modeldeployment,
        # a Deployment, or a LeaderWorkerSet when the replicas span several nodes (whose status reads alike)
        engine=live.get(f"Deployment/{engine}") or live.get(f"LeaderWorkerSet/{engine}"),
        router=live.get(f"Deployment/{router_name(name)}"),
        replicas=spec.replicas,
        router_replicas=spec.router.replicas,
        error=error,
        adapters=adapters.status() if adapters is not None else None,
        adapter_count=len(spec.adapters),
        prefill=live.get(f"Deployment/{prefill_name(name)}"),
        prefill_replicas=spec.disaggregation.prefill.replicas if spec.disaggregation is not None else None,
    )
    await write_status(kube, modeldeployment, result.status)
    for verb, refs in (("created", result.created), ("patched", result.patched), ("deleted", result.deleted)):
        if refs:
            logger.info(f"{verb} {', '.join(refs)}")
    return result


async def reconcile_adapters(
    kube: Kube, modeldeployment: dict[str, Any], spec: ModelDeploymentSpec, port: int, logger: Any
) -> tuple[dict[str, Any], AdapterSync | None]:
    """spec.adapters on the running engines (operator/adapters.py); returns the ModelDeployment (a new
    dict when its startup adapter set was written, resources.py's STARTUP_ADAPTERS_ANNOTATION) and the
    sync's result (None when no pod was asked).

    First adapters: the spec's set is pinned as the startup set (the engines must start with LoRA on,
    so the template changes once). Later changes: load/unload on every ready pod, the template unchanged.
    A pod that refuses or does not answer: the fallback, the spec's set becomes the startup set and the
    Deployment rolls (a no-op when it already is: the roll is under way)."""
    meta = modeldeployment["metadata"]
    pinned = (meta.get("annotations") or {}).get(STARTUP_ADAPTERS_ANNOTATION)
    if not spec.adapters and pinned is None:
        return modeldeployment, None
    wanted = adapter_set_json(list(spec.adapters))
    sync = None
    if pinned is not None:
        try:
            pods = await kube.list("v1", "pods", meta["namespace"], label_selector(meta["name"], "engine"))
        except KubeError as error:  # reported in the status; the children are applied all the same
            return modeldeployment, AdapterSync(list_error=f"listing the engine pods: {error}")
        desired = {adapter.name: adapter_path(adapter) for adapter in spec.adapters}
        sync = await sync_adapters(pods, port, desired)
        if not sync.failed:
            return modeldeployment, sync
        if pinned != wanted:
            logger.warning(f"adapters not loaded at runtime ({'; '.join(sync.failed)}): rolling the engines")
    if pinned == wanted:
        return modeldeployment, sync
    patch = {"metadata": {"annotations": {STARTUP_ADAPTERS_ANNOTATION: wanted}}}
    await kube.merge_patch(API_VERSION, PLURAL, meta["namespace"], meta["name"], patch)
    updated = copy.deepcopy(modeldeployment)
    updated["metadata"].setdefault("annotations", {})[STARTUP_ADAPTERS_ANNOTATION] = wanted
    return updated, sync


async def scale_down_if_idle(
    kube: Kube, modeldeployment: dict[str, Any], spec: ModelDeploymentSpec, logger: Any
) -> tuple[dict[str, Any], ModelDeploymentSpec]:
    """spec.scaleFromZero: set the scale subresource to 0 once no router recorded a request for the delay
    (operator/idle.py decides); the rest of the round renders the 0. The patch carries the
    resourceVersion the decision read: a router that recorded a request meanwhile makes it a 409, and the
    fleet stays up."""
    if not scale_down_due(spec, modeldeployment["metadata"], datetime.datetime.now(datetime.timezone.utc)):
        return modeldeployment, spec
    meta = modeldeployment["metadata"]
    patch: dict[str, Any] = {"spec": {"replicas": 0}}
    if meta.get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    try:
        await kube.merge_patch(API_VERSION, PLURAL, meta["namespace"], meta["name"], patch, "scale")
    except KubeError as error:
        if error.status == 409:
            return modeldeployment, spec  # a router wrote meanwhile: decide again next round
        raise
    assert spec.scale_from_zero is not None  # scale_down_due checked it
    logger.info(f"no request for {spec.scale_from_zero.scale_down_delay_seconds}s: engines scaled to 0")
    scaled = copy.deepcopy(modeldeployment)
    scaled["spec"]["replicas"] = 0
    return scaled, parse_spec(scaled["spec"])


async def fail(
    kube: Kube, modeldeployment: dict[str, Any], error: SpecError, cause: Exception | None = None
) -> NoReturn:
    """Write a Failed status for a spec that cannot run, and raise ``error``: no child is touched."""
    status = compute_status(
        modeldeployment, engine=None, router=None, replicas=0, router_replicas=0, error=str(error)
    )
    await write_status(kube, modeldeployment, status)
    raise error from cause


async def write_status(kube: Kube, modeldeployment: dict[str, Any], status: dict[str, Any]) -> None:
    if not status_changed(modeldeployment.get("status"), status):
        return
    meta = modeldeployment["metadata"]
    await kube.merge_patch(API_VERSION, PLURAL, meta["namespace"], meta["name"], {"status": status}, "status")


async def _delete_owned(
    kube: Kube, modeldeployment: dict[str, Any], api_version: str, kind: str, child: str, podmonitors: bool
) -> bool:
    """Delete one potential child if it exists and is this ModelDeployment's; True if it was deleted."""
    meta = modeldeployment["metadata"]
    plural = CHILD_KINDS[(api_version, kind)]
    if (api_version, plural) == PODMONITOR_API and not podmonitors:
        return False  # the API is not served: there is nothing to delete
    existing = await kube.get(api_version, plural, meta["namespace"], child)
    if existing is None or not _owned(existing, meta.get("uid", ""), meta["name"]):
        return False
    return await kube.delete(api_version, plural, meta["namespace"], child)
