"""The ModelDeployment resource's names: the operator serves it (operator/spec.py is its schema), the
router annotates it (router/scaler.py), the chart's RBAC and the CRD name it."""

GROUP = "pagedserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
# Written by each router with spec.scaleFromZero (router/scaler.py), read by the operator (operator/idle.py).
LAST_REQUEST_ANNOTATION = f"{GROUP}/last-request-time"
