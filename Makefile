# Set-up and entry points. `make demo` and `make test` each do the whole set-up first, inside a
# virtual environment: the active one, else .venv, made here (Debian's and Ubuntu's system Python
# refuse `pip install` outside one: PEP 668).
# torch is installed first, pinned. PyPI's torch wheel for Linux is the CUDA build (gigabytes with
# its nvidia-* wheels); on a Linux machine without a GPU pass TORCH_INDEX=https://download.pytorch.org/whl/cpu
# for the CPU build (macOS and Windows wheels on PyPI are CPU builds already). With torch installed,
# the project's `torch>=2.6` installs nothing more.
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PYTHON ?= $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install demo test test-all

$(VENV)/bin/python:
	python3 -m venv $(VENV)

install: $(VENV)/bin/python
	$(PYTHON) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m pip install -q -e ".[plot]"
	$(PYTHON) -m specheads demo

test: install
	$(PYTHON) -m pytest -q

test-all: install
	$(PYTHON) -m pytest -q -m ""
