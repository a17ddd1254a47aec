"""Prints the requirements of pyproject.toml's core and the named extras, one a line, for `pip install -r`.

The Dockerfile installs them in a layer of their own before the project's code is copied in, so that a
code change rebuilds only the small layer that installs the wheel (with --no-deps). Standard library only:
it runs on the image's bare Python.

    python3 scripts/requirements.py pyproject.toml server
"""

from __future__ import annotations

import sys

import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"no such extra in {pyproject}: {', '.join(unknown)}")
    return [*project["dependencies"], *(req for extra in extras for req in optional[extra])]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
