"""What a ModelDeployment may ask for beyond its typed fields: the operator's policy, set by the admin.

Whoever may create a ModelDeployment makes pods in its namespace through the operator, with the
operator's rights. Two spec fields would reach further than their author may:

- ``spec.env`` with ``valueFrom.secretKeyRef`` puts any Secret of the namespace into the engine's
  environment, readable through the engine image. Secrets reach the pods only through the named fields
  (``hfTokenSecret``, ``apiKeySecret``; ``imagePullSecrets`` go to the kubelet, not the pod), unless the
  admin allows it (``--allow-secret-env``; chart value ``operator.policy.allowSecretEnv``).
- ``spec.image`` and ``spec.router.image`` run any code in the namespace. With ``--allowed-image-prefix``
  (chart: ``operator.policy.allowedImagePrefixes``) they must start with one of the prefixes; without,
  any image is allowed: the operator cannot know the registries users build into, and the pods run as
  non-root under PodSecurity "restricted", the engine pods with no API token.

A CEL rule in the CRD cannot see the chart's values, so the operator checks the spec here
(operator/reconcile.py calls ``refusals`` before rendering) and refuses the whole ModelDeployment: no
object is made or changed, the status says why (Reconciled=False) and a Warning Event (reason Refused).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.operator.spec import ModelDeploymentSpec


@dataclass(frozen=True)
class Policy:
    allow_secret_env: bool = False
    # Empty: any image.
    allowed_image_prefixes: tuple[str, ...] = ()


def refusals(spec: ModelDeploymentSpec, policy: Policy) -> list[str]:
    """One message per field the policy refuses, naming it as spec.a.b; [] when the spec may run."""
    problems = []
    if not policy.allow_secret_env:
        for i, var in enumerate(spec.env):
            if "secretKeyRef" in (var.value_from or {}):
                problems.append(
                    f"spec.env[{i}] ({var.name}): valueFrom.secretKeyRef is not allowed; reference Secrets"
                    " through spec.hfTokenSecret or spec.apiKeySecret, or ask the operator's admin to allow"
                    " it (chart value operator.policy.allowSecretEnv)"
                )
    if policy.allowed_image_prefixes:
        allowed = ", ".join(policy.allowed_image_prefixes)
        for field, image in (("spec.image", spec.image), ("spec.router.image", spec.router.image)):
            if image is not None and not image.startswith(policy.allowed_image_prefixes):
                problems.append(f"{field}: {image!r} is not from an allowed image prefix ({allowed})")
    return problems
