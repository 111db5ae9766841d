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

# The CUDA build of torch takes about 5.6 GB in the venv: refuse in one line before pip fills the disk half-way.
TORCH_DISK_GB ?= 6

$(VENV)/.torch: | $(BIN)/python
	@free_kb=$$(df -Pk $(VENV) | awk 'NR==2 {print $$4}'); \
	if [ "$$free_kb" -lt $$(( $(TORCH_DISK_GB) * 1024 * 1024 )) ]; then \
	  echo "make: only $$(( free_kb / 1024 / 1024 )) GB free on the disk of $(VENV); torch needs about $(TORCH_DISK_GB) GB: free some space (or point VENV= at a larger disk) and run make again" >&2; \
	  exit 1; \
	fi
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
