"""pagedserve.operator: the kopf operator for ModelDeployments (no torch here: it ships in the slim image).

``render(modeldeployment) -> list[dict]`` is pure and importable without kopf; the kopf handlers live
in ``pagedserve.operator.handlers`` and ``pagedserve operator`` (``pagedserve.operator.main``) runs them.
"""

from pagedserve.operator.resources import render

__all__ = ["render"]
