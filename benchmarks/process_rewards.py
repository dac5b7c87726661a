"""Process supervision and the adaptive KL coefficient on the chain-of-thought toy task (issue #28).

Two studies at an equal generated-token budget per run (a run stops at the first optimizer step that reaches
``--budget-tokens``), 3 seeds each, written to benchmarks/results/process_rewards.{json,md,png}:

* **Supervision** (beta = 0): ``outcome`` (``toy_chain_accuracy``: 1/0 on the final answer), ``process_sum``
  (``toy_chain_steps``: 1/0 per partial sum and for the final answer, DeepSeekMath's sum-form credit),
  ``process_min`` (the same steps, PURE's min-form credit) and ``outcome_process`` (both reward functions,
  A = A_outcome + A_process, sum-form).
* **KL weight** (``--kl-reward``: the outcome reward, or outcome + process): fixed beta in {0, 0.01, 0.04, 0.16}
  (beta = 0 is that supervision arm above) and ``kl_target`` (adaptive beta from 0.04, horizon ``--kl-horizon``
  sequences).

Held-out greedy decoding on ``--eval-problems`` problems of the chain task's eval split: accuracy, the share of
completions whose final answer is right while a stated partial sum is wrong ("right for the wrong reason",
:func:`grpo_variants.tasks.toy_reasoning.audit_trace`), mean completion length and steps per completion; the
mean KL per token of the run's last steps and the adaptive run's beta trajectory.

    python benchmarks/process_rewards.py                         # the committed study
    python benchmarks/process_rewards.py --quick                 # pipeline check: 1 seed, tiny budget, temp folder
    python benchmarks/process_rewards.py --arms kl_target --kl-target 0.05 --kl-horizon 32 \
        --stem process_rewards_kl_target_0.05                   # another adaptive-KL setting
    python benchmarks/process_rewards.py --arms kl_target --kl-target 0.03 --kl-horizon 512 --kl-beta-min 0.04 \
        --batch 128 --max-steps 40 --budget-tokens 1000000 --eval-problems 500 \
        --stem process_rewards_kl_target_0.03_h512_min0.04    # ... with beta's start as its floor
    python benchmarks/process_rewards.py --stem process_rewards_kl \
        --merge process_rewards_kl_target_0.03_h512_min0.04    # join it to the KL grid (same recipe)
    python benchmarks/process_rewards.py --rewrite               # md / png again from the committed JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import _bench  # noqa: E402, F401  (the offline environment, before torch / transformers)

# The shared recipe: the reasoning benchmark's (8 completions per prompt, lr 1e-4 constant, temperature 0.7),
# with 4 prompts per step instead of 8 (a 2-core machine shared by several jobs).
SHARED = dict(per_device_train_batch_size=32, num_generations=8, learning_rate=1e-4, lr_scheduler_type="constant",
              temperature=0.7, epsilon=0.2, epsilon_high=None, steps_per_generation=1)

SUPERVISION_ARMS = {
    "outcome": dict(rewards=["toy_chain_accuracy"], fields=dict(beta=0.0)),
    "process_sum": dict(rewards=["toy_chain_steps"], fields=dict(beta=0.0, process_credit="sum")),
    "process_min": dict(rewards=["toy_chain_steps"], fields=dict(beta=0.0, process_credit="min")),
    "outcome_process": dict(rewards=["toy_chain_accuracy", "toy_chain_steps"],
                            fields=dict(beta=0.0, process_credit="sum")),
}
KL_TARGET = 0.01  # KL per token the adaptive arm aims at
KL_REWARD = "outcome"  # the supervision arm the KL grid adds beta to: "outcome" or "outcome_process"


ADAPTIVE = re.compile(r"kl_target_(?P<target>[0-9.e-]+?)(?:_h(?P<horizon>[0-9.e+]+?))?(?:_min(?P<floor>[0-9.e-]+))?$")


def target_of(arm: str) -> float | None:
    """The KL target of an adaptive arm: ``kl_target`` (this run's ``--kl-target``) or
    ``kl_target_<t>[_h<H>][_min<b>]`` (an arm merged in from a run with target t, ``--merge``)."""
    if arm == "kl_target":
        return KL_TARGET
    m = ADAPTIVE.match(arm)
    return float(m["target"]) if m else None


def horizon_of(arm: str, meta: dict) -> float:
    """The horizon of an adaptive arm: ``kl_target_<t>_h<H>`` names its own, else the study's."""
    m = ADAPTIVE.match(arm)
    return float(m["horizon"]) if m and m["horizon"] else meta["kl_horizon"]


def floor_of(arm: str, meta: dict) -> float | None:
    """The lower bound of an adaptive arm's beta (``kl_beta_min``): ``_min<b>`` in its name, else the study's
    (None: the config's default, 1e-4)."""
    m = ADAPTIVE.match(arm)
    return float(m["floor"]) if m and m["floor"] else meta.get("kl_beta_min")


def adaptive_name(meta: dict, study: dict) -> str:
    """The name a study's ``kl_target`` arm takes when merged into ``study``: its target, then its horizon and
    its beta floor where they differ from the study's."""
    name = f"kl_target_{meta['kl_target']:g}"
    if meta["kl_horizon"] != study["kl_horizon"]:
        name += f"_h{meta['kl_horizon']:g}"
    if meta.get("kl_beta_min") != study.get("kl_beta_min"):
        name += f"_min{meta['kl_beta_min']:g}"
    return name


def kl_arms(horizon: float, beta_min: float | None = None) -> dict:
    """The KL grid on the ``KL_REWARD`` supervision arm (its beta = 0 run is that arm itself)."""
    base = SUPERVISION_ARMS[KL_REWARD]
    arms = {f"beta_{b:g}": dict(rewards=list(base["rewards"]), fields={**base["fields"], "beta": b})
            for b in (0.01, 0.04, 0.16)}
    arms["kl_target"] = dict(rewards=list(base["rewards"]),
                             fields={**base["fields"], "beta": 0.04, "kl_target": KL_TARGET, "kl_horizon": horizon,
                                     **({} if beta_min is None else {"kl_beta_min": beta_min})})
    return arms


class TokenBudget:
    """Stop training at the first optimizer step whose generated tokens reach the budget."""

    def __new__(cls, trainer, budget: int):
        from transformers import TrainerCallback

        class _Budget(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if trainer._tokens_generated_total >= budget:
                    control.should_training_stop = True

        return _Budget()


def evaluate_traces(model, tokenizer, dataset, max_new_tokens: int, batch_size: int = 200) -> dict:
    """Greedy held-out decoding: accuracy, 'right for the wrong reason' share, mean length and steps."""
    import torch

    from grpo_variants.tasks import toy
    from grpo_variants.tasks.toy_reasoning import audit_trace, operands_of, trace_steps

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts = list(dataset["prompt"])
    answers = list(dataset["answer"])
    right, rfwr, lengths, steps = [], [], [], []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                batch = prompts[start : start + batch_size]
                rendered = [toy._render(p, tokenizer) for p in batch]
                enc = tokenizer(rendered, return_tensors="pt", padding=True, padding_side="left").to(device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                     top_k=None, top_p=None, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
                completion = out[:, enc["input_ids"].shape[1] :]
                texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
                for p, text, gold, ids in zip(batch, texts, answers[start : start + batch_size], completion,
                                              strict=True):
                    audit = audit_trace(operands_of(p), text, gold)
                    right.append(audit["final_right"])
                    rfwr.append(audit["right_for_wrong_reason"])
                    eos = (ids == tokenizer.eos_token_id).nonzero()
                    lengths.append(int(eos[0]) + 1 if eos.numel() else ids.numel())
                    steps.append(len(trace_steps(text)))
    finally:
        model.train(was_training)
    n = len(right)
    acc = sum(right) / n
    return {"accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / n), "problems": n,
            "right_for_wrong_reason": sum(rfwr) / n,
            "right_for_wrong_reason_of_right": sum(rfwr) / max(sum(right), 1),
            "mean_length": sum(lengths) / n, "mean_steps": sum(steps) / n}


def run_arm(kit, name: str, arm: dict, seed: int, args) -> dict:
    import torch

    from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer
    from _bench import toy_run_config

    torch.manual_seed(seed)
    values = toy_run_config(tempfile.mkdtemp(prefix=f"process-{name}-"), seed, SHARED["per_device_train_batch_size"],
                            SHARED["num_generations"], SHARED["learning_rate"],
                            **{k: v for k, v in SHARED.items() if k not in ("per_device_train_batch_size",
                                                                            "num_generations", "learning_rate")},
                            max_completion_length=kit.max_completion_length, max_steps=args.max_steps,
                            save_strategy="no", logging_steps=1, disable_tqdm=True, **arm["fields"])
    trainer = GRPOVariantTrainer(model=kit.model_path, reward_funcs=list(arm["rewards"]),
                                 args=GRPOVariantConfig(**values), train_dataset=kit.train_dataset)
    trainer.add_callback(TokenBudget(trainer, args.budget_tokens))
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    result = evaluate_traces(trainer.model, trainer.processing_class,
                             kit.eval_dataset.select(range(args.eval_problems)),
                             kit.max_completion_length)
    history = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    last = history[-max(1, len(history) // 3):]  # the last third of the steps
    kls = [r["kl"] for r in last if "kl" in r]
    result.update({
        "arm": name, "seed": seed, "steps": trainer.state.global_step,
        "generated_tokens": int(trainer._tokens_generated_total), "train_wall_seconds": round(wall, 1),
        "train_cpu_seconds": round(cpu, 1),
        "kl_last_third": sum(kls) / len(kls) if kls else None,
        "beta_trajectory": [r["kl_ctl/beta"] for r in history if "kl_ctl/beta" in r],
        "kl_trajectory": [r.get("kl") for r in history],
        "reward_trajectory": [r.get("reward") for r in history],
    })
    print(f"[process_rewards] {name} seed {seed}: acc {result['accuracy']:.3f} "
          f"rfwr {result['right_for_wrong_reason']:.3f} "
          f"steps {result['steps']} tokens {result['generated_tokens']} kl {result['kl_last_third']} "
          f"cpu {cpu:.0f}s wall {wall:.0f}s", flush=True)
    return result


def summarise(runs: list[dict]) -> dict:
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], []).append(r)
    out = {}
    for arm, rs in by_arm.items():
        def stat(key):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if not vals:
                return None, None
            mean = sum(vals) / len(vals)
            se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else None
            return mean, se

        row = {"seeds": [r["seed"] for r in rs]}
        for key in ("accuracy", "right_for_wrong_reason", "right_for_wrong_reason_of_right", "mean_length",
                    "mean_steps", "kl_last_third", "generated_tokens", "steps", "train_cpu_seconds"):
            row[key], row[key + "_se"] = stat(key)
        betas = [r["beta_trajectory"][-1] for r in rs if r["beta_trajectory"]]
        row["final_beta"] = sum(betas) / len(betas) if betas else None
        out[arm] = row
    return out


def fmt(mean, se, pct=True):
    if mean is None:
        return "-"
    scale = 100 if pct else 1
    text = f"{scale * mean:.1f}" if pct else f"{mean:.4f}"
    if se is not None:
        text += f" ± {scale * se:.1f}" if pct else f" ± {se:.4f}"
    return text + ("%" if pct else "")


def write_outputs(result: dict, out: Path, stem: str) -> None:
    summary, meta = result["summary"], result["meta"]
    sh = meta.get("shared", SHARED)
    start = result["initial"]
    lines = [
        "# Process supervision and adaptive KL on the chain toy task", "",
        f"{meta['created']} · {len(meta['seeds'])} seeds · budget {meta['budget_tokens']:,} generated tokens per run "
        f"(stops at the first step past it; at most {meta['max_steps']} steps) · "
        f"{sh['per_device_train_batch_size']} "
        f"completions per step (G = {sh['num_generations']}), lr {sh['learning_rate']}, temperature "
        f"{sh['temperature']} · held-out greedy on {meta['eval_problems']} problems · mean ± standard error "
        "over seeds (sizes and machine load: 'Budget').", "",
        f"Start (warm-started policy): accuracy {100 * start['accuracy']:.1f}%, right for the wrong reason "
        f"{100 * start['right_for_wrong_reason']:.1f}%, {start['mean_steps']:.2f} steps / completion, mean length "
        f"{start['mean_length']:.1f} tokens.", "",
    ]
    if any(arm in summary for arm in SUPERVISION_ARMS):
        lines += [
            "## Supervision (beta = 0)", "",
            "| arm | held-out accuracy | right for the wrong reason (share of all) | of right answers | steps / "
            "completion | length | steps trained |", "|---|---|---|---|---|---|---|",
        ]
    for arm in SUPERVISION_ARMS:
        s = summary.get(arm)
        if not s:
            continue
        lines.append(f"| {arm} | {fmt(s['accuracy'], s['accuracy_se'])} | "
                     f"{fmt(s['right_for_wrong_reason'], s['right_for_wrong_reason_se'])} | "
                     f"{fmt(s['right_for_wrong_reason_of_right'], s['right_for_wrong_reason_of_right_se'])} | "
                     f"{s['mean_steps']:.2f} | {s['mean_length']:.1f} | {s['steps']:.1f} |")
    lines += ["", f"## KL weight ({KL_REWARD.replace('_', ' + ')} reward)", "",
              f"| arm | seeds | held-out accuracy | KL per token (last third of steps) | final beta |",
              "|---|---|---|---|---|"]
    adaptive = sorted((a for a in summary if target_of(a) is not None), key=target_of)
    for arm in [KL_REWARD] + [a for a in kl_arms(meta["kl_horizon"]) if target_of(a) is None] + adaptive:
        s = summary.get(arm)
        if not s:
            continue
        label = f"beta_0 (= {KL_REWARD})" if arm == KL_REWARD else arm
        if target_of(arm) is not None:
            floor = floor_of(arm, meta)
            label = (f"kl_target = {target_of(arm):g} (beta from 0.04, H = {horizon_of(arm, meta):g}"
                     + ("" if floor is None else f", kl_beta_min = {floor:g}") + ")")
        lines.append(f"| {label} | {len(s['seeds'])} | {fmt(s['accuracy'], s['accuracy_se'])} | "
                     f"{fmt(s['kl_last_third'], s['kl_last_third_se'], pct=False)} | "
                     f"{'-' if s['final_beta'] is None else format(s['final_beta'], '.4f')} |")
    lines += ["", "## Findings", ""] + [f"- {f}" for f in result["findings"]]
    lines += ["", "## Budget", "", result["budget_note"], "",
              f"Rerun: `python benchmarks/process_rewards.py --budget-tokens {meta['budget_tokens']} --seeds "
              f"{','.join(str(s) for s in meta['seeds'])} --eval-problems {meta['eval_problems']} --kl-target "
              f"{meta['kl_target']} --kl-horizon {meta['kl_horizon']:g}"
              + (f" --batch {meta['shared']['per_device_train_batch_size']}"
                 if meta["shared"]["per_device_train_batch_size"] != 32 else "")
              + f" --max-steps {meta['max_steps']}"
              + (f" --kl-reward {meta['kl_reward']}" if meta.get("kl_reward", "outcome") != "outcome" else "")
              + (f" --kl-beta-min {meta['kl_beta_min']:g}" if meta.get("kl_beta_min") is not None else "")
              + (f" --arms {meta['arms']}" if meta.get("arms") else "")
              + (f" --stem {stem}" if stem != "process_rewards" else "") + "`."]
    for m in meta.get("merged", []):
        others = [a for a in (m.get("arms") or "kl_target").split(",") if a != "kl_target"]
        lines.append(f"Merged in (`--merge {m['stem']}`): "
                     + (f"seeds {','.join(map(str, m['seeds']))} of {', '.join(others)} and " if others else "")
                     + f"the adaptive arm with target {m['kl_target']:g}, horizon "
                     f"{m['kl_horizon']:g}"
                     + ("" if m.get("kl_beta_min") is None else f", beta floor {m['kl_beta_min']:g}")
                     + f", run {m['created']} with the same recipe "
                     f"(`--kl-target {m['kl_target']:g} --kl-horizon {m['kl_horizon']:g} "
                     + ("" if m.get("kl_beta_min") is None else f"--kl-beta-min {m['kl_beta_min']:g} ")
                     + (f"--seeds {','.join(map(str, m['seeds']))} " if m.get("seeds", [0, 1, 2]) != [0, 1, 2] else "")
                     + f"--arms {m.get('arms') or 'kl_target'} --stem {m['stem']}`).")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        arms = [a for a in SUPERVISION_ARMS if a in summary]
        xs = range(len(arms))
        axes[0].bar(xs, [100 * summary[a]["accuracy"] for a in arms],
                    yerr=[100 * (summary[a]["accuracy_se"] or 0) for a in arms], color="tab:blue", label="accuracy")
        axes[0].bar(xs, [100 * summary[a]["right_for_wrong_reason"] for a in arms], color="tab:red", alpha=0.8,
                    label="right for the wrong reason")
        axes[0].axhline(100 * start["accuracy"], color="gray", ls="--", label="start")
        axes[0].set_xticks(list(xs), arms, rotation=15)
        axes[0].set_ylabel("held-out %")
        axes[0].set_title("supervision (beta = 0)")
        axes[0].legend(fontsize=8)
        karms = [a for a in [KL_REWARD] + [a for a in kl_arms(meta["kl_horizon"]) if target_of(a) is None]
                 if a in summary] + sorted((a for a in summary if target_of(a) is not None), key=target_of)
        axes[1].bar(range(len(karms)), [100 * summary[a]["accuracy"] for a in karms],
                    yerr=[100 * (summary[a]["accuracy_se"] or 0) for a in karms], color="tab:green")
        axes[1].axhline(100 * start["accuracy"], color="gray", ls="--")
        axes[1].set_xticks(list(range(len(karms))), ["beta_0" if a == KL_REWARD else a for a in karms],
                           rotation=30 if len(karms) > 6 else 15, ha="right", fontsize=7 if len(karms) > 6 else 9)
        axes[1].set_ylabel("held-out accuracy %")
        axes[1].set_title("KL weight")
        colors = ("tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:orange", "tab:pink", "tab:blue",
                  "tab:red")
        for k, arm in enumerate(sorted((a for a in summary if target_of(a) is not None), key=target_of)):
            color = colors[k % len(colors)]
            for r in result["runs"]:
                if r["arm"] == arm and r["beta_trajectory"]:
                    axes[2].plot(r["beta_trajectory"], color=color, alpha=0.7)
                    kl = [x if x is not None else float("nan") for x in r["kl_trajectory"]]
                    axes[2].plot([x * 4 for x in kl], color=color, alpha=0.35, ls=":")
            axes[2].axhline(4 * target_of(arm), color=color, ls="--", label=arm)
        axes[2].legend(fontsize=6 if len(karms) > 6 else 8)
        axes[2].set_yscale("log")
        axes[2].set_title("adaptive: beta (solid), 4 x KL (dotted), 4 x target (dashed); log", fontsize=9)
        axes[2].set_xlabel("optimizer step")
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=90)
        plt.close(fig)
    except Exception as err:  # noqa: BLE001
        print(f"[process_rewards] no plot: {err}")


def findings(summary: dict) -> list[str]:
    out = []
    get = lambda a, k="accuracy": (summary.get(a) or {}).get(k)  # noqa: E731
    se = lambda a, k="accuracy": (summary.get(a) or {}).get(k + "_se") or 0.0  # noqa: E731
    if get("outcome") is not None:
        for arm in ("process_sum", "process_min", "outcome_process"):
            if get(arm) is None:
                continue
            diff = get(arm) - get("outcome")
            joint = math.sqrt(se(arm) ** 2 + se("outcome") ** 2)
            verdict = ("(one seed, no s.e.) differs from" if joint == 0 else "beats" if diff > joint
                       else "trails" if diff < -joint else "is within one joint s.e. of")
            out.append(f"{arm} {verdict} outcome-only: {100 * diff:+.1f} points (joint s.e. {100 * joint:.1f}).")
    if get("process_sum") is not None and get("process_min") is not None:
        d = get("process_sum", "mean_steps") - get("process_min", "mean_steps")
        out.append(f"steps per held-out completion: sum-form {get('process_sum', 'mean_steps'):.2f} vs min-form "
                   f"{get('process_min', 'mean_steps'):.2f} ({d:+.2f}); right for the wrong reason "
                   f"{100 * get('process_sum', 'right_for_wrong_reason'):.1f}% vs "
                   f"{100 * get('process_min', 'right_for_wrong_reason'):.1f}%.")
    if get("outcome") is not None and get("process_sum") is not None:
        beats = [a for a in ("process_sum", "process_min", "outcome_process") if get(a) is not None
                 and get(a) - get("outcome") > math.sqrt(se(a) ** 2 + se("outcome") ** 2) > 0]
        out.append("DeepSeekMath's finding (process supervision beats outcome supervision for GRPO): "
                   + (f"reproduced here only by {', '.join(beats)}" if beats else "not reproduced at this budget")
                   + " (differences of a few points over 3 seeds; the outcome arm itself ended below the start).")
        more_steps = get("process_sum", "mean_steps") - get("outcome", "mean_steps")
        more_rfwr = get("process_sum", "right_for_wrong_reason") - get("outcome", "right_for_wrong_reason")
        hacked = more_steps > 0.25 or more_rfwr > se("process_sum", "right_for_wrong_reason") + \
            se("outcome", "right_for_wrong_reason")
        out.append("PURE's finding (sum-form credit invites reward hacking: more, easier steps): "
                   + ("signs of it" if hacked else "not reproduced at this budget")
                   + f": the sum-form policy writes {get('process_sum', 'mean_steps'):.2f} steps per completion vs "
                   f"{get('outcome', 'mean_steps'):.2f} for outcome-only ({more_steps:+.2f}) and is right for the "
                   "wrong "
                   f"reason {100 * get('process_sum', 'right_for_wrong_reason'):.1f}% vs "
                   f"{100 * get('outcome', 'right_for_wrong_reason'):.1f}% of the time.")
    fixed = [a for a in (KL_REWARD, "beta_0.01", "beta_0.04", "beta_0.16") if get(a) is not None]
    for arm in sorted((a for a in summary if target_of(a) is not None), key=target_of):
        target, kl = target_of(arm), get(arm, "kl_last_third")
        near = kl is not None and 1 / 1.5 <= kl / target <= 1.5
        kl_text = (f"KL per token {kl:.4f} over the last third of the steps for a target of {target:g} ("
                   + ("near it: within a factor 1.5)" if near else
                      f"not near it: {kl / target:.1f} x the target; final beta "
                      f"{get(arm, 'final_beta'):.3f})"))
        if fixed:
            best = max(fixed, key=lambda a: get(a))
            gap = get(arm) - get(best)
            within = abs(gap) <= max(se(best), se(arm))
            joint = math.sqrt(se(best) ** 2 + se(arm) ** 2)
            closest = min(fixed[1:] or fixed, key=lambda a: abs(math.log((get(a, "kl_last_third") or 1e-9) / kl)))
            out.append(f"{arm}: {100 * get(arm):.1f}% vs best fixed ({best}) {100 * get(best):.1f}%: "
                       f"{'within' if within else 'not within'} one standard error ({100 * gap:+.1f} points; s.e. "
                       f"{100 * se(arm):.1f} over {len(summary[arm]['seeds'])} seeds vs {100 * se(best):.1f} over "
                       f"{len(summary[best]['seeds'])}; joint s.e. {100 * joint:.1f}); "
                       + kl_text + f"; the fixed beta with the nearest KL is {closest} ("
                       f"KL {get(closest, 'kl_last_third') or 0:.4f}, accuracy {100 * get(closest):.1f}%).")
        else:
            out.append(f"{arm}: held-out accuracy {100 * get(arm):.1f}% ± "
                       f"{100 * se(arm):.1f}; " + kl_text + ".")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-tokens", type=int, default=12000)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--kl-horizon", type=float, default=64.0)
    parser.add_argument("--kl-target", type=float, default=0.01, help="KL per token the adaptive arm aims at")
    parser.add_argument("--kl-beta-min", type=float, default=None,
                        help="the adaptive arm's lower bound on beta (kl_beta_min; default: the config's, 1e-4)")
    parser.add_argument("--batch", type=int, default=SHARED["per_device_train_batch_size"],
                        help="completions per optimizer step (prompts x G = 8)")
    parser.add_argument("--kl-reward", default="outcome", choices=("outcome", "outcome_process"),
                        help="the supervision the KL grid runs on (its beta = 0 arm)")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    parser.add_argument("--quick", action="store_true", help="pipeline check: seed 0, 1500 tokens, 40 problems")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--stem", default=None)
    parser.add_argument("--rewrite", action="store_true", help="rewrite the md / png from the committed JSON")
    parser.add_argument("--merge", default=None,
                        help="comma-separated stems of studies on the same kit and recipe whose runs join --stem's "
                             "(their kl_target arm becomes kl_target_<target>); then rewrite")
    args = parser.parse_args()
    if args.rewrite or args.merge:
        stem = args.stem or "process_rewards"
        result = json.loads((Path(args.out) / f"{stem}.json").read_text())
        globals()["KL_TARGET"] = result["meta"]["kl_target"]
        globals()["KL_REWARD"] = result["meta"].get("kl_reward", "outcome")
        for other in (args.merge.split(",") if args.merge else []):
            if other in [m["stem"] for m in result["meta"].get("merged", [])]:
                raise SystemExit(f"--merge {other}: already merged into {stem}")
            extra = json.loads((Path(args.out) / f"{other}.json").read_text())
            for key in ("shared", "max_steps", "budget_tokens", "eval_problems", "kl_reward"):
                if extra["meta"].get(key) != result["meta"].get(key):
                    raise SystemExit(f"--merge {other}: its {key} {extra['meta'].get(key)!r} differs from "
                                     f"{stem}'s {result['meta'].get(key)!r}")
            if extra["initial"]["accuracy"] != result["initial"]["accuracy"]:
                raise SystemExit(f"--merge {other}: another start policy (initial accuracy differs)")
            for blob in (result, extra):  # name every adaptive arm by its target (and horizon, if another)
                for run in blob["runs"]:
                    if run["arm"] == "kl_target":
                        run["arm"] = adaptive_name(blob["meta"], result["meta"])
            result["runs"] += extra["runs"]
            result["meta"].setdefault("merged", []).append(
                {"stem": other, "kl_target": extra["meta"]["kl_target"], "kl_horizon": extra["meta"]["kl_horizon"],
                 "kl_beta_min": extra["meta"].get("kl_beta_min"), "arms": extra["meta"].get("arms"),
                 "seeds": extra["meta"]["seeds"],
                 "created": extra["meta"]["created"],
                 "wall_seconds": extra["meta"]["wall_seconds"]})
        result["summary"] = summarise(result["runs"])
        result["findings"] = findings(result["summary"])
        (Path(args.out) / f"{stem}.json").write_text(json.dumps(result, indent=1))
        write_outputs(result, Path(args.out), stem)
        print("\n".join(result["findings"]))
        return
    if args.quick:  # a pipeline check: written to a temporary folder unless --out says otherwise
        args.budget_tokens, args.seeds, args.eval_problems, args.max_steps = 1500, "0", 40, 3
        if args.out == str(HERE / "results"):
            args.out = tempfile.mkdtemp(prefix="process-rewards-quick-")
    stem = args.stem or ("process_rewards_quick" if args.quick else "process_rewards")
    globals()["KL_TARGET"] = args.kl_target
    globals()["KL_REWARD"] = args.kl_reward
    SHARED["per_device_train_batch_size"] = args.batch
    seeds = [int(s) for s in args.seeds.split(",")]
    import torch

    from grpo_variants.tasks import toy

    torch.set_num_threads(1)
    kit = toy.prepare(task="chain", verbose=False)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kit.model_path)
    initial = evaluate_traces(AutoModelForCausalLM.from_pretrained(kit.model_path), tokenizer,
                              kit.eval_dataset.select(range(args.eval_problems)), kit.max_completion_length)
    print(f"[process_rewards] start: {initial}", flush=True)
    arms = {**SUPERVISION_ARMS, **kl_arms(args.kl_horizon, args.kl_beta_min)}
    if args.arms:
        arms = {k: v for k, v in arms.items() if k in args.arms.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, t0 = [], time.perf_counter()
    load_start = os.getloadavg()[0]
    for seed in seeds:  # seeds outermost: a cut-short study still has every arm at the first seeds
        for name, arm in arms.items():
            runs.append(run_arm(kit, name, arm, seed, args))
            summary = summarise(runs)
            result = {
                "meta": {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "seeds": seeds,
                         "budget_tokens": args.budget_tokens, "max_steps": args.max_steps,
                         "eval_problems": args.eval_problems, "kl_horizon": args.kl_horizon,
                         "kl_beta_min": args.kl_beta_min,
                         "arms": args.arms,
                         "kl_target": KL_TARGET, "kl_reward": KL_REWARD, "shared": SHARED, "threads": torch.get_num_threads(),
                         "wall_seconds": round(time.perf_counter() - t0, 1)},
                "initial": initial, "runs": runs, "summary": summary, "findings": findings(summary),
                "budget_note": (
                    f"Every run stopped at {args.budget_tokens:,} generated tokens or {args.max_steps} optimizer steps "
                    f"of {SHARED['per_device_train_batch_size']} completions, whichever came first, and was evaluated "
                    f"on {args.eval_problems} held-out problems: a 2-core machine, one thread per run, load average "
                    f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the last write. Differences "
                    "smaller than the standard errors are not findings."),
            }
            (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
            write_outputs(result, out, stem)
    print("\n".join(result["findings"]))


if __name__ == "__main__":
    main()
