"""kopf wiring: when to reconcile a ModelDeployment, and how failures are reported.

- create / update / resume: reconcile (apply children, write status).
- one operator-wide loop re-reconciles every watched ModelDeployment every ``resync_seconds``: drift
  repair for every kind of child (a deleted or edited Service, Role, PVC... comes back) and fresh status.
- events on the children Deployments (labelled managed-by pagedserve-operator): reconcile the owner at
  once, so readiness shows in the status and a deleted Deployment is recreated without waiting.
- delete: nothing to do. Every child is namespaced beside its ModelDeployment and carries its
  ownerReference, so the garbage collector removes them. No handler here needs a finalizer (kopf adds one
  for @kopf.on.delete handlers that are not optional, and for every @kopf.daemon and @kopf.timer), so
  deleting a ModelDeployment never waits for the operator, even when the operator is down. The
  finalizer that earlier versions added is removed by kopf on the first event it sees (it still knows
  its name, ``pagedserve.io/finalizer``, and drops it because no handler requires it).
- failures: a Warning Event on the ModelDeployment (reason InvalidSpec, Refused by the operator's
  policy (operator/policy.py), or ReconcileFailed), the message in status (phase Failed, condition
  Reconciled=False), and a retry for temporary errors.

Importing this module registers the handlers in kopf's default registry.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from typing import Any

import kopf
from pagedserve.common.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION
from pagedserve.operator import reconcile as rec
from pagedserve.operator.kube import Kube, KubeError
from pagedserve.operator.resources import MANAGER

RETRY_DELAY = 15.0
# Seconds after its last heartbeat that a silent (crashed) replica stops holding the others paused.
PEERING_LIFETIME_S = 30


class _State:
    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.options = rec.Options()
        self.resync_seconds = 60.0
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        # (namespace, name) of every ModelDeployment in the watched namespaces: what the resync loop visits.
        self.known: set[tuple[str, str]] = set()
        self.resync_task: asyncio.Task[None] | None = None
        # Set on cleanup: the resync loop stops at once.
        self.stopping = asyncio.Event()


STATE = _State()


def configure(*, options: rec.Options | None = None, resync_seconds: float | None = None) -> None:
    """Set by `pagedserve operator` before kopf starts."""
    if options is not None:
        STATE.options = options
    if resync_seconds is not None:
        STATE.resync_seconds = resync_seconds


def _kube() -> Kube:
    if STATE.kube is None:
        raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
    return STATE.kube


# -- activities -------------------------------------------------------------------------------------


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    # No handler requires a finalizer; naming it lets kopf remove the one earlier versions added.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # kopf pauses every replica that sees a peer of the same or a higher priority (docs/peering.rst), so
    # replicas started alike (one Deployment, one priority) would all pause: a random priority per
    # process leaves exactly one active. A replica that dies without saying goodbye stops counting once
    # its record is older than the lifetime; then the next in priority resumes.
    settings.peering.priority = random.SystemRandom().randint(1, 2**30)
    settings.peering.lifetime = PEERING_LIFETIME_S
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    STATE.resync_task = asyncio.create_task(resync_loop())


@kopf.on.login()
def _login(settings: kopf.OperatorSettings, logger: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else kubeconfig ($KUBECONFIG): kopf and our client share it."""
    info = kopf.login_via_client(settings=settings, logger=logger, **kwargs)
    if info is None:
        return None

    async def relogin() -> Any:
        return await asyncio.to_thread(kopf.login_via_client, settings=settings, logger=logger)

    if STATE.kube is None:
        STATE.kube = Kube(info, relogin=relogin)
    else:
        STATE.kube.set_credentials(info)
    return info


@kopf.on.cleanup()
async def _cleanup(**_: Any) -> None:
    STATE.stopping.set()
    if STATE.resync_task is not None:  # a round in progress is cut short: reconciling is idempotent
        STATE.resync_task.cancel()
        await asyncio.gather(STATE.resync_task, return_exceptions=True)
    if STATE.kube is not None:
        await STATE.kube.aclose()


# -- reconciliation ---------------------------------------------------------------------------------


def _already_reported(md: dict[str, Any], message: str) -> bool:
    """The status already carries this failure: an earlier round posted its Event."""
    for condition in (md.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Reconciled":
            return condition.get("status") == "False" and condition.get("message") == message
    return False


def _report(md: dict[str, Any], reason: str, message: str) -> None:
    if _already_reported(md, message):
        return
    try:
        kopf.warn(md, reason=reason, message=message[:1000])
    except Exception:  # posting is best effort (no queue outside a running operator)
        logging.getLogger(__name__).warning(f"{reason}: {message}")


async def reconcile_named(namespace: str, name: str, logger: Any, *, raise_errors: bool) -> rec.Result | None:
    """Reconcile the ModelDeployment as it is now (fresh from the API), one at a time per object."""
    kube = _kube()
    lock = STATE.locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        md = await kube.get(API_VERSION, PLURAL, namespace, name)
        if md is None or (md.get("metadata") or {}).get("deletionTimestamp"):
            return None  # gone or going: the delete handler owns it now
        try:
            result = await rec.reconcile(kube, md, STATE.options, logger)
        except rec.SpecError as error:
            _report(md, error.reason, str(error))
            if raise_errors:
                raise kopf.PermanentError(str(error)) from error
            return None
        except KubeError as error:
            _report(md, "ReconcileFailed", str(error))
            if raise_errors:
                raise kopf.TemporaryError(str(error), delay=RETRY_DELAY) from error
            return None
        if result.errors:
            message = "; ".join(result.errors)
            _report(md, "ReconcileFailed", message)
            if raise_errors:
                raise kopf.TemporaryError(message, delay=RETRY_DELAY)
        return result


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def apply(namespace: str, name: str, logger: Any, **_: Any) -> None:
    await reconcile_named(namespace, name, logger, raise_errors=True)


@kopf.on.event(GROUP, VERSION, PLURAL)
def track(event: Mapping[str, Any], namespace: str, name: str, **_: Any) -> None:
    """Keep the set of ModelDeployments the resync loop visits (kopf lists and watches them for us)."""
    if event.get("type") == "DELETED":
        STATE.known.discard((namespace, name))
        STATE.locks.pop((namespace, name), None)
    else:
        STATE.known.add((namespace, name))


async def resync_loop() -> None:
    """Drift repair and status refresh: reconcile every known ModelDeployment every resync_seconds.

    One loop for the operator rather than a kopf daemon per object: kopf puts a finalizer on every object
    that has a daemon, and a finalizer makes deletion wait for a running operator. Unlike kopf's daemons,
    the loop also runs in a replica that peering paused (after it saw the objects while active): harmless,
    as a reconcile writes only what drifted and a lost create race is compared, not failed (reconcile.py).
    """
    logger = logging.getLogger("pagedserve.operator.resync")
    while not STATE.stopping.is_set():
        try:
            await asyncio.wait_for(STATE.stopping.wait(), STATE.resync_seconds)
            break
        except asyncio.TimeoutError:
            pass
        results = await asyncio.gather(
            *(reconcile_named(ns, name, logger, raise_errors=False) for ns, name in sorted(STATE.known)),
            return_exceptions=True,
        )
        for error in results:
            if isinstance(error, BaseException):  # the next round retries
                logger.warning(f"resync failed: {error}")


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGER})
async def child_deployment_changed(body: Any, namespace: str, logger: Any, **_: Any) -> None:
    """A child Deployment changed (status, an edit) or went away: bring its owner up to date."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            try:
                await reconcile_named(namespace, ref["name"], logger, raise_errors=False)
            except KubeError as error:
                logger.warning(f"reconcile of {ref['name']} after a child change failed: {error}")
