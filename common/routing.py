"""The router's strategies, named once: `pagedserve router --strategy` (router/cli.py, router/balancer.py)
and a ModelDeployment's spec.router.strategy (operator/spec.py, and so the CRD) take the same values."""

# prefix-hash: the router's own record of which replica was sent which prefix; kv-events: what each
# engine reports holding (router/kv_events.py); least-load and round-robin: no prefix affinity.
STRATEGIES = ("prefix-hash", "least-load", "round-robin", "kv-events")
DEFAULT_STRATEGY = "prefix-hash"
