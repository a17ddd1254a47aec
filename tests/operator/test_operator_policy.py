"""operator/policy.py: what the operator refuses in a spec, whatever the CRD admits."""

from __future__ import annotations

from typing import Any

from pagedserve.operator.policy import Policy, refusals
from pagedserve.operator.spec import parse_spec

SECRET_ENV = {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}


def spec(**fields: Any) -> Any:
    return parse_spec({"model": "m", **fields})


def test_secret_env_is_refused_by_default() -> None:
    allowed_refs = [
        {"name": "A", "value": "1"},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ]
    assert refusals(spec(env=allowed_refs), Policy()) == []
    (problem,) = refusals(spec(env=[*allowed_refs, SECRET_ENV]), Policy())
    assert problem.startswith("spec.env[3] (DB): valueFrom.secretKeyRef is not allowed")
    # the named fields stay the way to hand Secrets to the pods
    assert refusals(spec(hfTokenSecret={"name": "hf"}, apiKeySecret={"name": "k"}), Policy()) == []


def test_the_admin_may_allow_secret_env() -> None:
    assert refusals(spec(env=[SECRET_ENV]), Policy(allow_secret_env=True)) == []


def test_images_from_allowed_prefixes_only() -> None:
    policy = Policy(allowed_image_prefixes=("registry.example/ml/", "ghcr.io/acme/"))
    assert refusals(spec(), policy) == []  # the operator's default images are the admin's own choice
    ok = spec(image="registry.example/ml/pagedserve:1", router={"image": "ghcr.io/acme/control:1"})
    assert refusals(ok, policy) == []
    bad = spec(image="docker.io/evil/miner:1", router={"image": "registry.example/other:1"})
    assert [p.split(":")[0] for p in refusals(bad, policy)] == ["spec.image", "spec.router.image"]
    assert refusals(bad, Policy()) == []  # no prefixes: any image
