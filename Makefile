# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and are no-ops for the install the second time.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned to the wheels this project is tested with (a CUDA build that also runs on CPU).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test install dev bench-2d clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

demo: $(VENV)/.installed
	$(BIN)/sinkflow train

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench-2d: $(VENV)/.installed
	$(BIN)/python benchmarks/nsgf_2d.py

clean:
	rm -rf $(VENV) runs .pytest_cache
