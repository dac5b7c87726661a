"""The ``grpo-variants`` command line.

    grpo-variants list
    grpo-variants train --variant dapo --model toy --dataset toy --max_steps 2 --output_dir out
    grpo-variants train --config recipe.yaml [--any_GRPOConfig_field value ...]
    grpo-variants demo [--output_dir demo-out] [--max_steps N]

``train`` accepts every field of the variant's config class as ``--field value`` (TRL's names),
``--reward NAME`` (repeatable; registered names, see ``list``), ``--reward_weights`` and a YAML
file whose keys are the same names (plus ``variant``, ``model``, ``dataset``, ``reward``).
Command-line flags override the YAML file. ``--model toy`` / ``--dataset toy[:task]`` use the
offline toy kit and small CPU-friendly defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from grpo_variants.errors import GRPOVariantsError

# Defaults for toy runs on CPU (any explicit flag or YAML key wins).
TOY_DEFAULTS = dict(
    per_device_train_batch_size=64,
    num_generations=8,
    max_completion_length=6,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    temperature=1.0,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    seed=0,
)


def _load_dataset(spec: str, split: str = "train"):
    """``toy``, ``toy:subtraction``, a ``save_to_disk`` folder, a json/jsonl/csv/parquet file, or a hub id."""
    from grpo_variants import toy

    if spec == "toy" or spec.startswith("toy:"):
        task = spec.split(":", 1)[1] if ":" in spec else "addition"
        return toy.make_dataset(task, "train" if split == "train" else "eval")
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        from datasets import load_from_disk

        return load_from_disk(str(path))
    if path.is_file():
        from datasets import load_dataset

        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise GRPOVariantsError(f"--dataset {spec!r}: unsupported file type {path.suffix!r} (json, jsonl, csv, parquet).")
        return load_dataset(kind, data_files=str(path), split="train")
    from datasets import load_dataset

    return load_dataset(spec, split=split)


def _yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise GRPOVariantsError(f"--config {path!r} must hold a mapping of field: value.")
    return data


def cmd_list(_args) -> int:
    from grpo_variants.registry import list_variants
    from grpo_variants.rewards.registry import list_rewards

    print("Variants:")
    for spec in list_variants():
        print(f"  {spec.name:<12} {spec.description}" + (f"  [{spec.paper}]" if spec.paper else ""))
    print("\nRewards:")
    for spec in list_rewards():
        print(f"  {spec.name:<22} {spec.description}")
    return 0


def cmd_train(argv: list[str]) -> int:
    from transformers import HfArgumentParser

    from grpo_variants.registry import get_variant

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--variant", default=None)
    pre.add_argument("--model", default=None)
    pre.add_argument("--dataset", default=None)
    pre.add_argument("--eval_dataset", default=None)
    pre.add_argument("--reward", action="append", default=None)
    pre.add_argument("--toy_eval", action="store_true", help="print held-out toy accuracy before and after")
    pre.add_argument("-h", "--help", action="store_true")
    known, rest = pre.parse_known_args(argv)
    file_cfg = _yaml(known.config) if known.config else {}
    variant_name = known.variant or file_cfg.pop("variant", None) or "grpo"
    model = known.model or file_cfg.pop("model", None)
    dataset_spec = known.dataset or file_cfg.pop("dataset", None)
    eval_spec = known.eval_dataset or file_cfg.pop("eval_dataset", None)
    rewards = known.reward or file_cfg.pop("reward", None) or file_cfg.pop("rewards", None)
    for key in ("variant", "model", "dataset", "eval_dataset", "reward", "rewards"):
        file_cfg.pop(key, None)
    spec = get_variant(variant_name)
    parser = HfArgumentParser(spec.config_cls)
    if known.help:
        parser.print_help()
        return 0
    if model is None or dataset_spec is None:
        raise GRPOVariantsError("train needs --model (a path, a hub id or 'toy') and --dataset (e.g. 'toy').")

    is_toy = model == "toy"
    defaults = dict(TOY_DEFAULTS) if is_toy else {}
    defaults.setdefault("output_dir", f"outputs/{spec.name}")
    defaults.update(file_cfg)
    parser.set_defaults(**defaults)
    (config,) = parser.parse_args_into_dataclasses(args=rest)

    from grpo_variants import toy

    eval_dataset = None
    if is_toy:
        task = dataset_spec.split(":", 1)[1] if dataset_spec.startswith("toy:") else "addition"
        kit = toy.prepare(task=task)
        model_path = kit.model_path
        train_dataset = kit.train_dataset if dataset_spec.startswith("toy") else _load_dataset(dataset_spec)
        eval_dataset = kit.eval_dataset
        rewards = rewards or ["toy_accuracy"]
    else:
        from grpo_variants.models import resolve_model

        model_path = resolve_model(model)  # a path, a hub id, or a registered name such as "smollm2"
        train_dataset = _load_dataset(dataset_spec)
        if eval_spec:
            eval_dataset = _load_dataset(eval_spec, split="test")
        if not rewards:
            raise GRPOVariantsError("train needs at least one --reward NAME (see `grpo-variants list`).")

    if known.toy_eval and eval_dataset is not None:
        print(f"held-out accuracy before: {toy.evaluate(model_path, eval_dataset):.1%}")
    trainer = spec.trainer_cls(model=model_path, reward_funcs=rewards, args=config, train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)
    if known.toy_eval and eval_dataset is not None:
        acc = toy.evaluate(trainer.model, eval_dataset, trainer.processing_class)
        print(f"held-out accuracy after: {acc:.1%}")
    return 0


def cmd_demo(argv: list[str]) -> int:
    from grpo_variants.demo import main as demo_main

    return demo_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: grpo-variants {list,train,demo} [options]   (grpo-variants train --help for the fields)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "list":
            return cmd_list(rest)
        if command == "train":
            return cmd_train(rest)
        if command == "demo":
            return cmd_demo(rest)
    except GRPOVariantsError as err:
        print(f"grpo-variants {command}: error: {err}", file=sys.stderr)
        return 2
    print(f"grpo-variants: unknown command {command!r}. {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
