"""The Dockerfile, read statically: targets, extras, layer order, user (e2e/test_images.py runs them)."""

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


def test_upstream_bases_are_pinned_by_digest() -> None:
    """A tag moves under a rebuild; the defaults users build on must not."""
    for arg in ("CUDA_IMAGE", "DEBIAN_IMAGE"):
        assert re.search(rf"^ARG {arg}=\S+:\S+@sha256:[0-9a-f]{{64}}$", DOCKERFILE, re.MULTILINE), arg


def test_extras_are_the_projects() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    s = stages()
    # The engine image carries prefill/decode disaggregation's transfer engine too (the [pd] extra).
    assert "requirements.py pyproject.toml server pd > /requirements/server.txt" in s["wheel"]
    assert "requirements.py pyproject.toml router operator > /requirements/control.txt" in s["wheel"]
    assert "COPY --from=wheel /requirements/server.txt /build/requirements.txt" in s["server"]
    assert "COPY --from=wheel /requirements/control.txt /build/requirements.txt" in s["control"]
    assert {"torch", "triton"} <= {re.split(r"[<>=;\[ ]", d)[0] for d in extras["server"]}
    assert not any(d.startswith("torch") for d in extras["router"] + extras["operator"])
    assert {re.split(r"[<>=;\[ ]", d)[0] for d in extras["pd"]} == {"mooncake-transfer-engine-non-cuda"}
    assert "libibverbs1 librdmacm1" in s["server"]  # the libraries its transfer engine links
    assert "torch must not be in the control image" in s["control"]


def test_requirements_are_the_extras() -> None:
    """scripts/requirements.py, which the dependency layers install from, lists the core and the extras."""
    import subprocess
    import sys

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    script = [sys.executable, str(REPO / "scripts/requirements.py"), str(REPO / "pyproject.toml")]
    listed = subprocess.run([*script, "router", "operator"], capture_output=True, text=True, check=True)
    extras = project["optional-dependencies"]
    assert listed.stdout.splitlines() == project["dependencies"] + extras["router"] + extras["operator"]
    assert subprocess.run([*script, "nosuch"], capture_output=True).returncode != 0


def test_code_changes_do_not_reinstall_dependencies() -> None:
    """The requirements are listed from pyproject.toml before any code is copied, and installed before
    the project's wheel (--no-deps): a code change rebuilds only that last layer."""
    wheel = stages()["wheel"]
    assert wheel.index("> /requirements/server.txt") < wheel.index("COPY pagedserve/")
    for name in ("server", "control"):
        body = stages()[name]
        deps, code = body.index("-r /build/requirements.txt"), body.index("COPY --from=wheel /wheels/")
        assert body.index(f"COPY --from=wheel /requirements/{name}.txt") < deps < code, name
        assert "pip install --no-cache-dir --no-deps /wheels/pagedserve-" in body[code:], name
        assert re.findall(r"^COPY (\S+)", body, re.MULTILINE) == ["--from=wheel", "--from=wheel"], name


def test_server_carries_the_built_kernels_and_the_converted_model() -> None:
    """The image builds what a start would (kernels/cpu_build.py, server/loader/default_model.py), after
    the wheel is installed and with g++ there; e2e/test_images.py checks a real image's start uses them."""
    body = stages()["server"]
    assert re.search(r"apt-get install[^\n]* g\+\+ ", body)
    wheel = body.index("pip install --no-cache-dir --no-deps /wheels/pagedserve-")
    assert wheel < body.index("python -m pagedserve.kernels.cpu_build")
    assert wheel < body.index("python -m pagedserve.server.loader.default_model")
    assert body.index("python -m pagedserve.kernels.cpu_build") < body.index("USER 10001")


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


def test_wheel_carries_the_cpu_kernel_sources() -> None:
    """The images install the wheel, not the source tree: kernels/cpu.py compiles every file of
    kernels/csrc (headers included) at startup, so package-data must take them all."""
    from fnmatch import fnmatch

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels/csrc").iterdir()]
    assert sources and all(any(fnmatch(s, g) for g in globs["pagedserve.kernels"]) for s in sources), sources
