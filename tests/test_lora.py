"""LoRA (PEFT) for every variant, and the 4-bit QLoRA path (CUDA only).

* Only adapter weights change; the base weights are bit-identical after training.
* With beta > 0 the reference is the same model with the adapter disabled (no second model):
  the KL is 0 before the first update and > 0 after it.
* The saved adapter reloads with ``peft.PeftModel.from_pretrained`` and gives the trained model's
  logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_variants import get_variant, list_variants
from grpo_variants.runtime.scale import (
    QLORA_SKIP_REASON,
    lora_config,
    qlora_model_init_kwargs,
    qlora_unavailable_reason,
    vllm_kwargs,
)

VARIANTS = [spec.name for spec in list_variants()]


def _variant_args(name, tmp_path, **overrides):
    from _zero3_worker import variant_args  # the per-variant toy sizing shared with the ZeRO-3 test

    return variant_args(name, str(tmp_path / f"out-{name}"), 1, **overrides)


def _split(model):
    adapter, base = {}, {}
    for name, param in model.named_parameters():
        (adapter if "lora_" in name else base)[name] = param.detach().clone()
    return adapter, base


def _train_lora(name, model_path, dataset, tmp_path, deterministic=False, **overrides):
    from peft import PeftModel

    spec = get_variant(name)
    args = _variant_args(name, tmp_path, learning_rate=1e-3, **overrides)
    trainer = spec.trainer_cls(model=model_path, reward_funcs="toy_accuracy", args=args, train_dataset=dataset,
                               peft_config=lora_config(r=4))
    if deterministic:  # fixed, mixed-correctness samples: every variant gets a learning signal on step 1
        from _zero3_worker import make_deterministic

        make_deterministic(trainer)
    assert isinstance(trainer.model, PeftModel)
    adapter_before, base_before = _split(trainer.model)
    assert adapter_before and all(n.endswith("lm_head.weight") is False for n in adapter_before)
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == set(adapter_before)
    trainer.train()
    adapter_after, base_after = _split(trainer.model)
    for key, value in base_before.items():
        assert torch.equal(value, base_after[key]), f"{name}: base weight {key} changed under LoRA"
    changed = [k for k in adapter_before if not torch.equal(adapter_before[k], adapter_after[k])]
    assert changed, f"{name}: no adapter weight changed"
    return trainer


def test_lora_trains_only_the_adapter_and_reloads(toy_model_path, small_train_dataset, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # fixed mixed-correctness completions: the adapter gets a gradient on step 1 by construction
    trainer = _train_lora("grpo", toy_model_path, small_train_dataset, tmp_path, deterministic=True, max_steps=3,
                          beta=0.04)
    # beta > 0 with a fresh adapter: the reference is the model with the adapter disabled, not a copy
    assert trainer.ref_model is None and trainer.args.beta > 0
    kl = [r["kl"] for r in trainer.state.log_history if "kl" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-6), "before any update, policy == base: KL must be 0"
    assert max(kl[1:]) > 0, "after updates the adapter moved away from the base: KL must be > 0"
    assert all(math.isfinite(r["loss"]) for r in trainer.state.log_history if "loss" in r)

    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists(), "LoRA should save the adapter only"

    tokenizer = trainer.processing_class
    batch = tokenizer(["12+34=", "56+7=", "80+19="], return_tensors="pt", padding=True)
    trained = trainer.model.eval()
    with torch.no_grad():
        expected = trained(**batch).logits
        base = AutoModelForCausalLM.from_pretrained(toy_model_path).eval()
        base_logits = base(**batch).logits
        reloaded = PeftModel.from_pretrained(base, str(out)).eval()
        got = reloaded(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (expected - base_logits).abs().max() > 1e-4, "the adapter does not change the outputs"


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_every_variant(variant, toy_model_path, small_train_dataset, tmp_path):
    trainer = _train_lora(variant, toy_model_path, small_train_dataset, tmp_path, deterministic=True, max_steps=1)
    assert trainer.state.global_step == 1
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)


def test_scale_helpers_build_trl_settings():
    config = lora_config(r=8)
    assert config.r == 8 and config.lora_alpha == 16 and config.target_modules == "all-linear"
    assert config.lora_dropout == 0.0 and str(config.task_type.value if hasattr(config.task_type, "value")
                                                 else config.task_type) == "CAUSAL_LM"
    kwargs = qlora_model_init_kwargs(quant_storage="bfloat16")
    quant = kwargs["quantization_config"]
    assert quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4" and quant.bnb_4bit_use_double_quant
    assert quant.bnb_4bit_compute_dtype == torch.bfloat16 and kwargs["dtype"] == torch.bfloat16
    # it travels through the config (and its JSON form) as TRL's model_init_kwargs
    from grpo_variants import GRPOVariantConfig

    args = GRPOVariantConfig(output_dir="x", report_to="none", model_init_kwargs=kwargs)
    assert '"load_in_4bit": true' in args.to_json_string()
    colocate = vllm_kwargs("colocate", gpu_memory_utilization=0.4)
    assert colocate["use_vllm"] and colocate["vllm_mode"] == "colocate"
    args = GRPOVariantConfig(output_dir="x", report_to="none", **colocate)
    assert args.vllm_gpu_memory_utilization == 0.4 and args.vllm_importance_sampling_correction
    server = vllm_kwargs("server", server_base_url="http://h:8000")
    assert server["vllm_server_base_url"] == "http://h:8000"
    from grpo_variants.errors import ConfigError

    with pytest.raises(ConfigError, match="colocate"):
        vllm_kwargs("remote")
    with pytest.raises(ConfigError, match="nf4"):
        qlora_model_init_kwargs(quant_type="int4")


@pytest.mark.gpu
@pytest.mark.skipif(qlora_unavailable_reason() is not None, reason=qlora_unavailable_reason() or QLORA_SKIP_REASON)
def test_qlora_4bit_base_with_lora(toy_model_path, small_train_dataset, tmp_path):
    import bitsandbytes as bnb

    spec = get_variant("grpo")
    args = _variant_args("grpo", tmp_path, max_steps=2, learning_rate=1e-3, bf16=True, beta=0.04,
                         model_init_kwargs=qlora_model_init_kwargs())
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                               train_dataset=small_train_dataset, peft_config=lora_config(r=4))
    linear4 = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linear4, "the base model was not loaded in 4-bit"
    adapter_before, base_before = _split(trainer.model)
    trainer.train()
    adapter_after, base_after = _split(trainer.model)
    assert any(not torch.equal(adapter_before[k], adapter_after[k]) for k in adapter_before)
    for key, value in base_before.items():
        assert torch.equal(value, base_after[key]), f"4-bit base weight {key} changed"
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
