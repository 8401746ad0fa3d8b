# Two commands matter: `make demo` and `make test`. Everything else is a helper for those.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WL_CACHE ?= $(HOME)/.cache/weightlift
# cluster.py (tests, demo) finds the control plane and kubectl/helm here.
export WL_CACHE

.PHONY: venv tools controlplane minio test unit lint crd demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so later packages that require torch (nixl) do not pull a second build.
	$(PY) -m pip install -q "torch>=2.5"
	$(PY) -m pip install -q -e ".[worker,p2p,bench,dev,local]"
	touch $(STAMP)

venv: $(STAMP)

tools: venv
	$(PY) hack/install_tools.py --cache $(WL_CACHE)

controlplane: tools
	hack/build-controlplane.sh $(WL_CACHE)

# The S3-compatible store of the storage tests and `demo --storage s3` (local/s3server.py).
minio:
	hack/build-minio.sh $(WL_CACHE)

crd: venv
	$(VENV)/bin/weightlift crd > crds/modeldeployment.yaml
	cp crds/modeldeployment.yaml helm/weightlift/crds/modeldeployment.yaml

lint: venv
	$(VENV)/bin/ruff check api operator worker local bench tests setup.py
	hack/typecheck
	$(VENV)/bin/lint-imports

unit: venv
	$(PY) -m pytest tests/unit -q

test: controlplane minio
	# integration tests fail (not skip) when the control plane is missing
	WEIGHTLIFT_REQUIRE_CLUSTER=1 $(PY) -m pytest -q

demo: controlplane
	$(VENV)/bin/weightlift demo

clean:
	rm -rf $(VENV) .state
