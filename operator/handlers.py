"""kopf wiring: when to reconcile a ModelDeployment, and how failures are reported.

- create / update / resume: reconcile (apply children, write status).
- a daemon per ModelDeployment re-reconciles every ``resync_seconds``: drift repair for every kind of
  child (a deleted or edited Service, Role, PVC... comes back) and fresh status.
- events on the children Deployments (labelled managed-by pagedserve-operator): reconcile the owner at
  once, so readiness shows in the status and a deleted Deployment is recreated without waiting.
- delete: remove the children (best effort; their ownerReferences let the garbage collector finish),
  never failing, so the finalizer always goes.
- failures: a Warning Event on the ModelDeployment (reason InvalidSpec or ReconcileFailed), the
  message in status (phase Failed, condition Reconciled=False), and a retry for temporary errors.

Importing this module registers the handlers in kopf's default registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from pagedserve.operator import reconcile as rec
from pagedserve.operator.kube import Kube, KubeError
from pagedserve.operator.resources import MANAGER
from pagedserve.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION

RETRY_DELAY = 15.0


class _State:
    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.options = rec.Options()
        self.resync_seconds = 60.0
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Set on cleanup: daemons kopf spawns while it is already stopping exit at once too.
        self.stopping = asyncio.Event()


STATE = _State()


def configure(*, options: rec.Options | None = None, resync_seconds: float | None = None) -> None:
    """Set by `pagedserve operator` before kopf starts."""
    if options is not None:
        STATE.options = options
    if resync_seconds is not None:
        STATE.resync_seconds = resync_seconds


def _plain(value: Any) -> Any:
    """kopf's body views -> plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _kube() -> Kube:
    if STATE.kube is None:
        raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
    return STATE.kube


# -- activities -------------------------------------------------------------------------------------


@kopf.on.startup()
def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )


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
            _report(md, "InvalidSpec", str(error))
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


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def resync(namespace: str, name: str, logger: Any, **_: Any) -> None:
    """Drift repair and status refresh: reconcile every resync_seconds until the object or operator goes."""
    while not STATE.stopping.is_set():
        try:
            await asyncio.wait_for(STATE.stopping.wait(), STATE.resync_seconds)
            break
        except asyncio.TimeoutError:
            pass
        try:
            await reconcile_named(namespace, name, logger, raise_errors=False)
        except Exception as error:  # keep the loop alive; the next round retries
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


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete(body: Any, namespace: str, name: str, logger: Any, **_: Any) -> None:
    md = _plain(body)
    try:
        async with STATE.locks.setdefault((namespace, name), asyncio.Lock()):
            deleted = await rec.delete_children(_kube(), md)
        if deleted:
            logger.info(f"deleted {', '.join(deleted)}")
    except (KubeError, kopf.TemporaryError) as error:
        # Never block the finalizer: the children's ownerReferences let the garbage collector finish.
        logger.warning(f"could not delete every child ({error}); leaving them to the garbage collector")
    finally:
        STATE.locks.pop((namespace, name), None)
