"""The toy demo: GRPO on the offline toy kit, on CPU, in a few minutes.

    grpo-variants demo [--output_dir outputs/demo] [--max_steps 120] [--variant grpo]

1. builds (or reuses) the warm-started toy policy (a tiny Qwen2 model saved to disk);
2. measures held-out greedy accuracy on 500 unseen problems;
3. trains it with the variant (default GRPO: group-std advantage, clip 0.2, seq-mean-token-mean, k3 KL),
   keeping the variant's own defaults (beta included) except toy-sized batch, length and learning rate,
   which it names in one line;
4. measures held-out accuracy again, and writes the run's record to the output folder:
   ``metrics.jsonl``, ``trainer_state.json``, ``reward_curve.png``, ``README.md`` (model card),
   ``summary.json`` and the trained model in ``final_model/``.

The console shows a progress bar with a few live metrics and a summary table at the end;
``--verbose`` prints every log record as a dict instead (transformers' default).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-variants demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--variant", default="grpo")
    parser.add_argument("--max_steps", type=int, default=120)
    parser.add_argument("--learning_rate", type=float, default=1e-4,
                        help="1e-4: the toy policy's step (the papers' 1e-6 does not move 1M parameters)")
    parser.add_argument("--beta", type=float, default=None, help="KL coefficient (default: the variant's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--verbose", action="store_true", help="print every log record (a dict per step)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


def run(args) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from grpo_variants import get_variant, toy
    from grpo_variants.callbacks import ToyEvalCallback, plot_reward_curve, read_jsonl
    from grpo_variants.console import summary_table

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    if not args.verbose:
        hf_logging.disable_progress_bar()  # the toy model loads and saves in milliseconds: no bars for that

    print("== grpo-variants demo: toy arithmetic (two-digit addition), CPU only, no downloads ==")
    spec = get_variant(args.variant)  # a bad variant or value fails here, before the model is evaluated
    config, line = demo_config(spec, args, out)
    started = time.perf_counter()
    kit = toy.prepare(task="addition")
    tokenizer = kit.tokenizer
    print(f"toy policy: {kit.model_path} (warm start: {kit.warmstart.get('steps')} supervised steps)")
    before = toy.evaluate(kit.model_path, kit.eval_dataset)
    n_eval = len(kit.eval_dataset)
    print(f"held-out greedy accuracy before {args.variant}: {before:.1%} on {n_eval} unseen problems")
    print(line)
    trainer = spec.trainer_cls(
        model=kit.model_path,
        reward_funcs="toy_accuracy",
        args=config,
        train_dataset=kit.train_dataset,
        callbacks=[ToyEvalCallback(kit.eval_dataset, tokenizer, every=args.eval_every)],
    )
    trainer.run_record.print_summary = False  # one table below, with the held-out rows
    trainer.train()
    after = toy.evaluate(trainer.model, kit.eval_dataset, tokenizer)
    trainer.save_model(str(out / "final_model"))
    paths = trainer.run_record.paths()
    # the record starts at step 0 with the starting model's held-out accuracy, and the plot shows it
    records = [{"step": 0, "wall_seconds": 0.0, "eval_toy_accuracy": before}] + read_jsonl(paths["metrics.jsonl"])
    paths["metrics.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_reward_curve(records, paths["reward_curve.png"], title=f"{spec.name} on the toy task",
                      heldout={"before": before, "after": after, "after_step": trainer.state.global_step,
                               "label": f"held-out greedy accuracy ({n_eval} problems)"})
    seconds = round(time.perf_counter() - started, 1)
    summary = {
        "variant": spec.name,
        "heldout_accuracy_before": before,
        "heldout_accuracy_after": after,
        "heldout_problems": n_eval,
        "max_steps": args.max_steps,
        "seconds": seconds,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    train_rewards = [r["reward"] for r in records if r.get("reward") is not None]
    rows = [(f"held-out greedy accuracy ({n_eval} problems)", f"{before:.1%}", f"{after:.1%}")]
    if train_rewards:
        rows.append(("mean training reward (first / last step)", f"{train_rewards[0]:.3f}", f"{train_rewards[-1]:.3f}"))
    steps = trainer.state.global_step
    print(summary_table(f"== {spec.name}: {steps} step{'' if steps == 1 else 's'} of 256 completions ==", rows, seconds,
                        f"{out}/ (metrics.jsonl, reward_curve.png, summary.json, README.md, final_model/)",
                        head=("before", "after")))
    return 0


def demo_config(spec, args, out):
    """``(config, line)``: the variant's config with the demo's toy-sized settings, and the one line naming them.

    Toy-sized settings go on top of the variant's defaults; every other field (beta, clip, aggregation, ...)
    stays the variant's (its paper's), and ``line`` names what the demo overrides.
    """
    toy_settings = dict(
        per_device_train_batch_size=256,  # completions per step: 32 prompts x 8
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
    )
    if args.beta is not None:
        toy_settings["beta"] = args.beta
    config = spec.config_cls(
        output_dir=str(out),
        max_steps=args.max_steps,
        **toy_settings,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=False,
        gradient_checkpointing=False,
        verbose=args.verbose,
    )
    return config, demo_overrides_line(spec, toy_settings)


def demo_overrides_line(spec, settings: dict) -> str:
    """One line naming the demo's settings that differ from the variant's defaults (its paper's values)."""
    from dataclasses import MISSING, fields

    defaults = {f.name: (f.default if f.default is not MISSING else None) for f in fields(spec.config_cls) if f.init}
    changed = [f"{k}={v!r} (variant: {defaults.get(k)!r})" for k, v in settings.items() if defaults.get(k) != v]
    kept = "beta" not in settings
    beta = f"; beta={defaults.get('beta')!r} as the variant sets it" if kept else ""
    return (f"demo: toy-sized settings over {spec.name}'s defaults: " + (", ".join(changed) or "none")
            + f"{beta}; every other field is {spec.name}'s.")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
