"""`pagedserve router`: the KV-cache-aware router in front of engine replicas.

Examples::

    pagedserve router --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 \\
        --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct --model-name smollm2
    pagedserve router --k8s-service llama-8b-engine --namespace ml --target-port 8000 \\
        --tokenizer /models/llama-8b --model-name llama-8b
    pagedserve router --strategy pd --prefill-backends http://10.0.0.3:8000,http://10.0.0.4:8000 \\
        --backend http://10.0.0.1:8000 --tokenizer /models/llama-8b --model-name llama-8b

Top-level imports stay light (no torch, ever: the router ships in the slim image).
"""

from __future__ import annotations

import argparse
import logging
import os

from pagedserve.common.engine_args import BLOCK_SIZES, EngineArgs
from pagedserve.common.routing import DEFAULT_STRATEGY, STRATEGIES
from pagedserve.router.hashing import DEFAULT_SEGMENT_CACHE_BYTES
from pagedserve.router.pd import PD

_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _default_namespace() -> str:
    try:
        with open(_SA_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_ROUTER_API_KEY"),
        help="if set, the router itself also requires 'Authorization: Bearer KEY' on /v1/* (env "
        "PAGEDSERVE_ROUTER_API_KEY). The Authorization header is always passed on to the replicas.",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")

    g = parser.add_argument_group("discovery")
    g.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="an engine replica (http://host:port); repeat for several. Exclusive with --k8s-service.",
    )
    g.add_argument("--k8s-service", default=None, help="watch the EndpointSlices of this Service")
    g.add_argument(
        "--namespace",
        default=None,
        help="namespace of --k8s-service (default: the pod's own namespace, else 'default')",
    )
    g.add_argument("--target-port", type=int, default=8000, help="the engines' port behind the Service")
    g.add_argument(
        "--prefill-backend",
        "--prefill-backends",
        action="append",
        default=[],
        metavar="URL[,URL...]",
        help="--strategy pd: a prefill engine (or several, comma-separated); repeat for more. --backend / "
        "--k8s-service are then the decode engines. Exclusive with --prefill-k8s-service.",
    )
    g.add_argument(
        "--prefill-k8s-service",
        default=None,
        help="--strategy pd: watch the EndpointSlices of this Service (in --namespace) for the prefill "
        "engines",
    )
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks/scrapes")
    g.add_argument("--health-timeout", type=float, default=5.0, help="timeout of one health check")
    g.add_argument(
        "--unhealthy-after",
        type=int,
        default=3,
        help="failed (timed-out) health checks in a row before a replica leaves the ring; a refused "
        "connection removes it at once",
    )

    g = parser.add_argument_group("routing")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or hub id whose tokenizer and chat template render and tokenize prompts "
        "(without it, prompt bytes stand in for tokens)",
    )
    g.add_argument(
        "--model-name", default=None, help="seeds the block hash chain (default: --tokenizer, else '')"
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates sent with requests for their prefix hash (bounded, sandboxed); "
        "without it their raw messages are hashed and the engines decide (vLLM's flag of that name)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=EngineArgs.block_size,
        choices=BLOCK_SIZES,
        help="the engines' KV block size in tokens (their --block-size)",
    )
    g.add_argument(
        "--tokenizer-cache-mib",
        type=int,
        default=DEFAULT_SEGMENT_CACHE_BYTES >> 20,
        help="memory for the token ids of prompt segments already tokenized (system prompts, ...), in MiB",
    )
    g.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGY,
        choices=(*STRATEGIES, PD),
        help="prefix-hash: the router's guess of each replica's prefix cache; kv-events: what each engine "
        "reports holding (engines started with --enable-kv-events; needs --tokenizer; replicas without a "
        "live event stream fall back to prefix-hash; their API key is read from PAGEDSERVE_API_KEY); pd: "
        "prefill/decode disaggregation, each prompt prefilled on a --prefill-backend (by prefix hash) and "
        "decoded on a --backend (by load), its KV handed over with kv_transfer_params",
    )
    g.add_argument(
        "--mean-load-factor",
        type=float,
        default=1.25,
        help="a replica whose load exceeds this x the mean load is passed over (bounded loads)",
    )
    g.add_argument(
        "--min-load-cap",
        type=float,
        default=4.0,
        help="a replica is never passed over below this load (in-flight requests), however low the mean: "
        "keeps prefixes on their replicas when there are hundreds of them",
    )
    g.add_argument("--index-capacity", type=int, default=100_000, help="block hashes remembered per replica")
    g.add_argument("--virtual-nodes", type=int, default=160, help="points per replica on the hash ring")
    g.add_argument(
        "--hash-key-blocks",
        type=int,
        default=4,
        help="blocks that make a prefix's identity: the hash ring is keyed by the chained hash of the "
        "first N blocks, and a cached match must cover them to win (1 = the first block only; raise it when "
        "the chat template opens every prompt with the same long header)",
    )
    g.add_argument(
        "--max-retries", type=int, default=3, help="other replicas tried when one refuses, drops or 503s"
    )
    g.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="--strategy pd: seconds the prefill step waits for its engine's answer (the prefill engine "
        "sends nothing before its one token); a slower step runs colocated on a decode engine instead",
    )

    g = parser.add_argument_group("upstream connections")
    g.add_argument("--connect-timeout", type=float, default=5.0)
    g.add_argument(
        "--read-timeout", type=float, default=None, help="seconds without upstream bytes (default: none)"
    )
    g.add_argument(
        "--max-keepalive-connections", type=int, default=200, help="idle connections kept per replica"
    )
    add_scale_from_zero_arguments(parser)


def add_scale_from_zero_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scale from zero (router/activator.py)")
    g.add_argument(
        "--max-held-requests",
        type=int,
        default=0,
        help="requests held while no replica is ready, released to the first that becomes ready; more "
        "get 503 with Retry-After (default 0: 503 at once)",
    )
    g.add_argument(
        "--held-request-timeout",
        type=float,
        default=300.0,
        help="seconds a held request waits for a ready replica before it gets 503 with Retry-After",
    )
    g.add_argument(
        "--scale-from-zero",
        default=None,
        metavar="MODELDEPLOYMENT",
        help="wake this ModelDeployment (in --namespace) from 0 replicas through its scale subresource when "
        "a request is held, and record the last request in its annotation for the operator's scale-down",
    )
    g.add_argument(
        "--activity-interval",
        type=float,
        default=10.0,
        help="with --scale-from-zero: seconds between the last-request annotation's updates",
    )


def config_from_args(args: argparse.Namespace):
    from pagedserve.router.proxy import RouterConfig

    return RouterConfig(
        backends=list(args.backend or []),
        k8s_service=args.k8s_service,
        namespace=args.namespace or _default_namespace(),
        target_port=args.target_port,
        tokenizer=args.tokenizer,
        model_name=args.model_name if args.model_name is not None else (args.tokenizer or ""),
        trust_request_chat_template=args.trust_request_chat_template,
        block_size=args.block_size,
        segment_cache_bytes=args.tokenizer_cache_mib << 20,
        strategy=args.strategy,
        mean_load_factor=args.mean_load_factor,
        min_load_cap=args.min_load_cap,
        index_capacity=args.index_capacity,
        virtual_nodes=args.virtual_nodes,
        hash_key_blocks=args.hash_key_blocks,
        max_retries=args.max_retries,
        api_key=args.api_key,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        unhealthy_after=args.unhealthy_after,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        max_keepalive_connections=args.max_keepalive_connections,
        **scale_from_zero_config(args),
        engine_api_key=os.environ.get("PAGEDSERVE_API_KEY") or None,
        prefill_backends=[url for value in args.prefill_backend for url in value.split(",") if url.strip()],
        prefill_k8s_service=args.prefill_k8s_service,
        prefill_timeout=args.prefill_timeout,
    )


def scale_from_zero_config(args: argparse.Namespace) -> dict:
    return {
        "max_held_requests": args.max_held_requests,
        "held_request_timeout": args.held_request_timeout,
        "scale_from_zero": args.scale_from_zero,
        "activity_interval": args.activity_interval,
    }


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pagedserve.router.proxy import RouterApp

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        logging.getLogger("pagedserve.router").error("%s", exc)
        return 2
    app = RouterApp(config)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        server_header=False,  # the replicas' Server and Date headers pass through
        date_header=False,
        lifespan="on",
        timeout_keep_alive=30,
        proxy_headers=False,  # X-Forwarded-For is extended by the proxy itself
    )
    return 0
