"""operator/rbac.py: the operator's ClusterRole rules (the chart's ClusterRole is built from them)."""

from __future__ import annotations

from typing import Any

from pagedserve.operator import render
from pagedserve.operator.kube import api_prefix
from pagedserve.operator.rbac import operator_rules
from pagedserve.operator.resources import CHILD_KINDS

from pagedserve.testing.kube import manifest_errors

RULES: list[dict[str, Any]] = operator_rules()


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in RULES
    )


def test_rules_are_a_valid_cluster_role() -> None:
    assert isinstance(RULES, list) and RULES
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "x"}}
    assert manifest_errors({**role, "rules": RULES}) == []


def test_least_privilege() -> None:
    for rule in RULES:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
    assert not any("secrets" in rule["resources"] for rule in RULES)
    assert not any(verb in rule["verbs"] for rule in RULES for verb in ("escalate", "bind", "impersonate"))


def test_everything_the_operator_does_is_allowed() -> None:
    for (api_version, _kind), plural in CHILD_KINDS.items():
        group = api_version.rpartition("/")[0]
        for verb in ("get", "create", "patch", "delete"):
            assert allowed(group, plural, verb), (api_version, plural, verb)
    assert allowed("apps", "deployments", "watch") and allowed("apps", "deployments", "list")
    for verb in ("get", "list", "watch", "patch"):
        assert allowed("pagedserve.io", "modeldeployments", verb)
    assert allowed("pagedserve.io", "modeldeployments/status", "patch")
    assert allowed("pagedserve.io", "modeldeployments/finalizers", "update")  # blockOwnerDeletion
    assert allowed("", "events", "create")
    assert allowed("apiextensions.k8s.io", "customresourcedefinitions", "watch")
    assert allowed("", "namespaces", "watch")
    assert api_prefix("v1") == "/api/v1"


def test_the_router_role_grants_nothing_the_operator_lacks() -> None:
    """RBAC escalation prevention: the operator can only create Roles within its own permissions."""
    md = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": {"model": "x"}}
    (role,) = [c for c in render(md) if c["kind"] == "Role"]
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert allowed(group, resource, verb), (group, resource, verb)
