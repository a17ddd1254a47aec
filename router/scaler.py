"""The router's two writes to its ModelDeployment, for scale from zero (``--scale-from-zero NAME``).

* ``wake``: the scale subresource (``PATCH .../modeldeployments/NAME/scale``) from 0 to 1, only when it is
  0 (read, then written with the resourceVersion read: a concurrent writer makes it a 409, never a scale
  down from 3 to 1). The operator copies spec.replicas to the engine Deployment; an HPA takes over from 1.
* ``record_activity``: the ``pagedserve.io/last-request-time`` annotation, which the operator reads to
  scale the engines back to 0 after ``scaleDownDelaySeconds`` (operator/idle.py).

The kubernetes client (in-cluster config, else kubeconfig), as for the EndpointSlices (router/discovery.py),
in a worker thread: its calls block. The router's Role allows exactly these calls on this one
ModelDeployment (operator/resources.py, ROUTER_SCALE_RULES).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

from pagedserve.common.resource import GROUP, LAST_REQUEST_ANNOTATION, PLURAL, VERSION

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


def format_time(when: float) -> str:
    """A Unix time as RFC 3339 UTC with microseconds (what operator/idle.py parses)."""
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ModelDeploymentScaler:
    def __init__(self, name: str, namespace: str, api: Any = None) -> None:
        self.name = name
        self.namespace = namespace
        self.api = api

    def _custom_objects(self) -> Any:
        if self.api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.api = client.CustomObjectsApi()
        return self.api

    def _to_dict(self, obj: Any) -> dict[str, Any]:
        if isinstance(obj, dict):
            return obj
        return self._custom_objects().api_client.sanitize_for_serialization(obj)

    async def wake(self) -> bool:
        """Scale 0 -> 1; False when the scale was not 0 (someone else woke it, or it was never down)."""
        return await asyncio.to_thread(self._wake)

    def _wake(self) -> bool:
        api = self._custom_objects()
        scale = self._to_dict(
            api.get_namespaced_custom_object_scale(GROUP, VERSION, self.namespace, PLURAL, self.name)
        )
        if int((scale.get("spec") or {}).get("replicas") or 0) != 0:
            return False
        patch: dict[str, Any] = {"spec": {"replicas": 1}}
        version = (scale.get("metadata") or {}).get("resourceVersion")
        if version:
            patch["metadata"] = {"resourceVersion": version}
        api.patch_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, PLURAL, self.name, patch, _content_type=MERGE_PATCH
        )
        logger.info("no engine replica: scaled ModelDeployment %s/%s to 1", self.namespace, self.name)
        return True

    async def record_activity(self, when: float) -> None:
        await asyncio.to_thread(self._record_activity, when)

    def _record_activity(self, when: float) -> None:
        patch = {"metadata": {"annotations": {LAST_REQUEST_ANNOTATION: format_time(when)}}}
        self._custom_objects().patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name, patch, _content_type=MERGE_PATCH
        )
