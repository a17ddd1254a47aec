"""`pagedserve operator`: run the ModelDeployment operator (all namespaces, or those given)."""

from __future__ import annotations

import argparse
import os

from pagedserve.operator.resources import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, DEFAULT_ROUTER_IMAGE, ENGINE_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; globs like ml-* work); default: all namespaces",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(os.environ.get("PAGEDSERVE_OPERATOR_RESYNC_SECONDS", 60)),
        help="re-reconcile every ModelDeployment this often: drift repair and status (default 60)",
    )
    parser.add_argument(
        "--default-image",
        default=os.environ.get("PAGEDSERVE_DEFAULT_IMAGE", DEFAULT_IMAGE),
        help=f"engine image when spec.image is unset and the engine has GPUs (default {DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--default-cpu-image",
        default=os.environ.get("PAGEDSERVE_DEFAULT_CPU_IMAGE", DEFAULT_CPU_IMAGE),
        help=f"engine image when spec.image is unset and resources.gpus is 0 (default {DEFAULT_CPU_IMAGE})",
    )
    parser.add_argument(
        "--default-router-image",
        default=os.environ.get("PAGEDSERVE_DEFAULT_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
        help=f"router image when spec.router.image is unset (default {DEFAULT_ROUTER_IMAGE})",
    )
    parser.add_argument(
        "--allow-secret-env",
        action="store_true",
        default=os.environ.get("PAGEDSERVE_OPERATOR_ALLOW_SECRET_ENV", "").lower() in ("1", "true"),
        help="accept spec.env entries with valueFrom.secretKeyRef (default: refuse them; operator/policy.py)",
    )
    parser.add_argument(
        "--allowed-image-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="spec.image and spec.router.image must start with one of these (repeatable; default: any image)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=os.environ.get("PAGEDSERVE_OPERATOR_LIVENESS"),
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz (default: none)",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="coordinate several operator replicas through this kopf peering object (default: standalone)",
    )
    parser.add_argument(
        "--engine-port",
        type=int,
        default=int(os.environ.get("PAGEDSERVE_OPERATOR_ENGINE_PORT", ENGINE_PORT)),
        help=f"the engine pods' port, for loading and unloading LoRA adapters (default {ENGINE_PORT})",
    )
    parser.add_argument("--verbose", action="store_true", help="log more")
    parser.add_argument("--debug", action="store_true", help="log everything, kopf's internals too")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf
    from pagedserve.operator import handlers
    from pagedserve.operator.policy import Policy
    from pagedserve.operator.reconcile import Options

    kopf.configure(verbose=args.verbose, debug=args.debug)
    if not args.debug:  # one line per API call is kopf's --debug level, not --verbose
        logging.getLogger("httpx").setLevel(logging.WARNING)
    handlers.configure(
        options=Options(
            default_image=args.default_image,
            default_cpu_image=args.default_cpu_image,
            default_router_image=args.default_router_image,
            policy=Policy(
                allow_secret_env=args.allow_secret_env,
                allowed_image_prefixes=tuple(args.allowed_image_prefix),
            ),
            engine_port=args.engine_port,
        ),
        resync_seconds=args.resync_seconds,
    )
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.peering is None,
            peering_name=args.peering,
            liveness_endpoint=args.liveness,
        )
    )
    return 0
