"""The ``grpo-variants`` command line.

    grpo-variants list
    grpo-variants train --variant dapo --model toy --dataset toy --max_steps 2 --output_dir out
    grpo-variants train --config recipe.yaml [--any_config_field value ...]
    grpo-variants demo [--output_dir outputs/demo] [--max_steps N]
    grpo-variants vllm-serve --model PATH [--host 127.0.0.1] [--port 8000] [--dtype float32] [-- vllm serve args]

``train`` parses like ``trl grpo``: ``trl.TrlParser`` over TRL's script arguments
(``GRPOScriptArguments``: ``--dataset_name``, ``--reward_funcs``, ...), the variant's config class
(every ``trl.GRPOConfig`` field plus the variant's), TRL's ``ModelConfig``
(``--model_name_or_path``, LoRA / quantization) and ``DatasetMixtureConfig``, and a YAML ``--config``
file with the same keys (``env:`` included); flags override the file. Short aliases: ``--model``,
``--dataset``, ``--reward`` (repeatable), and ``--eval_dataset``. Rewards are registered names
(``grpo-variants list``), TRL's script names or dotted import paths (``trl.rewards.accuracy_reward``).
``--model toy`` / ``--dataset toy[:task]`` use the offline toy kit with toy-sized defaults, announced
in one line. ``grpo-variants train --help [--variant NAME]`` lists every field.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo_variants import inputs
from grpo_variants.errors import GRPOVariantsError
from grpo_variants.inputs import (  # noqa: F401  (the old private names stay importable from here)
    DATA_SUFFIXES as _DATA_SUFFIXES,
    UsageError,
    load_dataset as _load_dataset,
    looks_local as _looks_local,
    parse_resume as _resume_value,
)

# Toy-sized values for `--model toy` on CPU: applied only where neither a flag nor the YAML file sets
# the field, and announced in one line. Everything else keeps the variant's (TRL's) default.
TOY_DEFAULTS = dict(
    per_device_train_batch_size=64,
    num_generations=8,
    max_completion_length=6,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    logging_steps=1,
)


def _script_arguments_class():
    from trl.scripts.grpo import GRPOScriptArguments

    @dataclass
    class TrainScriptArguments(GRPOScriptArguments):
        """TRL's GRPO script arguments plus grpo-variants' short aliases."""

        model: str | None = field(
            default=None,
            metadata={"help": "Alias of --model_name_or_path: a local folder, a hub id, or 'toy' (the offline toy "
                              "kit, with toy-sized defaults)."},
        )
        dataset: str | None = field(
            default=None,
            metadata={"help": "Alias of --dataset_name: 'toy' / 'toy:TASK', a save_to_disk folder, a "
                              "json/jsonl/csv/parquet file, or a hub id."},
        )
        eval_dataset: str | None = field(
            default=None,
            metadata={"help": "Evaluation data (same forms as --dataset), passed to the trainer as eval_dataset "
                              "(TRL evaluates it when eval_strategy is not 'no'). With --model toy it is also "
                              "the held-out set of --toy_eval (default: the toy kit's 500 held-out problems)."},
        )
        reward: list[str] | None = field(
            default=None,
            metadata={"help": "Alias of --reward_funcs (repeatable): registered names (grpo-variants list), TRL's "
                              "names (accuracy_reward, think_format_reward, ...) or dotted import paths "
                              "(trl.rewards.accuracy_reward)."},
        )
        toy_eval: bool = field(
            default=True,
            metadata={"help": "With --model toy: held-out greedy accuracy before and after training."},
        )

    return TrainScriptArguments


def _parser(spec, variant_given: bool):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    class Parser(TrlParser):
        def error(self, message):  # one line instead of the usage block and a SystemExit
            raise UsageError(f"{message}. See `grpo-variants train --help`.")

    which = (f"the fields of variant '{spec.name}' ({spec.config_cls.__name__})" if variant_given else
             f"the fields of the default variant '{spec.name}' ({spec.config_cls.__name__}); "
             "`grpo-variants train --variant NAME --help` lists another variant's")
    parser = Parser(
        (_script_arguments_class(), spec.config_cls, ModelConfig, DatasetMixtureConfig),
        prog="grpo-variants train",
        description=f"Train with a GRPO-family variant, like `trl grpo`. Shown: {which}.",
        epilog="Flags override the --config YAML file, which overrides the defaults. Variants: grpo-variants list.",
    )
    parser.add_argument(
        "--config", default=None, help="YAML file of field: value (the keys of `trl grpo` configs; env: sets variables).")
    _fill_variant_help(parser, spec)
    return parser


def field_help(config_cls, name: str) -> str | None:
    """The help of field ``name``: its own metadata, else the nearest base dataclass's (a variant that
    redefines a field to set its paper's default keeps the meaning documented where the field was made)."""
    import dataclasses

    for cls in config_cls.__mro__:
        if not dataclasses.is_dataclass(cls):
            continue
        found = {f.name: f for f in dataclasses.fields(cls)}.get(name)
        if found is not None and found.metadata.get("help"):
            return found.metadata["help"]
    return None


def _fill_variant_help(parser, spec) -> None:
    """Every field of the variant's config shows a help text and its default in ``--help``.

    argparse prints ``(default: ...)`` only for options that have a help text, and a variant config
    redefines the fields whose paper default differs from TRL's without repeating their help. Those
    options get the base field's help, and a field whose variant default differs from ``trl.GRPOConfig``'s
    says so (``this variant's default; TRL's: ...``)."""
    import dataclasses

    from trl import GRPOConfig

    config_fields = {f.name: f for f in dataclasses.fields(spec.config_cls) if f.init}
    trl_fields = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}
    for action in parser._actions:
        if any(o.startswith(("--no_", "--no-")) for o in action.option_strings):  # a boolean field's negation
            action.help = f"Set {action.dest} to False.%(default).0s"  # (no "(default: False)" of the negation)
            continue
        field_ = config_fields.get(action.dest)
        if field_ is None:
            continue
        text = action.help or field_help(spec.config_cls, action.dest) or f"A field of {spec.config_cls.__name__}."
        trl_field = trl_fields.get(action.dest)
        if trl_field is not None:
            default, trl_default = _default_of(field_), _default_of(trl_field)
            if default != trl_default:
                text = f"{text} [{spec.name}'s default; TRL's: {trl_default!r}]"
        action.help = text.replace("%", "%%") if action.help is None else text


def _default_of(field_):
    import dataclasses

    if field_.default is not dataclasses.MISSING:
        return field_.default
    if field_.default_factory is not dataclasses.MISSING:
        return field_.default_factory()
    return None


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise UsageError(f"--config {path!r}: {err.strerror or err}.") from err
    except yaml.YAMLError as err:
        raise UsageError(f"--config {path!r} is not valid YAML: {str(err).splitlines()[0]}.") from err
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold a mapping of field: value.")
    return data


def _flag_names(argv: list[str]) -> set[str]:
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def _gather_repeated(argv: list[str], names=("--reward", "--reward_funcs")) -> list[str]:
    """``--reward a --reward b`` -> ``--reward a b`` (argparse keeps only the last of a repeated list flag)."""
    out, gathered = [], {n: [] for n in names}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in gathered:
            if "=" in arg:
                gathered[name].append(arg.split("=", 1)[1])
                i += 1
            else:
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    gathered[name].append(argv[i])
                    i += 1
            continue
        out.append(arg)
        i += 1
    for name, values in gathered.items():
        if values:
            out += [name, *values]
    return out


def _pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    out, value = [], None
    i = 0
    while i < len(argv):
        if argv[i] == name:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise UsageError(f"argument {name}: expected one argument. See `grpo-variants train --help`.")
            value = argv[i + 1]
            i += 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
            i += 1
            continue
        out.append(argv[i])
        i += 1
    return value, out


def cmd_list(_args) -> int:
    from grpo_variants.registry import list_variants
    from grpo_variants.rewards.registry import TRL_SCRIPT_REWARDS, list_rewards

    print("Variants:")
    for spec in list_variants():
        print(f"  {spec.name:<12} {spec.description}" + (f"  [{spec.paper}]" if spec.paper else ""))
    print("\nRewards:")
    for spec in list_rewards():
        print(f"  {spec.name:<22} {spec.description}")
    print(f"\nAlso accepted: TRL's {', '.join(TRL_SCRIPT_REWARDS)}, and any dotted import path "
          "(e.g. trl.rewards.accuracy_reward).")
    return 0


def cmd_train(argv: list[str]) -> int:
    from grpo_variants.registry import get_variant

    original_argv = list(argv)
    config_path, argv = _pop_option(list(argv), "--config")
    file_cfg = _read_yaml(config_path) if config_path else {}
    env = file_cfg.pop("env", None) or {}
    if not isinstance(env, dict):
        raise UsageError("`env` in the --config file must be a mapping of NAME: value.")
    os.environ.update({str(k): str(v) for k, v in env.items()})
    if "rewards" in file_cfg:  # older spelling of `reward`
        file_cfg.setdefault("reward", file_cfg.pop("rewards"))
    for key in ("reward", "reward_funcs"):
        if isinstance(file_cfg.get(key), str):
            file_cfg[key] = [file_cfg[key]]
    argv = _gather_repeated(argv)
    variant_flag, _ = _pop_option(list(argv), "--variant")
    variant_name = variant_flag or file_cfg.get("variant") or "grpo"
    spec = get_variant(str(variant_name))
    variant_given = bool(variant_flag or "variant" in file_cfg)
    file_cfg["variant"] = spec.name  # the canonical name (e.g. "mu-grpo" -> "mu_grpo")
    if variant_flag:
        argv = _pop_option(argv, "--variant")[1] + ["--variant", spec.name]
    parser = _parser(spec, variant_given=variant_given)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0

    user_keys = _flag_names(argv) | set(file_cfg)
    model_flag = _pop_option(list(argv), "--model")[0] or _pop_option(list(argv), "--model_name_or_path")[0]
    model_spec = model_flag or file_cfg.get("model") or file_cfg.get("model_name_or_path")
    is_toy = model_spec == "toy"
    announced = []
    if is_toy:
        toy_values = {k: v for k, v in TOY_DEFAULTS.items() if k not in user_keys}
        parser.set_defaults_with_config(**toy_values)
        announced = [f"{k}={v}" for k, v in toy_values.items()]
    unknown = parser.set_defaults_with_config(**file_cfg)
    if unknown:
        keys = [u[2:] for u in unknown[::2]]
        raise UsageError(f"--config {config_path!r}: unknown key(s) {keys}. See `grpo-variants train --help`.")
    try:
        outputs = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # HfArgumentParser: arguments no dataclass uses; our configs' own checks
        if isinstance(err, GRPOVariantsError):
            raise
        message = str(err)
        if "not used by the HfArgumentParser" in message:
            message = "unrecognized arguments: " + message.split(":", 1)[1].strip()
        raise UsageError(f"{message}. See `grpo-variants train --help`.") from err
    script, config, model_args, mixture = outputs[:4]
    return _run(spec, script, config, model_args, mixture, is_toy, announced, original_argv)


def _run(spec, script, config, model_args, mixture, is_toy, announced, original_argv) -> int:
    from trl import get_peft_config, get_quantization_config

    from grpo_variants.tasks import toy

    if script.model and model_args.model_name_or_path and script.model != model_args.model_name_or_path:
        raise UsageError(f"--model {script.model!r} and --model_name_or_path {model_args.model_name_or_path!r} differ; "
                         "give one of them.")
    model = script.model or model_args.model_name_or_path
    if script.dataset and script.dataset_name and script.dataset != script.dataset_name:
        raise UsageError(f"--dataset {script.dataset!r} and --dataset_name {script.dataset_name!r} differ; give one.")
    dataset_spec = script.dataset or script.dataset_name
    if model is None:
        raise UsageError("train needs --model (or --model_name_or_path): a folder, a hub id or 'toy'.")
    if dataset_spec is None and not mixture.datasets:
        raise UsageError("train needs --dataset (or --dataset_name, or `datasets:` in the --config file), e.g. toy.")
    rewards = list(script.reward or []) + list(script.reward_funcs or [])
    if script.reward_model_name_or_path:
        rewards.append(script.reward_model_name_or_path)
    # checked now: a missing checkpoint must fail before any model load or evaluation
    resume = inputs.resume_checkpoint(config.resume_from_checkpoint, config.output_dir)

    first_rank = int(os.environ.get("RANK", "0")) == 0  # under `accelerate launch`, say things once
    if announced and first_rank:
        print(f"--model toy: toy-sized defaults {', '.join(announced)} (set any of them to change it).")
    if is_toy:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the toy model loads in milliseconds
        task = dataset_spec.split(":", 1)[1] if dataset_spec and dataset_spec.startswith("toy:") else "addition"
        try:
            kit = toy.prepare(task=task)
        except ValueError as err:  # an unknown toy task
            raise UsageError(f"--dataset {dataset_spec!r}: {err}") from err
        model_path = kit.model_path
        if not rewards:
            rewards = ["toy_accuracy"]
            if first_rank:
                print("--model toy: reward toy_accuracy (pass --reward to choose another).")
    else:
        # a path, a hub id, or a registered name such as "smollm2", checked before any dataset loads
        model_path = inputs.resolve_model_path(model)
        if not rewards:
            raise UsageError("train needs at least one --reward NAME / --reward_funcs NAME (see `grpo-variants list`).")
        model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=config.trust_remote_code,
                                 attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
        model_init_kwargs.update(config.model_init_kwargs or {})
        config.model_init_kwargs = model_init_kwargs  # as `trl grpo` does

    # data: as `trl grpo` (a mixture, or dataset_name with its train/test splits), plus files and the toy kit
    eval_dataset = None
    if mixture.datasets:
        from trl import get_dataset

        data = get_dataset(mixture)
        train_dataset = data[script.dataset_train_split]
        if config.eval_strategy != "no" and script.dataset_test_split in data:
            eval_dataset = data[script.dataset_test_split]
    elif dataset_spec.startswith("toy") and is_toy:
        train_dataset = kit.train_dataset
    else:
        train_dataset = inputs.load_dataset(dataset_spec, script.dataset_train_split, script.dataset_config,
                                      script.dataset_streaming)
    if script.eval_dataset:
        eval_dataset = inputs.load_dataset(script.eval_dataset, script.dataset_test_split, script.dataset_config)
    elif eval_dataset is None and config.eval_strategy != "no" and dataset_spec and not dataset_spec.startswith("toy"):
        eval_dataset = inputs.load_dataset(dataset_spec, script.dataset_test_split, script.dataset_config)
    heldout = eval_dataset if eval_dataset is not None else (kit.eval_dataset if is_toy else None)
    if is_toy and config.eval_strategy != "no" and eval_dataset is None:
        eval_dataset = kit.eval_dataset

    extra = {}
    quantization = get_quantization_config(model_args)
    if quantization is not None:
        extra["quantization_config"] = quantization
    trainer = spec.trainer_cls(model=model_path, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                               eval_dataset=eval_dataset, peft_config=get_peft_config(model_args), **extra)
    trainer.run_record.print_summary = False  # the table below adds the held-out rows and the model
    toy_eval = is_toy and script.toy_eval and heldout is not None
    before = toy.evaluate(model_path, heldout) if toy_eval else None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        return _interrupted(config, original_argv, 130)
    except SystemExit as exc:
        if exc.code == 143:  # SIGTERM after its checkpoint (save_on_signal)
            return _interrupted(config, original_argv, 143)
        raise
    trainer.save_model(config.output_dir)
    after = toy.evaluate(trainer.model, heldout, trainer.processing_class) if toy_eval else None
    if toy_eval:  # the before / after points on reward_curve.png
        trainer.run_record.record_heldout(before, after, f"held-out greedy accuracy ({len(heldout)} problems)")
    if trainer.is_world_process_zero():
        _print_summary(spec, trainer, before, after, heldout)
    return 0


def _print_summary(spec, trainer, before, after, heldout) -> None:
    from grpo_variants.console import RESUMED_HEAD, run_title, summary_rows, summary_table

    record = trainer.run_record
    rows = summary_rows(record.this_run_records())
    rows = [r for r in rows if not r[0].startswith("held-out")]
    if before is not None:
        rows.insert(0, (f"held-out greedy accuracy ({len(heldout)} problems)", f"{before:.1%}", f"{after:.1%}"))
    out = trainer.args.output_dir
    files = [p.name for p in trainer.run_record.written]
    head = ("before", "after") if before is not None else RESUMED_HEAD if record.start_step else ("first", "last")
    print(summary_table(run_title(spec.name, trainer.state.global_step, record.start_step), rows, record.seconds,
                        f"{out}/ (model, {', '.join(files)})", head=head), flush=True)


def _interrupted(config, original_argv, code: int) -> int:
    from grpo_variants.reliability import latest_complete_checkpoint

    checkpoint = latest_complete_checkpoint(config.output_dir) if Path(config.output_dir).is_dir() else None
    if checkpoint is None:
        print("\ninterrupted before any checkpoint was written; nothing to resume.", file=sys.stderr)
        return code
    argv = list(original_argv)
    _, argv = _pop_option(argv, "--resume_from_checkpoint")
    command = shlex.join(["grpo-variants", "train", *argv, "--resume_from_checkpoint", checkpoint])
    print(f"\ninterrupted: checkpoint saved at {checkpoint}\nresume with: {command}", file=sys.stderr)
    return code


def cmd_demo(argv: list[str]) -> int:
    from grpo_variants.demo import main as demo_main

    return demo_main(argv)


def cmd_vllm_serve(argv: list[str]) -> int:
    """vLLM's own server for ``vllm_mode="server"``, with a weight sync that works without CUDA (docs/vllm.md)."""
    from grpo_variants.rollout.vllm_server import main as serve_main

    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: grpo-variants {list,train,demo,vllm-serve} [options]   (grpo-variants train --help for the "
             "fields)")
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
        if command == "vllm-serve":
            return cmd_vllm_serve(rest)
    except GRPOVariantsError as err:
        print(f"grpo-variants {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ngrpo-variants {command}: interrupted.", file=sys.stderr)
        return 130
    print(f"grpo-variants: unknown command {command!r}. {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
