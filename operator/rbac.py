"""The operator's ClusterRole rules, declared once next to the code whose API calls need them.

``make manifests`` (operator/manifests.py) writes them to charts/pagedserve/files/operator-rbac.yaml,
which the chart's ClusterRole (charts/pagedserve/templates/clusterrole.yaml) reads.
Least privilege: no wildcards, no Secrets (pods reference them by name; the operator never reads them).
(`pagedserve operator --peering NAME` additionally needs kopf's peering resources: the chart adds them
when operator.replicas > 1.)
"""

from __future__ import annotations

from typing import Any

from pagedserve.common.resource import GROUP, PLURAL
from pagedserve.operator.resources import CHILD_KINDS, ROUTER_RULES, ROUTER_SCALE_RULES

# Children: read, create, server-side apply (patch), delete (operator/kube.py).
CHILD_VERBS = ["get", "create", "patch", "delete"]
# Children the operator also watches (handlers.py's @kopf.on.event on Deployments), so that their
# readiness reaches the ModelDeployment's status at once.
WATCHED_CHILDREN = {("apps", "deployments")}


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def child_rules() -> list[dict[str, Any]]:
    """One rule per API group of the kinds render() produces (resources.py's CHILD_KINDS)."""
    by_group: dict[tuple[str, bool], list[str]] = {}
    for (api_version, _kind), plural in CHILD_KINDS.items():
        group = api_version.rpartition("/")[0]
        by_group.setdefault((group, (group, plural) in WATCHED_CHILDREN), []).append(plural)
    return [
        _rule(group, plurals, ["get", "list", "watch", *CHILD_VERBS[1:]] if watched else CHILD_VERBS)
        for (group, watched), plurals in by_group.items()
    ]


def operator_rules() -> list[dict[str, Any]]:
    return [
        # ModelDeployments: kopf lists, watches and patches them (its annotations, and it removes the
        # finalizer earlier versions added); the operator reads one before each reconcile and writes its
        # status. Children carry ownerReferences with blockOwnerDeletion, which needs update on the
        # owner's finalizers subresource.
        _rule(GROUP, [PLURAL], ["get", "list", "watch", "patch"]),
        _rule(GROUP, [f"{PLURAL}/status"], ["get", "patch"]),
        _rule(GROUP, [f"{PLURAL}/finalizers"], ["update"]),
        *child_rules(),
        # What each router's Role grants: RBAC lets the operator grant only permissions it holds itself.
        *ROUTER_RULES,
        # ... and with scale-from-zero: the scale subresource, which the operator also sets to 0 itself
        # (operator/idle.py), and the routers' last-request annotation.
        *ROUTER_SCALE_RULES,
        # Engine pods: their IPs, to load and unload LoRA adapters on each (operator/adapters.py).
        _rule("", ["pods"], ["list"]),
        # Warning Events on failures (kopf posts core/v1 Events).
        _rule("", ["events"], ["create"]),
        # kopf itself: namespaces (for --namespace patterns) and CRDs (resources that appear later).
        _rule("", ["namespaces"], ["list", "watch"]),
        _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"]),
    ]


RULES = operator_rules()
