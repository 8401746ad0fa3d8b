# Two commands matter: `make demo` and `make test`. Everything else is a helper for those.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WL_CACHE ?= $(HOME)/.cache/weightlift
# vLLM's CPU build lives in its own environment (it pins torch==X+cpu, not on PyPI, and versions of
# its own); its torch is constraints.txt's, as ours. See hack/install-vllm.sh. Built once into the
# cache (rebuilt when the torch pin moves), re-pointed at this checkout on each run.
VLLM_VERSION ?= 0.32.0
VLLM_ENV := $(WL_CACHE)/vllm-$(VLLM_VERSION)
# Triton Inference Server (runtime.engine Triton): tritonserver and its Python backend stubs from
# nvidia-pytriton, unpacked beside the vLLM environment (no Python packages of its own; the stub
# imports vLLM from VLLM_ENV); see hack/install-triton.sh.
TRITON_VERSION ?= 2.51
TRITON_ENV := $(WL_CACHE)/triton-$(TRITON_VERSION)
# cluster.py (tests, demo) finds the control plane and kubectl/helm here.
export WL_CACHE
# Our Go builds (control plane, LWS, MinIO, Prometheus, registry, node) share a build and module
# cache of their own: later builds reuse what earlier ones compiled, the user's own Go caches are
# left alone, and `go-scratch-clean` drops its ~12 GB once every binary is cached (the peak disk
# of a cold `make test`). A version bump then rebuilds from the module proxy, as on a fresh machine.
GO_SCRATCH := $(WL_CACHE)/go-scratch
export GOCACHE := $(GO_SCRATCH)/build
export GOMODCACHE := $(GO_SCRATCH)/mod

.PHONY: venv tools controlplane lws node node-images minio prometheus vllm-env triton-env images registry go-scratch-clean test test-images unit lint crd demo clean

# constraints.txt: the one torch pin the vLLM environment and the images read too.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so later packages that require torch (nixl) do not pull a second build.
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[worker,p2p,bench,dev,local]"
	touch $(STAMP)

venv: $(STAMP)

tools: venv
	$(PY) hack/install_tools.py --cache $(WL_CACHE)

controlplane: tools
	hack/build-controlplane.sh $(WL_CACHE)

# The LeaderWorkerSet controller (sigs.k8s.io/lws, pinned) and its CRDs and webhook manifests,
# from Go modules: what multi-pod replicas run on (local/lws.py). Cached under $(WL_CACHE).
lws:
	hack/build-lws.sh $(WL_CACHE)

# A real node (local/kubeletnode/): kubelet, kube-proxy, crictl and our GPU device plugin from Go
# modules, the pause image (gcc -static, buildah), containerd/runc/CNI plugins/iptables from apt
# when missing, and the registry its images are pulled from. Cached under $(WL_CACHE).
node: controlplane registry
	hack/build-node.sh $(WL_CACHE)

# The S3-compatible store of the storage tests and `demo --storage s3` (local/s3server.py).
minio:
	hack/build-minio.sh $(WL_CACHE)

# The Prometheus that scrapes the local stack through Kubernetes service discovery
# (local/prometheus.py: tests/e2e/test_prometheus.py, `weightlift demo --prometheus`).
prometheus:
	hack/build-prometheus.sh $(WL_CACHE)

vllm-env:
	VLLM_VERSION=$(VLLM_VERSION) hack/install-vllm.sh $(VLLM_ENV)

triton-env: vllm-env
	ENGINE_PYTHON=$(VLLM_ENV)/bin/python hack/install-triton.sh $(TRITON_ENV)

# The Dockerfile's operator, worker, worker-vllm and worker-triton images, built with buildah (no
# daemon). BASE empty: a local Debian base made by debootstrap (no registry needed);
# BASE=python:3.11-slim pulls the usual one. See README "Images" (pushing, vLLM on GPUs) and
# hack/build-images.sh.
images:
	hack/build-images.sh

# A registry on loopback (CNCF Distribution, from Go modules) that `make test-images` pushes to.
registry:
	hack/build-registry.sh $(WL_CACHE)

crd: venv
	$(VENV)/bin/weightlift crd > crds/modeldeployment.yaml
	cp crds/modeldeployment.yaml helm/weightlift/files/crds/modeldeployment.yaml

lint: venv
	$(VENV)/bin/ruff check weightlift tests
	$(VENV)/bin/mypy -p weightlift
	$(VENV)/bin/lint-imports

unit: venv
	$(PY) -m pytest tests/unit -q

# The images the real node's e2e tests run (tests/e2e/test_kubelet_*.py; worker-vllm stands on
# the worker's torch and dependency layers, worker-triton on worker-vllm's, triton-plain on
# vllm-plain's and worker-triton's Triton tree): buildah's layer cache
# keeps an unchanged rebuild at seconds.
node-images:
	hack/build-images.sh operator worker worker-vllm worker-triton worker-bundle vllm-plain triton-plain

# Only once every Go-built binary is cached (each build script's `.complete` stamp).
go-scratch-clean:
	# go clean: the module cache's files are read-only
	if [ -d "$(GO_SCRATCH)" ]; then go clean -modcache && rm -rf "$(GO_SCRATCH)"; fi

test: controlplane lws minio prometheus vllm-env triton-env node go-scratch-clean node-images
	# integration, vLLM, Triton and real-node tests fail (not skip) when a piece is missing
	WEIGHTLIFT_REQUIRE_CLUSTER=1 WEIGHTLIFT_REQUIRE_VLLM=1 WEIGHTLIFT_REQUIRE_TRITON=1 \
	WEIGHTLIFT_REQUIRE_NODE=1 WEIGHTLIFT_REQUIRE_NIXL=1 \
	WEIGHTLIFT_TRITON_HOME=$(TRITON_ENV) \
	WEIGHTLIFT_VLLM_PYTHON=$(VLLM_ENV)/bin/python $(PY) -m pytest -q -rs --durations=25 --hypothesis-profile=ci

# Builds the images (a layer cache makes an unchanged rebuild quick) and checks what they hold
# and run; kept out of `make test` (torch and vLLM: minutes and GBs, see README).
test-images: venv registry
	WEIGHTLIFT_IMAGES=1 $(PY) -m pytest tests/images -q

# The operator as the chart's pod (`helm install`) where the process node may give it its
# ServiceAccount's mounts (root); as a local process elsewhere. Same time to Ready either way.
DEMO_INSTALL ?= $(if $(filter 0,$(shell id -u)),helm,process)

demo: controlplane
	$(VENV)/bin/weightlift demo --install $(DEMO_INSTALL)

clean:
	rm -rf $(VENV) .state
