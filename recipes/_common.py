"""Shared plumbing of the recipes: arguments, the ``--toy`` switch, model / dataset / reward loading, vLLM.

A recipe is a short script that declares a :class:`Recipe` (variant, model, dataset, rewards, the
paper's hyperparameters) and calls :func:`main`::

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/dr_grpo_qwen.py [--field value ...]
    python recipes/dr_grpo_qwen.py --toy            # same code path: toy kit, CPU, about a minute

Command line: every field of the variant's config (TRL's names, ``--learning_rate 2e-6``) plus

  --toy                  the offline toy kit (tiny Qwen2 policy, arithmetic prompts, ``toy_accuracy``)
                         with CPU-sized batches; the variant's own settings are kept
  --model PATH_OR_ID     the policy (default: the recipe's model)
  --dataset SPEC         hub id, ``save_to_disk`` folder or json/jsonl/csv/parquet file
  --dataset_config NAME / --dataset_split NAME / --max_train_samples N
  --reward NAME          registered reward (repeatable; default: the recipe's rewards)
  --samples_per_update N completions per optimizer update, over all processes
  --updates_per_rollout N optimizer updates per rollout (the papers' mini-batches)
  --resume_from_checkpoint true|PATH  as the CLI: true (or latest) resumes from the newest complete
                         checkpoint in --output_dir; with none there, one line and exit 2

Batching is stated as the papers state it (``samples_per_update`` and ``updates_per_rollout``) and
turned into TRL's per-device fields for the launched world size::

    gradient_accumulation_steps = samples_per_update / (per_device_train_batch_size * num_processes)
    steps_per_generation        = updates_per_rollout * gradient_accumulation_steps
                                  (or ``mini_batches_per_rollout`` for the variants that have it)

so a rollout holds ``samples_per_update * updates_per_rollout`` completions whatever the GPU count.
An explicit ``--gradient_accumulation_steps`` / ``--steps_per_generation`` / ``--generation_batch_size``
wins. Generation uses vLLM (colocated, sleeping during the update) when it is installed and CUDA is
available, HF ``generate`` otherwise; ``--use_vllm false`` forces the latter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

# Settings that make a run fit a CPU in about a minute (applied on top of the recipe with --toy).
TOY_SETTINGS = dict(
    per_device_train_batch_size=32,
    max_completion_length=6,
    learning_rate=1e-4,  # the toy policy needs a large step: 1e-6 does not move 1M parameters
    lr_scheduler_type="constant",
    warmup_steps=0,
    max_steps=12,
    temperature=1.0,
    top_p=1.0,
    use_vllm=False,
    bf16=False,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)
TOY_SAMPLES_PER_UPDATE = 32  # per process
TOY_MAX_UPDATES_PER_ROLLOUT = 4  # the recipe's updates per rollout, capped (keeps the off-policy structure)


@dataclass
class DatasetSpec:
    """Where the prompts come from and which columns hold the question and the gold answer.

    ``prompt`` / ``answer`` are column names; a dotted name reads a nested field
    (``reward_model.ground_truth``). A string question is wrapped as one user message (formatted by
    ``template``); a list of messages is used as is. The gold answer lands in the ``answer`` column,
    which the math rewards read.
    """

    path: str
    config: str | None = None
    split: str = "train"
    prompt: str = "problem"
    answer: str = "answer"
    template: str = "{question}"
    filter: Callable[[dict], bool] | None = None


@dataclass
class Recipe:
    """Everything a recipe declares; :func:`main` does the rest."""

    variant: str
    model: str
    dataset: DatasetSpec
    rewards: list[str]
    config: dict = field(default_factory=dict)  # paper-scale config fields
    samples_per_update: int | None = None  # completions per optimizer update, all processes together
    updates_per_rollout: int | None = None  # optimizer updates per rollout
    system_prompt: str | None = None
    vllm: dict = field(default_factory=dict)  # vLLM settings applied when vLLM is used
    toy: dict = field(default_factory=dict)  # extra overrides for --toy
    description: str = ""


# ------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------
def vllm_available() -> bool:
    """vLLM generation is possible: CUDA is present and the ``vllm`` package is importable."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def world_size() -> int:
    """Processes of this launch (``accelerate launch`` / ``torchrun`` set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# ------------------------------------------------------------------------------------------------
# arguments -> config
# ------------------------------------------------------------------------------------------------
def _recipe_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--dataset")
    parser.add_argument("--dataset_config")
    parser.add_argument("--dataset_split")
    parser.add_argument("--max_train_samples", type=int)
    parser.add_argument("--reward", action="append")
    parser.add_argument("--samples_per_update", type=int)
    parser.add_argument("--updates_per_rollout", type=int)
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def _given(argv: list[str], name: str) -> bool:
    """Whether ``--name`` appears on the command line (as ``--name v`` or ``--name=v``)."""
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def _peek_int(argv: list[str], name: str) -> int | None:
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument(f"--{name}", type=int)
    return getattr(peek.parse_known_args(argv)[0], name)


def batching_defaults(recipe_values: dict, config_cls, argv: list[str], samples_per_update: int | None,
                      updates_per_rollout: int | None, num_processes: int) -> dict:
    """TRL per-device fields from the paper's batching (see the module docstring); CLI fields win."""
    out = {}
    per_device = _peek_int(argv, "per_device_train_batch_size") or recipe_values.get("per_device_train_batch_size", 8)
    accumulation = _peek_int(argv, "gradient_accumulation_steps")
    if samples_per_update is not None and accumulation is None:
        per_step = per_device * num_processes
        if samples_per_update % per_step:
            raise SystemExit(
                f"samples_per_update={samples_per_update} is not a multiple of per_device_train_batch_size "
                f"({per_device}) x processes ({num_processes}) = {per_step}: change --per_device_train_batch_size, "
                "the process count or --samples_per_update."
            )
        accumulation = samples_per_update // per_step
        out["gradient_accumulation_steps"] = accumulation
    accumulation = accumulation or recipe_values.get("gradient_accumulation_steps", 1)
    if updates_per_rollout is not None:
        fields = {f.name: f for f in dataclasses.fields(config_cls)}
        names = set(fields)
        stage = recipe_values.get("stage_prompts", getattr(fields.get("stage_prompts"), "default", None))
        if stage is not None:  # a stage rollout (µ-GRPO): µ = updates per rollout; it derives steps_per_generation
            out["updates_per_stage"] = updates_per_rollout
        elif "mini_batches_per_rollout" in names:  # every other variant (a base config field)
            out["mini_batches_per_rollout"] = updates_per_rollout
        elif not (_given(argv, "steps_per_generation") or _given(argv, "generation_batch_size")):
            out["steps_per_generation"] = updates_per_rollout * accumulation
    return out


def build_config(recipe: Recipe, argv: list[str] | None = None, num_processes: int | None = None):
    """Parse the command line into ``(config, options)`` without loading anything heavy.

    ``options`` holds the recipe-level flags (toy, model, dataset, ...). ``num_processes`` defaults
    to the launched world size.
    """
    from transformers import HfArgumentParser

    from grpo_variants import get_variant

    argv = list(sys.argv[1:] if argv is None else argv)
    options, rest = _recipe_arguments().parse_known_args(argv)
    spec = get_variant(recipe.variant)
    parser = HfArgumentParser(spec.config_cls)
    if options.help:
        print((sys.modules["__main__"].__doc__ or recipe.description or "").strip(), end="\n\n")
        print("Command line:" + __doc__.split("Command line:", 1)[1].split("Batching", 1)[0].rstrip(), end="\n\n")
        parser.print_help()
        raise SystemExit(0)

    values = dict(recipe.config)
    use_vllm = vllm_available() and not options.toy
    if use_vllm:
        values.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, **recipe.vllm)
    if options.toy:
        values.update(TOY_SETTINGS)
        values.update(recipe.toy)
        values["output_dir"] = os.path.join("outputs", "toy", recipe.variant)
    values.setdefault("output_dir", os.path.join("outputs", recipe.variant))
    processes = num_processes or world_size()
    samples, updates = recipe.samples_per_update, recipe.updates_per_rollout
    if options.toy:  # one accumulation step per update on every process
        samples, updates = TOY_SAMPLES_PER_UPDATE * processes, min(updates or 1, TOY_MAX_UPDATES_PER_ROLLOUT)
    samples = options.samples_per_update or samples
    updates = options.updates_per_rollout or updates
    values.update(batching_defaults(values, spec.config_cls, rest, samples, updates, processes))
    parser.set_defaults(**values)
    (config,) = parser.parse_args_into_dataclasses(args=rest)
    return config, options


# ------------------------------------------------------------------------------------------------
# model, data, rewards
# ------------------------------------------------------------------------------------------------
def _nested(row: dict, dotted: str):
    value = row
    for key in dotted.split("."):
        value = value[key]
    return value


def load_prompts(spec: DatasetSpec, system_prompt: str | None = None, max_samples: int | None = None):
    """The dataset as ``prompt`` (a conversation) + ``answer`` (gold) columns."""
    from grpo_variants.inputs import load_dataset

    dataset = load_dataset(spec.path, split=spec.split, config_name=spec.config)  # a hub id, file or folder
    if spec.filter is not None:
        dataset = dataset.filter(spec.filter)
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))

    def to_row(row):
        question = _nested(row, spec.prompt)
        if isinstance(question, str):
            messages = [{"role": "user", "content": spec.template.format(question=question)}]
        else:
            messages = [dict(m) for m in question]
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return {"prompt": messages, "answer": str(_nested(row, spec.answer))}

    return dataset.map(to_row, remove_columns=dataset.column_names)


def resolve_inputs(recipe: Recipe, options):
    """``(model, train_dataset, rewards, eval_dataset)`` for the run: the toy kit or the recipe's."""
    if options.toy:
        from grpo_variants.tasks import toy

        ignored = [f"--{name}" for name in ("model", "dataset", "dataset_config", "dataset_split", "max_train_samples")
                   if getattr(options, name) is not None]
        if ignored:
            from grpo_variants.inputs import UsageError

            raise UsageError(f"--toy runs the toy kit (its policy, prompts and held-out set), so {', '.join(ignored)} "
                             "would not be used: drop them, or drop --toy.")
        kit = toy.prepare(verbose=is_main_process())
        return kit.model_path, kit.train_dataset, options.reward or ["toy_accuracy"], kit.eval_dataset
    from grpo_variants.inputs import resolve_model_path

    model = resolve_model_path(options.model or recipe.model)  # before the dataset downloads: fails first, in one line
    spec = recipe.dataset
    if options.dataset:
        spec = dataclasses.replace(spec, path=options.dataset, config=options.dataset_config, filter=None)
    if options.dataset_split:
        spec = dataclasses.replace(spec, split=options.dataset_split)
    dataset = load_prompts(spec, recipe.system_prompt, options.max_train_samples)
    return model, dataset, options.reward or list(recipe.rewards), None


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def main(recipe: Recipe, argv: list[str] | None = None):
    """Parse, load, train, save; with ``--toy`` also print held-out accuracy before and after.

    Bad input (a config value, a dataset or model that cannot be found or reached, a resume with nothing to
    resume from) exits with one line (code 2) before any model is loaded or evaluated.
    """
    from grpo_variants import toy

    with one_line_errors():
        config, options = build_config(recipe, argv)
        resume = resume_checkpoint(config)
        model, train_dataset, rewards, eval_dataset = resolve_inputs(recipe, options)
        trainer = get_trainer(recipe, model, rewards, config, train_dataset)
    if is_main_process():
        per_update = config.per_device_train_batch_size * world_size() * config.gradient_accumulation_steps
        updates = config.steps_per_generation * config.num_iterations / config.gradient_accumulation_steps
        print(f"[{recipe.variant}] model={model} prompts={len(train_dataset)} rewards={rewards} "
              f"generation={'vLLM (colocate)' if config.use_vllm else 'HF generate'} "
              f"completions/update={per_update} updates/rollout={updates:g}")
    # The held-out evaluation runs on every process (each gets the same greedy accuracy): under ZeRO-3 the
    # trained model's partitions are gathered for it, a collective call (grpo_variants.tasks.toy.evaluate).
    if eval_dataset is not None:
        accuracy = toy.evaluate(model, eval_dataset)
        if is_main_process():
            print(f"[{recipe.variant}] held-out accuracy before: {accuracy:.1%}")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(config.output_dir)
    if eval_dataset is not None:
        accuracy = toy.evaluate(trainer.model, eval_dataset, trainer.processing_class)
        if is_main_process():
            print(f"[{recipe.variant}] held-out accuracy after: {accuracy:.1%}")
    return trainer


def get_trainer(recipe: Recipe, model, rewards, config, train_dataset):
    from grpo_variants import get_variant

    return get_variant(recipe.variant).trainer_cls(model=model, reward_funcs=rewards, args=config,
                                                   train_dataset=train_dataset)


@contextlib.contextmanager
def one_line_errors():
    """grpo-variants' own errors (bad input, each with its fix) as one line on stderr and exit code 2."""
    from grpo_variants.errors import GRPOVariantsError

    try:
        yield
    except GRPOVariantsError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def resume_checkpoint(config):
    """``--resume_from_checkpoint`` as the CLI reads it: ``true`` / ``latest`` -> the newest complete checkpoint
    in ``output_dir``, a folder -> that checkpoint, ``false`` / absent -> a fresh run. A resume with nothing to
    resume from exits with one line (before any model is loaded)."""
    from grpo_variants.inputs import resume_checkpoint as resolve

    with one_line_errors():
        return resolve(config.resume_from_checkpoint, config.output_dir)
