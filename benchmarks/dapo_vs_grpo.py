"""DAPO versus GRPO on the toy task at an equal generation budget.

Both arms start from the same warm-started toy policy (held-out greedy accuracy about 30%, where
many groups of 8 samples are all wrong or all right and carry no gradient), use the same seed(s),
the same prompts, the same learning rate and completions per update, and stop once they have
*generated* the same number of tokens (``GenerationBudgetCallback``: DAPO's discarded groups count).

* GRPO: the registered ``grpo`` variant (DeepSeekMath: clip 0.2, seq-mean-token-mean, k3 KL with
  beta 0.04 (``--grpo-beta``)), reward ``toy_accuracy`` (1 / 0).
* DAPO: the registered ``dapo`` variant (clip 0.2 / 0.28, dual clip 10, token-mean per update, dynamic
  sampling with the retry cap and surplus groups carried to the next batch, overlong shaping and
  filtering, beta 0), reward ``toy_accuracy_pm1`` (+1 / -1). With group-std advantages the two reward
  scales give the same advantages. Updates per rollout come from the lab's toy preset (4 instead of the
  paper's 16, so one rollout does not overshoot the budget); both arms make one optimizer update per
  ``--batch`` completions trained. Arm ``dapo_discard`` cuts surplus groups as the paper does; arm
  ``dapo_full`` generates a whole generation batch per top-up round (verl) instead of sizing it from the
  running pass rate.

Measured per arm: held-out greedy accuracy against generated tokens (every ``--eval-every`` tokens,
on ``--eval-size`` held-out problems), final accuracy, training wall seconds (evaluation time
excluded; arms alternate seed by seed so background load hits both), generated tokens, the
useful-token fraction (tokens that received a gradient / tokens generated), the token ledger (where every
generated token went: dropped, cut, carried, masked, zero advantage, clipped, useful) and generation
rounds per optimisation batch (1 for GRPO; DAPO re-samples).

    python benchmarks/dapo_vs_grpo.py                 # full run (quiet 2-core CPU: about 25 minutes)
    python benchmarks/dapo_vs_grpo.py --quick         # end-to-end check (about 2 minutes)

Writes benchmarks/results/dapo.json, dapo.md and dapo.png (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from _bench import HeldOutEval, toy_run_config  # noqa: E402  (sets the offline environment first)

from grpo_variants.lab import toy_preset  # noqa: E402

import torch  # noqa: E402

from grpo_variants import get_variant, toy  # noqa: E402
from grpo_variants.callbacks import GenerationBudgetCallback  # noqa: E402

ALL_ARMS = ("grpo", "dapo", "dapo_discard", "dapo_full")
ARM_LABELS = {"grpo": "GRPO", "dapo": "DAPO", "dapo_discard": "DAPO, surplus cut (paper)",
              "dapo_full": "DAPO, whole-batch top-ups"}
ARMS = ("grpo", "dapo")  # the arms run (main() sets it from --arms)


def build(arm: str, kit, opts, seed: int, output_dir: str):
    spec = get_variant("dapo" if arm.startswith("dapo") else arm)
    values = toy_run_config(output_dir, seed, opts.batch, opts.group, opts.lr,
                            max_steps=100_000)  # the generation budget stops training
    if arm == "grpo":
        values["beta"] = opts.grpo_beta
        reward = "toy_accuracy"
    else:
        values["max_num_gen_batches"] = opts.max_num_gen_batches
        values["dynamic_sampling_surplus"] = "discard" if arm == "dapo_discard" else "carry"
        values["dynamic_sampling_topup"] = "full" if arm == "dapo_full" else "pass_rate"
        values.update(toy_preset("dapo", values))  # 4 updates per rollout on the toy task (every DAPO arm)
        reward = "toy_accuracy_pm1"
    config = spec.config_cls(**values)
    trainer = spec.trainer_cls(model=kit.model_path, reward_funcs=reward, args=config,
                               train_dataset=kit.train_dataset)
    return trainer


def run_arm(arm: str, kit, eval_dataset, opts, seed: int) -> dict:
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"dapo-bench-{arm}-") as tmp:
        trainer = build(arm, kit, opts, seed, tmp)
        budget = GenerationBudgetCallback(trainer, budget_tokens=opts.budget)
        evaluator = HeldOutEval(trainer, eval_dataset, every_tokens=opts.eval_every)
        trainer.add_callback(budget)
        trainer.add_callback(evaluator)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start - evaluator.eval_seconds
    history = trainer.state.log_history
    generated = int(trainer._tokens_generated_total)
    rollouts = int(trainer._generation_rounds_total)  # optimisation batches (one rollout each)
    # generate calls per optimisation batch (GRPO: 1; dynamic sampling re-samples)
    rounds = int(trainer._ds_rounds_total) if trainer.args.dynamic_sampling else rollouts
    pass_rates = [r["dynamic_sampling/pass_rate"] for r in history if "dynamic_sampling/pass_rate" in r]
    zero_std = [r["frac_reward_zero_std"] for r in history if "frac_reward_zero_std" in r]
    clip_high = [r["clip_ratio/high_mean"] for r in history if "clip_ratio/high_mean" in r]
    topups = [r["dynamic_sampling/topup_groups"] for r in history if "dynamic_sampling/topup_groups" in r]
    generated_groups = [r["dynamic_sampling/groups_generated"] for r in history
                        if "dynamic_sampling/groups_generated" in r]
    ledger = trainer.token_ledger()
    return dict(
        arm=arm,
        seed=seed,
        final_accuracy=evaluator.curve[-1]["accuracy"],
        accuracy_gain_per_100k_tokens=(evaluator.curve[-1]["accuracy"] - evaluator.curve[0]["accuracy"])
        / max(generated, 1) * 1e5,
        clip_high_mean=statistics.mean(clip_high) if clip_high else 0.0,
        initial_accuracy=evaluator.curve[0]["accuracy"],
        wall_seconds=round(wall, 2),
        generated_tokens=generated,
        useful_tokens=int(trainer._tokens_useful_total),
        useful_token_fraction=trainer._tokens_useful_total / max(generated, 1),
        optimizer_steps=trainer.state.global_step,
        rollouts=rollouts,
        generation_rounds=rounds,
        generation_rounds_per_step=rounds / max(rollouts, 1),
        dynamic_sampling_pass_rate=statistics.mean(pass_rates) if pass_rates else None,
        frac_reward_zero_std=statistics.mean(zero_std) if zero_std else None,
        # groups generated per optimisation batch, and how many of them beyond the loader's batch (top-ups)
        groups_generated_per_step=statistics.mean(generated_groups) if generated_groups else opts.batch / opts.group,
        topup_groups_per_step=statistics.mean(topups) if topups else 0.0,
        token_ledger=ledger["tokens"],
        token_fractions=ledger["fractions"],
        signal_token_fraction=ledger["fractions"]["signal"],
        # staleness: of the signal tokens, the carried groups' share and how often each kind was clipped
        **_carried_split(ledger),
        curve=evaluator.curve,
    )


def _carried_split(ledger: dict) -> dict:
    tokens, carried = ledger["tokens"], ledger["carried_rows"]
    clipped = tokens["clipped_dual"] + tokens["clipped_low"] + tokens["clipped_high"]
    fresh_signal = tokens["signal"] - carried["signal"]
    return dict(
        carried_signal_share=carried["signal"] / max(tokens["signal"], 1),
        clip_rate_carried=carried["clipped"] / carried["signal"] if carried["signal"] else None,
        clip_rate_fresh=(clipped - carried["clipped"]) / max(fresh_signal, 1),
    )


def summarise(runs: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        mean = lambda key: statistics.mean(r[key] for r in mine)  # noqa: E731
        out[arm] = dict(
            seeds=[r["seed"] for r in mine],
            final_accuracy=mean("final_accuracy"),
            final_accuracy_per_seed=[r["final_accuracy"] for r in mine],
            accuracy_gain_per_100k_tokens=mean("accuracy_gain_per_100k_tokens"),
            useful_token_fraction_per_seed=[r["useful_token_fraction"] for r in mine],
            generation_rounds_per_step_per_seed=[r["generation_rounds_per_step"] for r in mine],
            clip_high_mean=mean("clip_high_mean"),
            initial_accuracy=mean("initial_accuracy"),
            wall_seconds=mean("wall_seconds"),
            generated_tokens=mean("generated_tokens"),
            useful_token_fraction=mean("useful_token_fraction"),
            optimizer_steps=mean("optimizer_steps"),
            generation_rounds_per_step=mean("generation_rounds_per_step"),
            dynamic_sampling_pass_rate=(statistics.mean(r["dynamic_sampling_pass_rate"] for r in mine)
                                        if mine[0]["dynamic_sampling_pass_rate"] is not None else None),
            frac_reward_zero_std=mean("frac_reward_zero_std"),
            groups_generated_per_step=mean("groups_generated_per_step"),
            topup_groups_per_step=mean("topup_groups_per_step"),
            signal_token_fraction=mean("signal_token_fraction"),
            signal_token_fraction_per_seed=[r["signal_token_fraction"] for r in mine],
            carried_signal_share=mean("carried_signal_share"),
            clip_rate_carried=(statistics.mean(r["clip_rate_carried"] for r in mine)
                               if all(r["clip_rate_carried"] is not None for r in mine) else None),
            clip_rate_fresh=mean("clip_rate_fresh"),
            token_fractions={k: statistics.mean(r["token_fractions"][k] for r in mine)
                             for k in mine[0]["token_fractions"]},
            # area under the accuracy-vs-tokens curve / budget: mean accuracy over the run
            mean_accuracy_over_budget=statistics.mean(_curve_mean(r["curve"]) for r in mine),
        )
    out["ratios"] = dict(
        final_accuracy_dapo_minus_grpo=out["dapo"]["final_accuracy"] - out["grpo"]["final_accuracy"],
        wall_seconds_dapo_over_grpo=out["dapo"]["wall_seconds"] / max(out["grpo"]["wall_seconds"], 1e-9),
        useful_token_fraction_dapo_over_grpo=out["dapo"]["useful_token_fraction"]
        / max(out["grpo"]["useful_token_fraction"], 1e-9),
    )
    return out


def _curve_mean(curve: list[dict]) -> float:
    """Trapezoid mean of accuracy over generated tokens."""
    if len(curve) < 2 or curve[-1]["tokens"] == curve[0]["tokens"]:
        return curve[-1]["accuracy"]
    area = sum((b["tokens"] - a["tokens"]) * (a["accuracy"] + b["accuracy"]) / 2 for a, b in zip(curve, curve[1:]))
    return area / (curve[-1]["tokens"] - curve[0]["tokens"])


def write_markdown(path: Path, summary: dict, opts, meta: dict) -> None:
    arms = [arm for arm in ALL_ARMS if arm in summary]
    g = summary["grpo"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    per_arm = [
        ("final held-out accuracy (greedy)", lambda a: pct(a["final_accuracy"])),
        ("per seed", lambda a: ", ".join(pct(x) for x in a["final_accuracy_per_seed"])),
        ("mean accuracy over the budget", lambda a: pct(a["mean_accuracy_over_budget"])),
        ("accuracy gain per 100k generated tokens (points)",
         lambda a: f"{100 * a['accuracy_gain_per_100k_tokens']:.1f}"),
        ("generated tokens", lambda a: f"{a['generated_tokens']:,.0f}"),
        ("useful-token fraction", lambda a: f"{a['useful_token_fraction']:.3f}"),
        ("useful-token fraction per seed",
         lambda a: ", ".join(f"{x:.3f}" for x in a["useful_token_fraction_per_seed"])),
        ("signal-token fraction (reached an update with A != 0, before clipping)",
         lambda a: f"{a['signal_token_fraction']:.3f}"),
        ("optimizer steps", lambda a: f"{a['optimizer_steps']:.1f}"),
        ("generation rounds (generate calls) per optimisation batch",
         lambda a: f"{a['generation_rounds_per_step']:.2f}"),
        ("groups generated per optimisation batch (of them: top-up)",
         lambda a: f"{a['groups_generated_per_step']:.1f} ({a['topup_groups_per_step']:.1f})"),
        ("tokens clipped at the upper bound (mean per update)", lambda a: f"{a['clip_high_mean']:.4f}"),
        ("signal tokens from carried groups (sampled one rollout earlier)", lambda a: pct(a["carried_signal_share"])),
        ("clipped share of signal tokens: carried groups / fresh groups",
         lambda a: ("-" if a["clip_rate_carried"] is None else pct(a["clip_rate_carried"]))
         + f" / {pct(a['clip_rate_fresh'])}"),
        ("groups with zero reward std (generated)", lambda a: pct(a["frac_reward_zero_std"])),
        ("dynamic-sampling pass rate", lambda a: "-" if a["dynamic_sampling_pass_rate"] is None
         else pct(a["dynamic_sampling_pass_rate"])),
        ("training wall seconds (eval excluded)", lambda a: f"{a['wall_seconds']:.1f}"),
    ]
    rows = [(name, *[fn(summary[arm]) for arm in arms]) for name, fn in per_arm]
    fates = [
        ("(a) dropped by the dynamic-sampling filter (zero-std groups)", "dropped_by_filter"),
        ("(a') qualifying but cut (surplus discarded)", "surplus_cut"),
        ("(d) carried, still unused when the run ended", "carried_pending"),
        ("(c) outside the loss mask (truncated: overlong filtering)", "masked"),
        ("(e) trained with zero advantage (zero-std groups kept)", "zero_advantage"),
        ("(b) clipped: dual clip (A < 0, ratio > c)", "clipped_dual"),
        ("(b) clipped: low (A < 0, ratio < 1 - eps_low)", "clipped_low"),
        ("(b) clipped: high (A > 0, ratio > 1 + eps_high)", "clipped_high"),
        ("no gradient for another reason (cap, veto, masks)", "no_gradient_other"),
        ("**useful** (non-zero policy gradient)", "useful"),
        ("generated, never trained (last rollout unfinished)", "unaccounted"),
    ]
    fate_rows = [(name, *[f"{100 * summary[arm]['token_fractions'][key]:.1f}%" for arm in arms])
                 for name, key in fates]
    fate_rows.append(("signal: reached an update with A != 0 (useful + clipped + other)",
                      *[f"{100 * summary[arm]['token_fractions']['signal']:.1f}%" for arm in arms]))
    r = summary["ratios"]
    d = summary["dapo"]
    gf, df = g["token_fractions"], d["token_fractions"]
    clipped = df["clipped_dual"] + df["clipped_low"] + df["clipped_high"]
    reading = (
        f"Reading the ledger: GRPO trains the groups whose rewards are all equal with advantage 0 "
        f"({pct(gf['zero_advantage'])} of its tokens; {pct(g['frac_reward_zero_std'])} of its groups), DAPO's filter "
        f"drops them before the loss ({pct(df['dropped_by_filter'])} of its tokens; "
        f"{pct(1 - d['dynamic_sampling_pass_rate'])} of its groups): the same waste under two names, its size set by "
        f"how often each arm's own policy is always right or always wrong. Before the trust region acts, DAPO's "
        f"signal fraction is {d['signal_token_fraction']:.3f} vs GRPO's {g['signal_token_fraction']:.3f}. From "
        f"there DAPO loses what its clip removes ({pct(clipped)} of its tokens; GRPO makes one on-policy update per "
        f"rollout, ratio 1, and never clips), groups still carried when the budget ends "
        f"({pct(df['carried_pending'])}) and truncated completions it masks ({pct(df['masked'])}). Clipping is "
        f"the point of DAPO's several updates per rollout, not waste that sampling could avoid."
    )
    if "dapo_full" in summary and d["clip_rate_carried"] is not None:
        f = summary["dapo_full"]
        reading += (
            f" Staleness shows in the clip: tokens of carried groups (sampled one rollout earlier) are clipped "
            f"{pct(d['clip_rate_carried'])} of the time vs {pct(d['clip_rate_fresh'])} for fresh ones (DAPO); with "
            f"whole-batch top-ups carried groups hold {pct(f['carried_signal_share'])} of the signal tokens "
            f"(clipped {pct(f['clip_rate_carried'])} / fresh {pct(f['clip_rate_fresh'])}), with top-ups sized from "
            f"the pass rate {pct(d['carried_signal_share'])}: that, and fewer groups left carried at the end, is "
            f"where the sized top-up's useful tokens come from ({d['useful_token_fraction']:.3f} vs "
            f"{f['useful_token_fraction']:.3f})."
        )
    lines = [
        "# DAPO vs GRPO on the toy task at an equal generation budget",
        "",
        f"Warm-started toy policy (held-out greedy accuracy at start {pct(g['initial_accuracy'])}), "
        f"{opts.batch} completions per update ({opts.batch // opts.group} prompts x {opts.group}), lr {opts.lr:g}, "
        f"budget {opts.budget:,} generated tokens per arm, seeds {meta['seeds']}, {meta['eval_size']} held-out "
        f"problems. GRPO beta = {opts.grpo_beta:g}. DAPO: {meta.get('dapo_updates_per_rollout')} updates per rollout, "
        f"top-ups sized from the running pass rate, surplus qualifying groups carried to the next batch (DAPO) or "
        f"cut as in the paper (DAPO, surplus cut); DAPO, whole-batch top-ups: one generation batch per extra round "
        f"(verl's), surplus carried. "
        f"Mode: {'quick' if opts.quick else 'full'}.",
        "",
        "| metric | " + " | ".join(ARM_LABELS[arm] for arm in arms) + " |",
        "|---" * (len(arms) + 1) + "|",
        *["| " + " | ".join(row) + " |" for row in rows],
        "",
        f"DAPO - GRPO final accuracy: {100 * r['final_accuracy_dapo_minus_grpo']:+.1f} points; "
        f"wall-time ratio DAPO/GRPO {r['wall_seconds_dapo_over_grpo']:.2f} (same run, arms alternated); "
        f"useful-token fraction ratio {r['useful_token_fraction_dapo_over_grpo']:.2f}.",
        "",
        "Where the generated tokens went (token ledger, `GRPOVariantTrainer.token_ledger()`; share of every "
        "generated token, mean over seeds; the rows sum to 100%):",
        "",
        "| fate of a generated token | " + " | ".join(ARM_LABELS[arm] for arm in arms) + " |",
        "|---" * (len(arms) + 1) + "|",
        *["| " + " | ".join(row) + " |" for row in fate_rows],
        "",
        reading,
        "",
        "The useful-token fraction charges every generated token, including DAPO's discarded groups; with "
        f"{meta['eval_size']} held-out problems one accuracy value has a standard error of about "
        f"{100 * (0.25 / meta['eval_size']) ** 0.5:.1f} points.",
        "",
        f"Command: `python benchmarks/dapo_vs_grpo.py{' --quick' if opts.quick else ''}"
        f"{f' --budget {opts.budget}' if opts.budget != (3_000 if opts.quick else 300_000) else ''}"
        f"{f' --batch {opts.batch}' if opts.batch != (64 if opts.quick else 256) else ''}"
        f"{' --eval-size ' + str(meta['eval_size']) if meta['eval_size'] != (100 if opts.quick else 500) else ''}"
        f"{' --arms ' + ' '.join(arms) if len(arms) > 2 else ''}`"
        f"{' (' + meta['processes'] + ', then --merge)' if meta.get('processes') else ''}. Plot: dapo.png.",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "dapo": "tab:red", "dapo_discard": "tab:orange", "dapo_full": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in runs:
        label = f"{ARM_LABELS[run['arm']]} seed {run['seed']}"
        xs = [p["tokens"] / 1000 for p in run["curve"]]
        ys = [p["accuracy"] for p in run["curve"]]
        axes[0].plot(xs, ys, "o-", ms=3, color=colors[run["arm"]], alpha=0.85, label=label)
        axes[1].plot([p["seconds"] for p in run["curve"]], ys, "o-", ms=3, color=colors[run["arm"]], alpha=0.85,
                     label=label)
    axes[0].set_xlabel("generated tokens (thousands, discarded groups included)")
    axes[1].set_xlabel("training seconds (evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("DAPO vs GRPO, toy addition task, equal generation budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    global ARMS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget: an end-to-end check")
    parser.add_argument("--budget", type=int, default=None, help="generated tokens per arm (default 300k; quick 3k)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--batch", type=int, default=None, help="completions per update (default 256; quick 64)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--grpo-beta", type=float, default=0.04, help="GRPO's KL coefficient (paper: 0.04)")
    parser.add_argument("--max-num-gen-batches", type=int, default=10)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS),
                        help="arms to run (dapo_discard: DAPO cutting surplus groups as in the paper; dapo_full: "
                             "top-up rounds of a whole generation batch, verl's, instead of sized from the pass rate)")
    parser.add_argument("--eval-every", type=int, default=None, help="generated tokens between evaluations")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 500; quick 100)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: up to 2)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DAPO_JSON",
                        help="combine the runs of several dapo.json files (e.g. one process per seed, run side by "
                             "side) into one table; the other options must be the ones those runs used")
    opts = parser.parse_args(argv)
    ARMS = tuple(arm for arm in ALL_ARMS if arm in opts.arms or arm == "grpo" or arm == "dapo")
    opts.budget = opts.budget or (3_000 if opts.quick else 300_000)
    opts.seeds = opts.seeds or ([0] if opts.quick else [0, 1, 2])
    opts.batch = opts.batch or (64 if opts.quick else 256)
    opts.eval_every = opts.eval_every or max(opts.budget // 10, 1)
    opts.eval_size = opts.eval_size or (100 if opts.quick else 500)
    torch.set_num_threads(opts.threads or max(1, min(2, os.cpu_count() or 1)))
    if opts.merge:
        return merge(opts, [Path(p) for p in opts.merge])

    kit = toy.prepare(task="addition", verbose=True)
    eval_dataset = kit.eval_dataset.select(range(min(opts.eval_size, len(kit.eval_dataset))))
    runs = []
    eval_size = len(eval_dataset)
    for seed in opts.seeds:
        for arm in ARMS:
            print(f"[dapo_vs_grpo] {arm} seed {seed}: budget {opts.budget:,} generated tokens", flush=True)
            run = run_arm(arm, kit, eval_dataset, opts, seed)
            print(f"[dapo_vs_grpo] {arm} seed {seed}: accuracy {run['initial_accuracy']:.1%} -> "
                  f"{run['final_accuracy']:.1%}, {run['optimizer_steps']} steps, {run['generated_tokens']:,} tokens, "
                  f"useful {run['useful_token_fraction']:.3f}, rounds/step {run['generation_rounds_per_step']:.2f}, "
                  f"{run['wall_seconds']:.1f} s", flush=True)
            runs.append(run)
    write_results(opts, runs, eval_size, kit.warmstart.get("probe_accuracy"))
    return 0


def merge(opts, paths: list[Path]) -> int:
    """One table from the runs of several result files (each process ran some seeds, side by side)."""
    results = [json.loads(p.read_text()) for p in paths]
    runs = sorted((r for res in results for r in res["runs"]), key=lambda r: (r["seed"], ALL_ARMS.index(r["arm"])))
    opts.seeds = sorted({r["seed"] for r in runs})
    global ARMS
    ARMS = tuple(arm for arm in ALL_ARMS if any(r["arm"] == arm for r in runs))
    meta0 = results[0]["meta"]
    for res in results:
        for key in ("budget_tokens", "batch", "group", "lr", "grpo_beta", "eval_size", "arms"):
            if res["meta"].get(key) != meta0.get(key):
                raise SystemExit(f"--merge: {key} differs between the files "
                                 f"({res['meta'].get(key)} vs {meta0.get(key)})")
    write_results(opts, runs, meta0["eval_size"], meta0.get("warmstart"),
                  note=f"{len(paths)} processes run side by side, one per seed")
    return 0


def write_results(opts, runs: list[dict], eval_size: int, warmstart, note: str | None = None) -> None:
    summary = summarise(runs)
    meta = dict(seeds=opts.seeds, eval_size=eval_size, budget_tokens=opts.budget, batch=opts.batch,
                group=opts.group, lr=opts.lr, grpo_beta=opts.grpo_beta, quick=opts.quick,
                torch_threads=torch.get_num_threads(), warmstart=warmstart, processes=note,
                arms=list(ARMS),
                dapo_updates_per_rollout=toy_preset(
                    "dapo", {"per_device_train_batch_size": opts.batch, "num_generations": opts.group}
                )["mini_batches_per_rollout"])
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, **{arm: summary[arm] for arm in ARMS}, "ratios": summary["ratios"], "runs": runs}
    (out / "dapo.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "dapo.md", summary, opts, meta)
    plot(out / "dapo.png", runs)
    print((out / "dapo.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
