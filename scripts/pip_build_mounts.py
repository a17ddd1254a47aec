"""Prints `podman build` flags that hand this machine's pip configuration to the build, and nothing more.

Where PyPI is reachable only through the machine's pip settings (a CA certificate, local wheel folders,
file:// indexes, from pip.conf files or PIP_* variables), a build needs them too, yet they must not end
up in an image layer. `pip config list` gives the effective settings; they are written to one pip.conf
(in the folder given), and it and every local path it names are bind-mounted read-only for the build's
RUN steps (podman build -v; the paths under /run/pip-host): there while pip runs, absent from the layers.

    python3 scripts/pip_build_mounts.py DIR
    -> -v /opt/wheels:/run/pip-host/opt/wheels:ro ... -v DIR/pip.conf:/etc/pip.conf:ro
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

HOST_MOUNT = Path("/run/pip-host")


def effective_config() -> dict[str, str]:
    """`pip config list` as {key: value}; a PIP_* variable overrides a file (pip's own precedence)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    config: dict[str, str] = {}
    for line in listed.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if match:
            scope, key, value = match.groups()
            if scope == ":env:" or key not in config:
                config[key] = value
    return config


def local_path(token: str) -> Path | None:
    """The existing local file or folder one token of a setting names (a plain path or a file:// URL).
    A file:// index named `simple` links its files relatively (../../files/...): its parent goes in whole."""
    path = Path(token.removeprefix("file://").rstrip("/") or "/")
    if token.startswith("file://") and path.name == "simple":
        path = path.parent
    return path if path.is_absolute() and path.exists() else None


def main(workdir: str) -> None:
    config = effective_config()
    mounts: dict[Path, Path] = {}
    for key, value in config.items():
        tokens = value.split()
        for i, token in enumerate(tokens):
            if path := local_path(token):
                # Under /run/pip-host, not at the same place: a bind mount onto e.g. the CA bundle would
                # make the build's own `apt-get install ca-certificates` fail to write it.
                mounts[path] = HOST_MOUNT / path.relative_to("/")
                tokens[i] = token.replace(str(path), str(mounts[path]), 1)
        config[key] = " ".join(tokens)
    conf = Path(workdir) / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{key} = {value}\n" for key, value in config.items()))
    mounts[conf] = Path("/etc/pip.conf")
    print(" ".join(f"-v {shlex.quote(f'{src}:{dst}:ro')}" for src, dst in mounts.items()))


if __name__ == "__main__":
    main(sys.argv[1])
