"""The Dockerfile, read statically (no Docker engine here): its two targets, their extras, the user."""

from __future__ import annotations

import re

import tomllib

from pagedserve.testing.helm import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def stages() -> dict[str, str]:
    """Stage name -> its instructions (line continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE | re.IGNORECASE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_targets_server_and_control() -> None:
    assert {"server", "control"} <= set(stages())
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", DOCKERFILE, re.MULTILINE)
    assert "FROM ${CUDA_IMAGE} AS server" in DOCKERFILE


def test_extras_are_the_projects() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    s = stages()
    assert "[server]" in s["server"] and {"torch", "triton"} <= {
        re.split(r"[<>=;\[ ]", d)[0] for d in extras["server"]
    }
    assert "[router,operator]" in s["control"]
    assert not any(d.startswith("torch") for d in extras["router"] + extras["operator"])
    assert "torch must not be in the control image" in s["control"]


def test_non_root_and_read_only_root_filesystem() -> None:
    for name in ("server", "control"):
        body = stages()[name]
        users = re.findall(r"^USER\s+(\S+)", body, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("0", "root"), name
        env = dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.+)$", body, re.MULTILINE))))
        # Everything the processes write goes to /tmp or /cache, the writable mounts.
        for key in ("HOME", "HF_HOME", "XDG_CACHE_HOME"):
            assert env[key].startswith(("/tmp", "/cache")), (name, key)
        assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    server_env = " ".join(re.findall(r"^ENV (.+)$", stages()["server"], re.MULTILINE))
    assert "TRITON_CACHE_DIR=/tmp" in server_env


def test_dockerignore_keeps_local_state_out() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert lines[lines.index("*")] == "*"  # allow-list: only what builds the wheel
    copied = set(re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.MULTILINE))
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for sources in copied:
        for src in sources.split():
            assert src.rstrip("/") in allowed, f"{src} is copied but .dockerignore leaves it out"


def test_pods_run_as_the_images_user() -> None:
    """The operator's pods and the chart's operator pod name the uid/gid the images create."""
    import yaml
    from pagedserve.operator.resources import RUN_AS_USER

    from pagedserve.testing.helm import CHART

    for name in ("server", "control"):
        body = stages()[name]
        assert f"useradd --uid {RUN_AS_USER} --gid {RUN_AS_USER}" in body, name
        assert re.findall(r"^USER\s+(\S+)", body, re.MULTILINE)[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}"
    pod = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["podSecurityContext"]
    assert pod["runAsUser"] == pod["runAsGroup"] == pod["fsGroup"] == RUN_AS_USER
