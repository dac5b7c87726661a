"""Scale helpers: LoRA / QLoRA settings, vLLM settings and checks, DeepSpeed ZeRO introspection.

Every variant trainer takes TRL's scale options unchanged; this module only builds them with sensible
defaults and says clearly when something is missing::

    from grpo_variants import get_variant
    from grpo_variants.runtime.scale import lora_config, qlora_model_init_kwargs, vllm_kwargs

    spec = get_variant("dapo")
    args = spec.config_cls(output_dir="out", model_init_kwargs=qlora_model_init_kwargs(),   # 4-bit base
                           **vllm_kwargs("colocate"))                                       # vLLM rollouts
    trainer = spec.trainer_cls(model="Qwen/Qwen2.5-1.5B-Instruct", reward_funcs="math_accuracy", args=args,
                               train_dataset=ds, peft_config=lora_config(r=32))

* **LoRA** (``peft_config=lora_config(...)``): TRL wraps the model with PEFT; only the adapter
  trains. With ``beta > 0`` the reference log-probs come from the same model with the adapter
  disabled (no second copy of the weights). Saving writes only the adapter
  (``adapter_config.json`` + ``adapter_model.safetensors``); reload it with
  ``peft.PeftModel.from_pretrained(base, path)``.
* **QLoRA** (``model_init_kwargs=qlora_model_init_kwargs()`` + a ``peft_config``): the base model
  is loaded in 4-bit NF4 by bitsandbytes and stays frozen; the adapter trains in bf16. Needs a CUDA
  GPU and ``pip install 'grpo-variants[quant]'`` (:func:`qlora_unavailable_reason` says which is
  missing). Use it on one GPU or with DDP (``recipes/accelerate/single.yaml`` or plain
  ``accelerate launch --multi_gpu``); with ZeRO-3 set ``quant_storage`` to the compute dtype.
* **vLLM** (``**vllm_kwargs("colocate" | "server")``): TRL's own vLLM generation, unchanged for
  every variant. The importance-sampling correction between vLLM's and the trainer's log-probs
  (``vllm_importance_sampling_correction``, on by default) is applied by every variant's loss as a
  per-token weight, in TRL's order.
* **DeepSpeed ZeRO-3**: ``accelerate launch --config_file recipes/accelerate/zero3.yaml ...``
  (see ``recipes/README.md``). Generation gathers the partitioned weights
  (``ds3_gather_for_generation=True``, TRL's default); set it to False for models too large to
  gather on one GPU (slower, every rank generates in lock-step).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from grpo_variants.errors import ConfigError

__all__ = [
    "ACCELERATE_CONFIGS",
    "QLORA_SKIP_REASON",
    "accelerate_config_path",
    "is_zero3",
    "lora_config",
    "qlora_model_init_kwargs",
    "qlora_unavailable_reason",
    "vllm_kwargs",
    "vllm_unavailable_reason",
    "zero_stage",
]

QLORA_SKIP_REASON = "needs a CUDA GPU for bitsandbytes 4-bit"
ACCELERATE_CONFIGS = ("zero3", "zero3_offload", "zero2", "single")


# ------------------------------------------------------------------------------------------------
# LoRA / QLoRA
# ------------------------------------------------------------------------------------------------
def lora_config(
    r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    **kwargs,
):
    """A ``peft.LoraConfig`` for a causal LM: rank ``r``, alpha 2r, every linear layer but the LM head.

    Dropout defaults to 0: the policy's log-probs at generation and at update time must agree, and
    adapter dropout makes the on-policy ratio differ from 1. Extra keyword arguments go to
    ``LoraConfig`` (e.g. ``use_rslora=True``, ``modules_to_save=[...]``).
    """
    try:
        from peft import LoraConfig
    except ImportError as err:  # pragma: no cover - peft is a dependency
        raise ConfigError("LoRA needs the peft package: pip install peft") from err
    if r < 1:
        raise ConfigError(f"lora_config: r={r} must be >= 1 (the adapter rank, e.g. 16).")
    return LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
        **kwargs,
    )


def qlora_unavailable_reason() -> str | None:
    """None when 4-bit bitsandbytes loading can work here, else why not (for skips and error messages)."""
    if not torch.cuda.is_available():
        return QLORA_SKIP_REASON
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'grpo-variants[quant]')"
    return None


def qlora_model_init_kwargs(
    compute_dtype: str | torch.dtype = "bfloat16",
    quant_type: str = "nf4",
    double_quant: bool = True,
    quant_storage: str | torch.dtype | None = None,
    **model_kwargs,
) -> dict:
    """``model_init_kwargs`` that load the base model in 4-bit (QLoRA; Dettmers et al., 2023).

    Pass the result as ``GRPOVariantConfig(model_init_kwargs=...)`` (or TRL's trainer argument
    ``quantization_config=result["quantization_config"]``) together with ``peft_config=lora_config()``:
    a 4-bit model cannot be trained without an adapter. ``quant_storage`` (e.g. ``"bfloat16"``) lets
    DeepSpeed ZeRO-3 / FSDP shard the quantized weights. Building the kwargs needs neither a GPU nor
    bitsandbytes; loading the model needs both (see :func:`qlora_unavailable_reason`).
    """
    from transformers import BitsAndBytesConfig

    if quant_type not in ("nf4", "fp4"):
        raise ConfigError(f"qlora_model_init_kwargs: quant_type={quant_type!r}; choose 'nf4' (QLoRA) or 'fp4'.")
    dtype = _dtype(compute_dtype)
    quantization = dict(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )
    if quant_storage is not None:
        quantization["bnb_4bit_quant_storage"] = _dtype(quant_storage)
    return {"quantization_config": BitsAndBytesConfig(**quantization), "dtype": dtype, **model_kwargs}


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value in ("bfloat16", "float16", "float32"):
        return getattr(torch, value)
    raise ConfigError(f"dtype {value!r} is not one of 'bfloat16', 'float16', 'float32'.")


# ------------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------------
def vllm_unavailable_reason() -> str | None:
    """None when vLLM generation can work here, else why not."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'grpo-variants[vllm]')"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU"
    return None


def vllm_kwargs(
    mode: str = "colocate",
    *,
    gpu_memory_utilization: float = 0.3,
    tensor_parallel_size: int = 1,
    sleep_mode: bool | None = None,
    server_base_url: str | None = None,
    importance_sampling_correction: bool = True,
    **extra,
) -> dict:
    """Config fields for TRL's vLLM rollouts, to splat into any variant config.

    ``mode="colocate"``: vLLM shares each training GPU (``gpu_memory_utilization`` of it), asleep
    during updates when ``sleep_mode`` (default ``None``: asleep where a GPU is present; vLLM's CPU backend has no
    sleep mode, and ``sleep_mode=True`` there is refused by the config, docs/vllm.md). ``mode="server"``: generation runs in a separate
    ``trl vllm-serve --model ...`` process on other GPUs, reached at ``server_base_url`` (default
    ``http://localhost:8000``). Extra keyword arguments are other ``vllm_*`` config fields.
    """
    if mode not in ("colocate", "server"):
        raise ConfigError(f"vllm_kwargs: mode={mode!r}; choose 'colocate' or 'server'.")
    values = dict(use_vllm=True, vllm_mode=mode, vllm_importance_sampling_correction=importance_sampling_correction)
    if mode == "colocate":
        if sleep_mode is None:
            import torch

            sleep_mode = torch.cuda.is_available()
        values.update(vllm_gpu_memory_utilization=gpu_memory_utilization,
                      vllm_tensor_parallel_size=tensor_parallel_size, vllm_enable_sleep_mode=sleep_mode)
    elif server_base_url is not None:
        values["vllm_server_base_url"] = server_base_url
    values.update(extra)
    return values


# ------------------------------------------------------------------------------------------------
# DeepSpeed / accelerate
# ------------------------------------------------------------------------------------------------
def zero_stage(trainer) -> int | None:
    """The DeepSpeed ZeRO stage a trainer runs under (None without DeepSpeed)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def is_zero3(trainer) -> bool:
    return zero_stage(trainer) == 3


def accelerate_config_path(name: str) -> str:
    """Path of one of the shipped accelerate configs (``zero3``, ``zero3_offload``, ``zero2``, ``single``).

    They live in ``recipes/accelerate/`` of a source checkout (they are launch files, not package
    data); the DeepSpeed JSON they name is resolved against the working directory, so launch from
    the repository root.
    """
    if name not in ACCELERATE_CONFIGS:
        raise ConfigError(f"unknown accelerate config {name!r}; choose one of {list(ACCELERATE_CONFIGS)}.")
    path = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(
            f"{path} not found: the accelerate configs ship with the source repository (recipes/accelerate/), "
            "not with the installed package. Clone the repository and launch from its root."
        )
    return os.fspath(path)
