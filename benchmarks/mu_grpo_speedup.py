"""µ-GRPO end-to-end speed-up on the toy task: on-policy GRPO vs naive large µ vs µ-GRPO, same updates.

Three arms, same warm-started toy policy, same seed(s), same number of optimizer updates, same
completions per update, learning rate, loss (GRPO's seq-mean-token-mean, beta 0, group-std
advantages):

* ``on_policy_grpo`` — our GRPO (``GRPOVariantTrainer``), one rollout of one update's worth of
  completions per update (µ = 1), clip [0.8, 1.2];
* ``naive_large_mu`` — ``MuGRPOTrainer`` stages (``--stage-prompts`` prompts x G completions,
  µ = passes x mini-batches per stage) with standard clipping [0.8, 1.2] and no veto;
* ``mu_grpo`` — the same stages with relaxed clipping [0, 5] and the H_kappa negative-advantage veto
  (threshold 1e-4): the paper's method.

The stage arms run once per stage setting in ``--passes`` (times each stored response is used):
by default 4 (µ = 128: all updates from one stage, a quarter of the sequences; the headline) and 1
(µ = 32, 4 stages, the same sequences as on-policy GRPO). The on-policy runs are shared.

Measured per arm: held-out greedy accuracy (``toy.evaluate``; ``--eval-size`` problems, at the start,
every µ updates of the smallest setting and at the end; evaluation time excluded), training wall
seconds, rollout throughput (sequences per second spent in the rollout phase: generation + scoring +
behaviour log-probs) and HF-generate-only throughput. Speed-ups are ratios of the arms' wall seconds
measured in this one run; the arms alternate seed by seed so that background load hits all of them.

    python benchmarks/mu_grpo_speedup.py              # full run: 5 runs x 2 seeds of 128 updates (~7 min, quiet CPU)
    python benchmarks/mu_grpo_speedup.py --passes 2 1 # other stage settings
    python benchmarks/mu_grpo_speedup.py --quick      # end-to-end check (about a minute)

Writes benchmarks/results/mu_grpo.json, mu_grpo.md and mu_grpo.png (``--out`` to change the folder).
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

from _common import HeldOutEval, time_rollouts, toy_run_config  # noqa: E402  (sets the offline environment first)

import torch  # noqa: E402

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig, MuGRPOTrainer, toy  # noqa: E402

ARMS = ("on_policy_grpo", "naive_large_mu", "mu_grpo")
LABELS = {
    "on_policy_grpo": "on-policy GRPO (µ=1)",
    "naive_large_mu": "naive large µ ([0.8,1.2], no veto)",
    "mu_grpo": "µ-GRPO ([0,5] + H_kappa veto)",
}


def build(arm: str, kit, opts, seed: int, output_dir: str):
    common = toy_run_config(output_dir, seed, opts.batch, opts.group, opts.lr, loss_type="grpo",
                            scale_rewards="group", beta=0.0, max_steps=opts.updates)
    if arm == "on_policy_grpo":
        config = GRPOVariantConfig(epsilon=0.2, **common)
        trainer_cls = GRPOVariantTrainer
    else:
        stage = dict(stage_prompts=opts.stage_prompts, updates_per_stage=opts.mu,
                     generation_chunk_prompts=opts.chunk_prompts)
        if arm == "naive_large_mu":
            config = MuGRPOConfig(relaxed_clip=False, epsilon=0.2, veto_scope=None, **stage, **common)
        else:
            config = MuGRPOConfig(relaxed_clip=True, mu_clip_lower=0.0, mu_clip_upper=5.0, veto_scope="H_kappa",
                                  veto_threshold=1e-4, **stage, **common)
        trainer_cls = MuGRPOTrainer
    return trainer_cls(model=kit.model_path, reward_funcs="toy_accuracy", args=config,
                       train_dataset=kit.train_dataset)


def _mean_of(history, key):
    values = [r[key] for r in history if key in r]
    return statistics.mean(values) if values else None


def run_arm(arm: str, kit, eval_dataset, opts, seed: int) -> dict:
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"mu-bench-{arm}-") as tmp:
        trainer = build(arm, kit, opts, seed, tmp)
        evaluator = HeldOutEval(trainer, eval_dataset, every_steps=opts.eval_every)
        trainer.add_callback(evaluator)
        rollout = time_rollouts(trainer)
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall = time.perf_counter() - start - evaluator.eval_seconds
        cpu_seconds = time.process_time() - cpu - evaluator.eval_cpu_seconds
    history = trainer.state.log_history
    generate_seconds = sum(r["time/generation_s"] for r in history if "time/generation_s" in r)
    return dict(
        arm=arm,
        passes=None if arm == "on_policy_grpo" else opts.passes,
        mu=1 if arm == "on_policy_grpo" else opts.mu,
        seed=seed,
        final_accuracy=evaluator.curve[-1]["accuracy"],
        initial_accuracy=evaluator.curve[0]["accuracy"],
        wall_seconds=round(wall, 3),
        cpu_seconds=round(cpu_seconds, 3),
        rollout_seconds=round(rollout["seconds"], 3),
        update_seconds=round(wall - rollout["seconds"], 3),
        rollouts=rollout["calls"],
        sequences=rollout["sequences"],
        sequences_per_second=rollout["sequences"] / max(rollout["seconds"], 1e-9),
        generate_only_sequences_per_second=rollout["sequences"] / max(generate_seconds, 1e-9),
        optimizer_steps=trainer.state.global_step,
        mean_reward=_mean_of(history, "reward"),
        clip_region_fraction=_mean_of(history, "clip_ratio/region_mean"),
        veto_fraction=_mean_of(history, "veto/fraction"),
        useful_token_fraction=_mean_of(history, "useful_token_fraction"),
        mean_staleness=_mean_of(history, "mu_grpo/staleness") or 0.0,
        curve=evaluator.curve,
    )


def summarise(runs: list[dict], passes: int) -> dict:
    """The three arms of one stage setting (stage arms with ``passes``; the on-policy runs are shared)."""
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm and (arm == "on_policy_grpo" or r["passes"] == passes)]

        def mean(key, mine=mine):
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.mean(values) if values else None

        out[arm] = dict(
            label=LABELS[arm],
            seeds=[r["seed"] for r in mine],
            mu=mine[0]["mu"],
            final_accuracy=mean("final_accuracy"),
            final_accuracy_per_seed=[r["final_accuracy"] for r in mine],
            initial_accuracy=mean("initial_accuracy"),
            wall_seconds=mean("wall_seconds"),
            wall_seconds_per_seed=[r["wall_seconds"] for r in mine],
            cpu_seconds=mean("cpu_seconds"),
            sequences_per_second=mean("sequences_per_second"),
            generate_only_sequences_per_second=mean("generate_only_sequences_per_second"),
            rollout_seconds=mean("rollout_seconds"),
            update_seconds=mean("update_seconds"),
            rollouts=mean("rollouts"),
            sequences=mean("sequences"),
            optimizer_steps=mean("optimizer_steps"),
            mean_reward=mean("mean_reward"),
            clip_region_fraction=mean("clip_region_fraction"),
            veto_fraction=mean("veto_fraction"),
            useful_token_fraction=mean("useful_token_fraction"),
            mean_staleness=mean("mean_staleness"),
        )
    on, naive, mu = out["on_policy_grpo"], out["naive_large_mu"], out["mu_grpo"]
    out["passes"], out["mu"] = passes, mu["mu"]
    out["end_to_end_speedup"] = on["wall_seconds"] / max(mu["wall_seconds"], 1e-9)
    out["rollout_speedup"] = mu["sequences_per_second"] / max(on["sequences_per_second"], 1e-9)
    by_seed = {(r["arm"], r["seed"]): r for r in runs if r["arm"] == "on_policy_grpo" or r["passes"] == passes}
    out["end_to_end_speedup_per_seed"] = [
        by_seed[("on_policy_grpo", seed)]["wall_seconds"] / max(by_seed[("mu_grpo", seed)]["wall_seconds"], 1e-9)
        for seed in on["seeds"]
    ]
    out["end_to_end_speedup_cpu_seconds"] = on["cpu_seconds"] / max(mu["cpu_seconds"], 1e-9)
    out["naive_end_to_end_speedup"] = on["wall_seconds"] / max(naive["wall_seconds"], 1e-9)
    out["accuracy_mu_grpo_minus_on_policy"] = mu["final_accuracy"] - on["final_accuracy"]
    out["accuracy_naive_minus_on_policy"] = naive["final_accuracy"] - on["final_accuracy"]
    return out


def _setting_text(summary: dict, opts) -> str:
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    reuse = ("each stored response used once: the same sequences as on-policy GRPO" if summary["passes"] == 1 else
             f"each stored response used {summary['passes']} times: 1/{summary['passes']} of on-policy GRPO's "
             "sequences")
    return (f"µ = {summary['mu']} ({opts.updates // summary['mu']} stage(s) of {opts.stage_prompts} prompts x "
            f"{opts.group} = {opts.stage_prompts * opts.group} completions, {mini_batches} mini-batches x "
            f"{summary['passes']} pass(es); {reuse})")


def _table(summary: dict) -> list[str]:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    num = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    arms = [summary[a] for a in ARMS]
    rows = [
        ("final held-out accuracy (greedy, mean)", *[pct(a["final_accuracy"]) for a in arms]),
        ("per seed", *[", ".join(pct(x) for x in a["final_accuracy_per_seed"]) for a in arms]),
        ("training wall seconds (eval excluded)", *[num(a["wall_seconds"], ".1f") for a in arms]),
        ("training CPU seconds (all threads)", *[num(a["cpu_seconds"], ".1f") for a in arms]),
        ("  rollout seconds", *[num(a["rollout_seconds"], ".1f") for a in arms]),
        ("  update + other seconds", *[num(a["update_seconds"], ".1f") for a in arms]),
        ("rollout throughput (sequences/s)", *[num(a["sequences_per_second"], ".0f") for a in arms]),
        ("HF generate throughput (sequences/s)", *[num(a["generate_only_sequences_per_second"], ".0f") for a in arms]),
        ("rollouts (generate/score phases)", *[num(a["rollouts"], ".0f") for a in arms]),
        ("sequences generated", *[num(a["sequences"], ",.0f") for a in arms]),
        ("optimizer updates", *[num(a["optimizer_steps"], ".0f") for a in arms]),
        ("mean staleness (updates)", *[num(a["mean_staleness"], ".1f") for a in arms]),
        ("clipped tokens (region)", *[pct(a["clip_region_fraction"]) for a in arms]),
        ("vetoed tokens", *[pct(a["veto_fraction"]) if a["veto_fraction"] is not None else "-" for a in arms]),
        ("useful-token fraction", *[num(a["useful_token_fraction"], ".3f") for a in arms]),
        ("mean training reward", *[num(a["mean_reward"], ".3f") for a in arms]),
    ]
    return [
        "| metric | " + " | ".join(LABELS[a] for a in ARMS) + " |",
        "|---|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in rows],
    ]


def _verdict(summary: dict) -> str:
    return (
        f"**End-to-end speed-up of µ-GRPO over on-policy GRPO: {summary['end_to_end_speedup']:.2f}x** (ratio of "
        f"training wall seconds measured in this run; per seed "
        f"{', '.join(f'{x:.2f}x' for x in summary['end_to_end_speedup_per_seed'])}; by process CPU seconds "
        f"{summary['end_to_end_speedup_cpu_seconds']:.2f}x); rollout-throughput ratio "
        f"{summary['rollout_speedup']:.2f}x (sequences/s); naive large µ: {summary['naive_end_to_end_speedup']:.2f}x. "
        f"Accuracy vs on-policy: µ-GRPO {100 * summary['accuracy_mu_grpo_minus_on_policy']:+.1f} points, naive "
        f"large µ {100 * summary['accuracy_naive_minus_on_policy']:+.1f} points."
    )


def write_markdown(path: Path, settings: list[dict], opts, meta: dict) -> None:
    head, others = settings[0], settings[1:]
    on = head["on_policy_grpo"]
    se = 100 * (0.25 / meta["eval_size"]) ** 0.5
    lines = [
        "# µ-GRPO vs on-policy GRPO on the toy task (same updates, same seeds)",
        "",
        f"Warm-started toy policy (held-out greedy accuracy at start {100 * on['initial_accuracy']:.1f}%); "
        f"{opts.updates} optimizer updates of {opts.batch} completions ({opts.batch // opts.group} prompts x "
        f"{opts.group}) in every arm; lr {opts.lr:g} constant; GRPO loss (seq-mean-token-mean), beta 0; stages "
        f"generated in chunks of {opts.chunk_prompts or opts.stage_prompts} prompts. Seeds {meta['seeds']}, "
        f"{meta['eval_size']} held-out problems (one accuracy value has a standard error of about {se:.1f} points), "
        f"torch threads: {meta['torch_threads']}. Mode: {'quick' if opts.quick else 'full'}. Load average at start "
        f"/ end: {meta['load_start']} / {meta['load_end']}. Stage settings measured side by side in this run: "
        + "; ".join(f"passes = {s['passes']}: µ = {s['mu']}" for s in settings) + ".",
        "",
        "| stage setting | sequences generated (stage arms / on-policy) | accuracy on-policy / naive / µ-GRPO | "
        "end-to-end speed-up µ-GRPO (naive) |",
        "|---|---|---|---|",
    ]
    for s in settings:
        lines.append(
            f"| µ = {s['mu']}, {s['passes']} pass(es) | {s['mu_grpo']['sequences']:,.0f} / {on['sequences']:,.0f} | "
            f"{100 * on['final_accuracy']:.1f}% / {100 * s['naive_large_mu']['final_accuracy']:.1f}% / "
            f"{100 * s['mu_grpo']['final_accuracy']:.1f}% | {s['end_to_end_speedup']:.2f}x "
            f"({s['naive_end_to_end_speedup']:.2f}x) |"
        )
    lines += ["", f"## Headline setting: {_setting_text(head, opts)}", "", *_table(head), "", _verdict(head), ""]
    for s in others:
        lines += [f"## {_setting_text(s, opts)}", "", *_table(s), "", _verdict(s), ""]
    gen_ratio = head["mu_grpo"]["generate_only_sequences_per_second"] / max(on["generate_only_sequences_per_second"], 1e-9)
    lines += [
        "## Reading",
        "",
        "Paper (arXiv:2605.17570, GPU clusters, LLMs): 1.53x end to end and 1.82x rollout speed at equal accuracy; "
        "naive GRPO at µ = 1,024 loses accuracy. The stage arms record the behaviour log-probs while generating (no "
        "extra forward pass; `behaviour_logprobs`) and fetch a stage's prompt rows once, so they pay nothing "
        "on-policy GRPO does not. With every response used once, a gain can only come from larger generation "
        "batches and fewer generate/score phases; what the paper saves, the switch between a GPU inference engine "
        "and the trainer (weight sync, memory re-layout, vLLM sleep/wake) at every refresh, does not exist with HF "
        f"generate on a CPU, which is nearly compute-bound already at the on-policy batch of {opts.batch} sequences "
        f"(HF generate alone runs {gen_ratio:.2f}x faster per sequence in the stages' chunks of "
        f"{(opts.chunk_prompts or opts.stage_prompts) * opts.group} sequences), and a toy completion is 3-6 "
        "tokens, so generation is a small share of a step here (the update time is the floor of every arm). "
        "Using each stored response several times cuts the rollouts themselves; that is where naive large µ "
        "(standard clipping, no veto) loses accuracy as staleness grows while µ-GRPO keeps it. The veto fires "
        "only when pi_theta / pi_behav < 1e-4 on a negative-advantage token and relaxed clipping only outside "
        "[0, 5]; the vetoed and clipped rows show whether either was active in this regime."
        + (" Here the veto never fired (no negative-advantage token fell below 1e-4 in any setting), so µ-GRPO's "
           "edge over naive large µ in this run is the relaxed clipping alone; the paper reports that relaxed "
           "clipping without the veto collapses later in long runs, which 128 toy updates do not reach."
           if all(not s["mu_grpo"]["veto_fraction"] for s in settings) else ""),
        "",
        f"Command: `{meta['command']}`. Plot: mu_grpo.png.",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[dict], passes: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"on_policy_grpo": "tab:blue", "naive_large_mu": "tab:gray", "mu_grpo": "tab:red"}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r["seed"] for r in runs})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for arm in ARMS:
        for p in [None] if arm == "on_policy_grpo" else passes:
            mine = [r for r in runs if r["arm"] == arm and r["passes"] == p]
            if not mine:
                continue
            curve = [statistics.mean(c) for c in zip(*[[pt["accuracy"] for pt in r["curve"]] for r in mine])]
            steps = [pt["step"] for pt in mine[0]["curve"]]
            seconds = [statistics.mean(c) for c in zip(*[[pt["seconds"] for pt in r["curve"]] for r in mine])]
            label = LABELS[arm] + ("" if p is None else f", µ = {mine[0]['mu']}") + f" (mean of {len(mine)} seeds)"
            style = "-" if p is None else styles[passes.index(p) % len(styles)]
            for ax, xs in zip(axes, (steps, seconds)):
                ax.plot(xs, curve, style, marker="o", ms=3, color=colors[arm], alpha=0.85, label=label)
    axes[0].set_xlabel("optimizer updates")
    axes[1].set_xlabel("training seconds (evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"µ-GRPO vs on-policy GRPO vs naive large µ, toy addition task, same updates, seeds {seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run: an end-to-end check")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 (quick: 0)")
    parser.add_argument("--updates", type=int, default=None, help="optimizer updates per arm (default 128; quick 16)")
    parser.add_argument("--batch", type=int, default=None, help="completions per update (default 128; quick 64)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--stage-prompts", type=int, default=None, help="prompts per stage (default 512; quick 32)")
    parser.add_argument("--passes", type=int, nargs="+", default=[4, 1],
                        help="stage settings: times each stored response is used (µ = passes x mini-batches per "
                        "stage); 1 = the same sequences as on-policy GRPO. The first is the headline (default 4 1)")
    parser.add_argument("--chunk-prompts", type=int, default=None,
                        help="prompts per generation call in a stage (default 256; quick: whole stage)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 500; quick 100)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: with 2 threads on a shared 2-core machine one busy neighbour "
                        "makes OpenMP spin and a run 10-20x slower, which swamps the ratio)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the discarded 2-update warm-up run")
    parser.add_argument("--out", default=str(HERE / "results"))
    opts = parser.parse_args(argv)
    opts.seeds = opts.seeds or ([0] if opts.quick else [0, 1])
    opts.updates = opts.updates or (16 if opts.quick else 128)
    opts.batch = opts.batch or (64 if opts.quick else 128)
    opts.stage_prompts = opts.stage_prompts or (32 if opts.quick else 512)
    if opts.chunk_prompts is None and not opts.quick:
        opts.chunk_prompts = min(256, opts.stage_prompts)
    opts.eval_size = opts.eval_size or (100 if opts.quick else 500)
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    setting_opts = {}
    for passes in opts.passes:
        mu = passes * mini_batches
        if opts.updates % mu:
            parser.error(f"--updates ({opts.updates}) must be a multiple of µ = {mu} (passes {passes}; whole stages).")
        setting_opts[passes] = argparse.Namespace(**{**vars(opts), "passes": passes, "mu": mu})
    opts.eval_every = min(passes * mini_batches for passes in opts.passes)
    torch.set_num_threads(opts.threads)

    kit = toy.prepare(task="addition", verbose=True)
    eval_dataset = kit.eval_dataset.select(range(min(opts.eval_size, len(kit.eval_dataset))))
    if not opts.no_warmup:  # the first training run in a process pays one-off start-up costs: keep them out
        warm = argparse.Namespace(**{**vars(opts), "updates": 2})
        with tempfile.TemporaryDirectory(prefix="mu-bench-warmup-") as tmp:
            build("on_policy_grpo", kit, warm, opts.seeds[0], tmp).train()
    load_start = round(os.getloadavg()[0], 2)
    runs = []
    for seed in opts.seeds:  # arms alternate seed by seed so that background load hits all of them
        jobs = [("on_policy_grpo", setting_opts[opts.passes[0]])]
        jobs += [(arm, setting_opts[p]) for p in opts.passes for arm in ARMS[1:]]
        for arm, arm_opts in jobs:
            arm_opts.eval_every = opts.eval_every
            tag = arm if arm == "on_policy_grpo" else f"{arm} µ={arm_opts.mu}"
            print(f"[mu_grpo_speedup] {tag} seed {seed}: {opts.updates} updates", flush=True)
            run = run_arm(arm, kit, eval_dataset, arm_opts, seed)
            print(f"[mu_grpo_speedup] {tag} seed {seed}: accuracy {run['initial_accuracy']:.1%} -> "
                  f"{run['final_accuracy']:.1%}, {run['wall_seconds']:.1f} s (rollout {run['rollout_seconds']:.1f} s, "
                  f"{run['rollouts']} rollouts, {run['sequences_per_second']:.0f} seq/s), clipped "
                  f"{run['clip_region_fraction'] or 0:.3f}, vetoed {run['veto_fraction'] or 0:.4f}", flush=True)
            runs.append(run)
    settings = [summarise(runs, p) for p in opts.passes]
    head = settings[0]
    meta = dict(command="python benchmarks/mu_grpo_speedup.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                seeds=opts.seeds, eval_size=len(eval_dataset), updates=opts.updates, batch=opts.batch,
                group=opts.group, stage_prompts=opts.stage_prompts, mu=head["mu"], passes=opts.passes,
                chunk_prompts=opts.chunk_prompts, lr=opts.lr, quick=opts.quick, torch_threads=torch.get_num_threads(),
                load_start=load_start, load_end=round(os.getloadavg()[0], 2),
                warmstart_probe_accuracy=kit.warmstart.get("probe_accuracy"))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    scalars = ("end_to_end_speedup", "end_to_end_speedup_per_seed", "end_to_end_speedup_cpu_seconds",
               "rollout_speedup", "naive_end_to_end_speedup", "accuracy_mu_grpo_minus_on_policy",
               "accuracy_naive_minus_on_policy")
    result = {
        "meta": meta,
        "headline_setting": {"passes": head["passes"], "mu": head["mu"]},
        **{key: head[key] for key in scalars},
        **{arm: head[arm] for arm in ARMS},
        "settings": [{"passes": s["passes"], "mu": s["mu"], **{k: s[k] for k in scalars},
                      **{arm: s[arm] for arm in ARMS[1:]}} for s in settings],
        "runs": runs,
    }
    (out / "mu_grpo.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "mu_grpo.md", settings, opts, meta)
    plot(out / "mu_grpo.png", runs, opts.passes)
    print((out / "mu_grpo.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
