"""What routing shares across the engine server, the router and the operator: the router's strategies,
named once (`pagedserve router --strategy`, router/cli.py and router/balancer.py, and a ModelDeployment's
spec.router.strategy, operator/spec.py, and so the CRD), and the replica instance that names stored
responses."""

# prefix-hash: the router's own record of which replica was sent which prefix; kv-events: what each
# engine reports holding (router/kv_events.py); least-load and round-robin: no prefix affinity.
STRATEGIES = ("prefix-hash", "least-load", "round-robin", "kv-events")
DEFAULT_STRATEGY = "prefix-hash"

# A replica's instance (random per engine server process) names the responses it stores, so the router
# sends a Responses request that continues one (previous_response_id, GET /v1/responses/{id}) to the
# replica that holds it: the engine answers /health with its instance in this header
# (server/api/app.py), and writes it into every response id it makes (server/api/serving_responses.py).
INSTANCE_HEADER = "x-pagedserve-instance"

# vLLM's pooling routes outside /v1/ (an embedding model's engine serves them, server/api/app.py): the
# router proxies them as it does /v1/ routes, by load, without prefix affinity (router/proxy.py).
POOLING_PATHS = ("/pooling", "/score", "/rerank", "/v2/rerank")
INSTANCE_CHARS = 8  # hex digits
RESPONSE_PREFIX = "resp_"


def new_instance() -> str:
    import secrets

    return secrets.token_hex(INSTANCE_CHARS // 2)


def new_response_id(instance: str) -> str:
    import uuid

    return f"{RESPONSE_PREFIX}{instance}{uuid.uuid4().hex}"


def instance_of_response(response_id: str) -> str | None:
    """The instance that made ``response_id`` (one of ``new_response_id``'s), else None."""
    if not response_id.startswith(RESPONSE_PREFIX):
        return None
    instance = response_id[len(RESPONSE_PREFIX) : len(RESPONSE_PREFIX) + INSTANCE_CHARS]
    if len(instance) != INSTANCE_CHARS or any(c not in "0123456789abcdef" for c in instance):
        return None
    return instance
