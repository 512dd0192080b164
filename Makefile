# Set-up and entry points. `make demo` and `make test` each do the whole set-up first.
# torch is pinned first: an unpinned torch would pull the CUDA build (gigabytes); with
# torch==2.13.0 already installed, the project's `torch>=2.6` installs nothing more.
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: install demo test test-all

install:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m pip install -q -e ".[plot]"
	$(PYTHON) -m specheads demo

test: install
	$(PYTHON) -m pytest -q

test-all: install
	$(PYTHON) -m pytest -q -m ""
