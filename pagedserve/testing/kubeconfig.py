"""A kubeconfig for a local Kubernetes API (kmock's emulator in the router and operator tests), and the
environment that makes a child process's kubernetes client use it instead of any real cluster."""

from __future__ import annotations

import os
from pathlib import Path


def kubeconfig_env(api_url: str, folder: Path) -> dict[str, str]:
    """This process's environment with ``KUBECONFIG`` at a new file in ``folder`` that points at
    ``api_url`` (token auth, no TLS), and no in-cluster ``KUBERNETES_*`` variables to prefer over it."""
    kubeconfig = folder / "kubeconfig.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: kmock, cluster: {{server: "{api_url}"}}}}]\n'
        "users: [{name: test, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: test}}]\n"
        "current-context: kmock\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    return env
