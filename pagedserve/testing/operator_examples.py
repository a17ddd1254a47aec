"""ModelDeployments shared by the operator tests (imported as a sibling module, as pytest puts this
folder on sys.path)."""

from __future__ import annotations

import copy
from typing import Any

# Every field of the spec set: the example in the chart README and the one the operator was built from.
_DESIGN_EXAMPLE: dict[str, Any] = {
    "apiVersion": "pagedserve.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "llama-8b", "namespace": "ml"},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "servedModelName": "llama-8b",
        "replicas": 2,
        "image": "registry.example/pagedserve:0.1.0",
        "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/gpu", "cpu": "8", "memory": "32Gi"},
        "engine": {
            "maxModelLen": 8192,
            "blockSize": 16,
            "gpuMemoryUtilization": 0.9,
            "maxNumSeqs": 256,
            "dtype": "bfloat16",
            "extraArgs": [],
        },
        "router": {"replicas": 2, "strategy": "prefix-hash", "meanLoadFactor": 1.25},
        "modelCache": {"storageClassName": "standard", "size": "50Gi"},
        "hfTokenSecret": {"name": "hf-token", "key": "token"},
        "apiKeySecret": {"name": "llm-api-key", "key": "key"},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "targetWaitingRequests": 5},
        "nodeSelector": {},
        "tolerations": [],
        "podAnnotations": {},
        "env": [],
    },
}


def design_example(**metadata: Any) -> dict[str, Any]:
    """A fresh copy of the design example, with ``metadata`` merged in (uid, generation...)."""
    obj = copy.deepcopy(_DESIGN_EXAMPLE)
    obj["metadata"].update(metadata)
    return obj


# LoRA adapters of every url kind, and the LoRA engine fields (spec fields, for each test's md()).
LORA_SPEC: dict[str, Any] = {
    "engine": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8},
    "adapters": [
        {"name": "sql", "url": "hf://acme/llama-sql-lora"},
        {"name": "legal", "url": "pvc://lora-claim/legal/v2"},
        {"name": "support", "url": "/opt/adapters/support"},
    ],
}
