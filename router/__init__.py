"""pagedserve.router: a KV-cache-aware HTTP router in front of engine replicas (no torch imports).

Modules: ``hashing`` (prompt -> chained block hashes), ``balancer`` (pure routing decisions: strategies,
CHWBL ring, LRU index, load), ``discovery`` (static list, Kubernetes EndpointSlices, health checks and
load scraping), ``proxy`` (the ASGI app), ``activator`` (requests held while no replica is ready; scale
from zero through ``scaler``), ``metrics`` (``pagedserve_router_*``), ``cli`` (``pagedserve router``).
"""
