"""The model card a run leaves in ``output_dir/README.md``: TRL's card, completed.

TRL writes the card (``GRPOTrainer.create_model_card``); :func:`complete_model_card` then

* names the base model: a hub id as a link, a local folder by the relative path it was given or by its
  name (never its absolute path, which says nothing to a reader of the card and shows the training
  machine's layout);
* points the Quick start at a folder that loads: the folder ``save_model()`` last wrote, the output folder
  if it holds the weights, else the last checkpoint; with none of them it says how to save the weights
  (TRL's own card names the hub repository, or ``"None"`` without one);
* appends the section :func:`model_card_section`: the variant and its paper (or TRL's GRPO with no
  variant), base model, rewards, data, LoRA / quantization / DeepSpeed settings and the hyper-parameters
  that differ from the variant's or TRL's defaults.

``GRPOVariantTrainer.create_model_card`` and ``save_model`` call it; nothing here trains.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer

from grpo_variants.registry import NO_VARIANT_LABEL

# Paper titles by arXiv id (the id comes from each variant's registration).
PAPER_TITLES = {
    "2402.03300": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    "2503.14476": "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    "2503.20783": "Understanding R1-Zero-Like Training: A Critical Perspective",
    "2507.18071": "Group Sequence Policy Optimization",
}
# Fields that say where and how a run is kept, not how it trains: left out of the card's table.
_NOT_HYPERPARAMETERS = frozenset({
    "output_dir", "logging_dir", "run_name", "hub_model_id", "hub_token", "hub_strategy", "hub_private_repo",
    "push_to_hub", "resume_from_checkpoint", "report_to", "disable_tqdm", "local_rank", "overwrite_output_dir",
    "logging_steps", "logging_strategy", "logging_first_step", "save_steps", "save_strategy", "save_total_limit",
    "eval_steps", "log_completions", "num_completions_to_print", "variant", "project", "trackio_space_id",
})


# Fields whose value __post_init__ derives from others or normalises.
_DERIVED = frozenset({
    "bf16", "gradient_checkpointing", "activation_checkpointing", "generation_batch_size", "steps_per_generation",
    "epsilon_high", "accelerator_config", "debug", "pad_to_multiple_of", "scale_rewards", "ratio_level",
})


def _variant_paper(spec) -> tuple[str, str]:
    paper_id = (spec.paper if spec and spec.paper else "arXiv:2402.03300").split(":", 1)[-1].strip()
    name = spec.name if spec else NO_VARIANT_LABEL
    return PAPER_TITLES.get(paper_id, f"{name} (arXiv {paper_id})"), paper_id


def _field_default(f):
    from dataclasses import MISSING

    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def non_default_hyperparameters(args) -> list[tuple[str, object, object, object]]:
    """``(field, value, variant default, TRL default)`` for every training field whose value differs from
    the variant config's default, or whose variant default differs from ``trl.GRPOConfig``'s (``...``
    where TRL has no such field). Fields that ``__post_init__`` derives or normalises (batch arithmetic,
    bf16 / checkpointing on CPU) are listed only where the variant's default differs from TRL's.
    The config is not rebuilt: building a ``TrainingArguments`` resets accelerate's state."""
    cls = type(args)
    variant_defaults = {f.name: _field_default(f) for f in fields(cls) if f.init}
    trl_defaults = {f.name: _field_default(f) for f in fields(GRPOConfig) if f.init}
    rows = []
    for name, default in variant_defaults.items():
        if name in _NOT_HYPERPARAMETERS or name.startswith(("hub_", "push_to_hub", "ddp_", "fsdp", "dataloader_")):
            continue
        value = getattr(args, name, None)
        trl_default = trl_defaults.get(name, ...)
        variant_differs = trl_default is not ... and default != trl_default
        if variant_differs or (value != default and name not in _DERIVED):
            rows.append((name, value, default, trl_default))
    return rows


def _show(value) -> str:
    from enum import Enum

    if isinstance(value, Enum):
        value = value.value
    return f"`{value!r}`"


def describe_base_model(name_or_path: str | None) -> str:
    """A model's name for the card: a hub id as a link, a local folder as the relative path it was given, or by
    its folder name alone when the path is absolute (never an absolute path)."""
    if not name_or_path:
        return "a model object passed to the trainer (it carries no name or path)"
    name_or_path = str(name_or_path)
    if os.path.isdir(name_or_path) or os.path.isabs(name_or_path) or name_or_path.startswith("."):
        path = os.path.normpath(name_or_path)
        if os.path.isabs(path):
            path = os.path.basename(path) or path
        return f"`{path}` (a local folder)"
    return f"[{name_or_path}](https://huggingface.co/{name_or_path})"


def describe_dataset(dataset, name: str | None = None) -> str | None:
    """``name`` or the dataset's own name (hub id / builder), its size and columns; None without one."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return "; ".join(f"{key}: {describe_dataset(value)}" for key, value in dataset.items())
    info = getattr(dataset, "info", None)
    own = name or (getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) if info else None)
    parts = [f"`{own}`" if own else "an in-memory dataset"]
    try:
        parts.append(f"{len(dataset):,} rows")
    except TypeError:
        parts.append("streamed")
    columns = getattr(dataset, "column_names", None)
    if columns:
        parts.append("columns " + ", ".join(f"`{c}`" for c in columns))
    return ", ".join(parts)


def lora_settings(model) -> dict | None:
    """The PEFT adapter settings of a ``PeftModel`` (None for a plain model)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    adapter = getattr(model, "active_adapter", None)
    config = configs.get(adapter) if isinstance(adapter, str) and adapter in configs else next(iter(configs.values()))
    values = {"peft_type": getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))}
    for key in ("r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "bias", "use_rslora",
                "use_dora"):
        value = getattr(config, key, None)
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        if value not in (None, False) or key in ("r", "lora_alpha", "lora_dropout"):
            values[key] = value
    return values


def deepspeed_settings(accelerator) -> dict | None:
    """ZeRO stage, offload devices and process count of a DeepSpeed run (None without DeepSpeed)."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if plugin is None:
        return None
    zero = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}) or {}
    values = {"zero_stage": int(getattr(plugin, "zero_stage", zero.get("stage", 0)) or 0),
              "processes": getattr(accelerator, "num_processes", None)}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device")
        if device not in (None, "none"):
            values[f"{key}_device"] = device
    return values


def model_card_setup(trainer, dataset_name: str | None = None) -> dict:
    """What the model card says about a run besides its hyper-parameters."""
    model = trainer.model
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    if quant is not None and hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    if isinstance(quant, dict):
        quant = {k: v for k, v in quant.items() if k in ("quant_method", "load_in_4bit", "load_in_8bit",
                                                         "bnb_4bit_quant_type", "bnb_4bit_compute_dtype")}
    weights = getattr(trainer, "reward_weights", None)
    weights = weights.tolist() if hasattr(weights, "tolist") else list(weights or [])
    names = list(getattr(trainer, "reward_func_names", []) or [])
    return {
        "base_model": getattr(config, "_name_or_path", None) if config is not None else None,
        "rewards": list(zip(names, weights + [1.0] * (len(names) - len(weights)))),
        "train_dataset": describe_dataset(getattr(trainer, "train_dataset", None), dataset_name),
        "eval_dataset": describe_dataset(getattr(trainer, "eval_dataset", None)),
        "lora": lora_settings(model),
        "quantization": quant or None,
        "deepspeed": deepspeed_settings(trainer.accelerator),
        "processes": getattr(trainer.accelerator, "num_processes", 1),
    }


def _settings(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def model_card_section(args, spec, title: str, paper_id: str, setup: dict | None = None) -> str:
    """The Markdown the model card gets after TRL's text: variant, paper, base model, rewards, data,
    LoRA / quantization / DeepSpeed settings, and the hyper-parameter table."""
    name = spec.name if spec else NO_VARIANT_LABEL
    desc = (f": {spec.description}" if spec else
            ": TRL's GRPO loss and `trl.GRPOConfig`'s defaults (a `GRPOVariantConfig` with no `variant`)")
    lines = [
        "## grpo-variants",
        "",
        f"Variant **{name}**{desc}.",
        f"Paper: [{title}](https://arxiv.org/abs/{paper_id}) (arXiv {paper_id}).",
        "",
    ]
    if setup is not None:
        rewards = ", ".join(f"`{n}` (weight {w:g})" for n, w in setup.get("rewards", [])) or "none recorded"
        lines += [
            f"* Base model: {describe_base_model(setup.get('base_model'))}",
            f"* Rewards: {rewards}",
            f"* Training data: {setup.get('train_dataset') or 'not recorded'}",
        ]
        if setup.get("eval_dataset"):
            lines.append(f"* Evaluation data: {setup['eval_dataset']}")
        lines.append(f"* LoRA: {_settings(setup['lora'])}" if setup.get("lora") else "* LoRA: none (full fine-tuning)")
        if setup.get("quantization"):
            lines.append(f"* Quantization: {_settings(setup['quantization'])}")
        if setup.get("deepspeed"):
            lines.append(f"* DeepSpeed: {_settings(setup['deepspeed'])}")
        else:
            lines.append(f"* DeepSpeed: none ({setup.get('processes', 1)} process(es))")
        lines.append("")
    lines += [
        "Hyper-parameters that differ from the variant's defaults or from `trl.GRPOConfig`'s:",
        "",
        "| field | this run | variant default | TRL default |",
        "|---|---|---|---|",
    ]
    for field_name, value, default, trl_default in non_default_hyperparameters(args):
        trl_text = "(not a TRL field)" if trl_default is ... else _show(trl_default)
        lines.append(f"| `{field_name}` | {_show(value)} | {_show(default)} | {trl_text} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Where the weights are: the Quick start must load them
# ------------------------------------------------------------------------------------------------
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


def holds_weights(folder) -> bool:
    """Whether ``folder`` is a saved model ``from_pretrained`` loads (a config and weights, or a PEFT adapter)."""
    if not folder or not os.path.isdir(folder):
        return False
    names = set(os.listdir(folder))
    has_config = "config.json" in names or "adapter_config.json" in names
    return has_config and any(name in names for name in _WEIGHT_FILES)


def weights_folder(trainer) -> tuple[str | None, str]:
    """``(folder, what)``: where this run's weights load from, and what that folder is; ``(None, "")`` when
    nothing is saved. In order: the folder ``save_model()`` last wrote, ``output_dir``, the last checkpoint."""
    saved = getattr(trainer, "_saved_model_dir", None)
    if holds_weights(saved):
        return str(saved), "the trained model"
    out = trainer.args.output_dir
    if holds_weights(out):
        return str(out), "the trained model"
    try:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(out) if os.path.isdir(out) else None
    except Exception:  # noqa: BLE001 - an unreadable folder: no checkpoint to name
        last = None
    if holds_weights(last):
        return str(last), "the last checkpoint"
    return None, ""


_QUICK_START = re.compile(r"(## Quick start\n\n)(```python\n.*?\n```\n)", re.S)


def quick_start(text: str, trainer) -> str:
    """TRL's Quick start with ``model=`` a folder that loads, or, with nothing saved, how to save one.

    A hub repository (``hub_model_id``) is TRL's own and left as it is."""
    if getattr(trainer, "hub_model_id", None):
        return text
    folder, what = weights_folder(trainer)
    match = _QUICK_START.search(text)
    if match is None:
        return text
    snippet = re.sub(r"model=(\"None\"|'[^']*'|\"[^\"]*\")", lambda _m: f"model={(folder or trainer.args.output_dir)!r}",
                     match.group(2), count=1)
    if folder is None:
        out = trainer.args.output_dir
        note = (f"The weights of this run were not saved when this card was written: save them in the script that "
                f"trained it with `trainer.save_model({out!r})` (the command line `grpo-variants train` does this "
                f"itself), and this card then names the folder. Then:\n\n")
    else:
        note = f"Load {what} from `{folder}`:\n\n"
    return text[:match.start()] + match.group(1) + note + snippet + text[match.end():]


@contextmanager
def trl_card_names(trainer, spec, title: str, paper_id: str):
    """Set the trainer's ``_name`` / ``_paper`` (what TRL's card says the model was trained with) for the
    duration of TRL's ``create_model_card``, then go back to the class attributes."""
    trainer._name = f"{spec.name} (grpo-variants)" if spec else NO_VARIANT_LABEL
    trainer._paper = {"title": title, "id": paper_id}
    if spec is None or spec.name == "grpo":
        trainer._paper = dict(GRPOTrainer._paper)
    try:
        yield
    finally:
        del trainer._name, trainer._paper


def complete_model_card(trainer, spec, title: str, paper_id: str, dataset_name: str | None = None) -> Path:
    """Complete the card TRL wrote in ``output_dir/README.md`` (main process only): the base model named,
    the Quick start loading a saved folder, and :func:`model_card_section` appended."""
    setup = model_card_setup(trainer, dataset_name)
    card = Path(trainer.args.output_dir) / "README.md"
    text = card.read_text()
    # TRL names only hub models: a local folder became "a fine-tuned version of [None](...None)".
    text = text.replace("[None](https://huggingface.co/None)", describe_base_model(setup["base_model"]))
    text = quick_start(text, trainer)
    card.write_text(text + "\n" + model_card_section(trainer.args, spec, title, paper_id, setup))
    return card
