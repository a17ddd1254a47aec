"""Scale to zero (``spec.scaleFromZero``): when a ModelDeployment's engines have been idle long enough.

Router replicas share no state, so the routers do not decide: each records its traffic on the
ModelDeployment in the ``pagedserve.io/last-request-time`` annotation (router/activator.py, throttled to
one patch per ``--activity-interval``, and refreshed on that interval for as long as it has requests in
flight or held), and the operator's resync loop (operator/handlers.py -> operator/reconcile.py) decides
here, on what every router wrote. An annotation refreshed while requests are in flight or held keeps a busy
fleet up, however long its requests run; the operator renders the routers' interval well below the delay
(``activity_interval``). Without any annotation yet, the idle time counts from the ModelDeployment's
creation.

Who owns which edge (so that the HPA and scale-from-zero never fight): an HPA cannot have minReplicas 0
without the HPAScaleToZero alpha gate, and it does nothing while its target has 0 replicas. So the HPA is
rendered with minReplicas >= 1 (operator/resources.py) and owns 1..maxReplicas; the routers own 0 -> 1
(the scale subresource, only when it is 0) and this decision owns -> 0, through the same subresource.
"""

from __future__ import annotations

import datetime
from typing import Any

from pagedserve.common.resource import LAST_REQUEST_ANNOTATION
from pagedserve.operator.spec import ModelDeploymentSpec


def parse_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 timestamp (the API's form, e.g. 2026-01-01T00:00:00Z) as an aware datetime."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def last_activity(metadata: dict[str, Any]) -> datetime.datetime | None:
    """The last request any router recorded, else the creation time."""
    annotations = metadata.get("annotations") or {}
    recorded = parse_time(annotations.get(LAST_REQUEST_ANNOTATION))
    return recorded or parse_time(metadata.get("creationTimestamp"))


def scale_down_due(spec: ModelDeploymentSpec, metadata: dict[str, Any], now: datetime.datetime) -> bool:
    """Whether the engines go to 0 now: scale-from-zero is on, some replica is asked for, and no router
    recorded a request for scaleDownDelaySeconds."""
    if spec.scale_from_zero is None or spec.replicas == 0:
        return False
    last = last_activity(metadata)
    if last is None:  # no creation time either (an emulator): never guess idle
        return False
    return (now - last).total_seconds() >= spec.scale_from_zero.scale_down_delay_seconds


def activity_interval(scale_down_delay_seconds: int) -> int:
    """How often each router refreshes the annotation: a quarter of the delay (1 to 30 s), so that a
    refresh or two can be lost or late before a busy fleet could look idle."""
    return max(1, min(30, scale_down_delay_seconds // 4))
