"""µ-GRPO veto and trust-region ablation on the chain-of-thought toy task (20-56-token completions).

On the 3-6-token addition task the veto never fired (``mu_grpo.json``). Here completions are long, the
stage is stale for its whole length (one stage of ``--stage-prompts`` x G completions serves every
update) and the veto threshold is raised (``--threshold``, default 1e-2) so that triggers occur. Arms,
same warm-started chain policy, same seeds, same optimizer updates, same completions per update, same
learning rate / temperature / loss (GRPO seq-mean-token-mean, beta 0, group-std advantages):

* ``on_policy_grpo``: our GRPO, one rollout per update (µ = 1), clip [0.8, 1.2];
* ``naive_large_mu``: µ-GRPO stages, standard clip [0.8, 1.2], no veto;
* ``relaxed_no_veto``: the stages with relaxed clip [0, 5] and no veto (the paper's "collapses later");
* ``veto_T`` / ``veto_S_kappa`` / ``veto_H_kappa`` / ``veto_S_seq``: [0, 5] + the veto in each scope
  (``veto_H_kappa`` is µ-GRPO as the paper runs it, at the raised threshold);
* ``adaptive_H_kappa``: the adaptive trust region (``adaptive_clip_target``, bounds re-chosen every
  update within [0, 0.8] x [1.2, 5]) + the H_kappa veto: compare with ``veto_H_kappa`` (fixed [0, 5]).

Measured per run: held-out greedy accuracy on ``--eval-size`` chain problems at the start and end
(its binomial standard error), training wall and process-CPU seconds (evaluation excluded), rollout
sequences/s (rollout phase: generation + scoring + behaviour log-probs), veto fraction (vetoed share of
trained tokens, mean over updates), would-be trigger fraction for the arms without veto, clipped-token
fraction, adaptive bounds. Arms alternate within each seed so background load hits all of them; the
JSON is rewritten after every run (a cut-short run keeps what finished).

    python benchmarks/mu_grpo_ablation.py --seeds 0,1              # the committed run
    python benchmarks/mu_grpo_ablation.py --quick                  # pipeline check (a few minutes)

Writes benchmarks/results/mu_grpo_ablation.json, .md, .png (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from _bench import mu_arm_fields, timed_train, toy_run_config  # noqa: E402  (sets the offline environment first)

import torch  # noqa: E402

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig, MuGRPOTrainer, toy  # noqa: E402
from grpo_variants.tasks import toy_reasoning  # noqa: E402

# Run order = priority (a run cut short keeps the main comparison): the scopes T / S_kappa / S_seq come last.
ARMS = ("on_policy_grpo", "naive_large_mu", "relaxed_no_veto", "veto_H_kappa", "adaptive_H_kappa", "veto_T",
        "veto_S_kappa", "veto_S_seq")
LABELS = {
    "on_policy_grpo": "on-policy GRPO (µ=1, [0.8,1.2])",
    "naive_large_mu": "naive large µ ([0.8,1.2], no veto)",
    "relaxed_no_veto": "relaxed [0,5], no veto",
    "veto_T": "[0,5] + veto T",
    "veto_S_kappa": "[0,5] + veto S_kappa",
    "veto_H_kappa": "µ-GRPO: [0,5] + veto H_kappa",
    "veto_S_seq": "[0,5] + veto S_seq",
    "adaptive_H_kappa": "adaptive bounds + veto H_kappa",
}


def build(arm: str, kit, opts, seed: int, output_dir: str):
    common = toy_run_config(output_dir, seed, opts.batch, opts.group, opts.lr, loss_type="grpo",
                            scale_rewards="group", beta=0.0, max_steps=opts.updates,
                            max_completion_length=kit.max_completion_length, temperature=opts.temperature)
    if arm == "on_policy_grpo":
        return GRPOVariantTrainer(model=kit.model_path, reward_funcs=kit.reward, args=GRPOVariantConfig(
            epsilon=0.2, **common), train_dataset=kit.train_dataset)
    stage = dict(stage_prompts=opts.stage_prompts, updates_per_stage=opts.updates, veto_threshold=opts.threshold)
    config = MuGRPOConfig(**mu_arm_fields(arm, opts.adaptive_target), **stage, **common)
    return MuGRPOTrainer(model=kit.model_path, reward_funcs=kit.reward, args=config, train_dataset=kit.train_dataset)


def _mean_of(history, key):
    values = [r[key] for r in history if key in r and r[key] is not None and math.isfinite(r[key])]
    return statistics.mean(values) if values else None


def _accuracy(model, tokenizer, eval_dataset, kit) -> float:
    was_training = model.training
    out = toy_reasoning.evaluate(model, eval_dataset, tokenizer, max_new_tokens=kit.max_completion_length)
    model.train(was_training)
    return out


def run_arm(arm: str, kit, eval_dataset, opts, seed: int, initial: float) -> dict:
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix=f"mu-ablation-{arm}-") as tmp:
        trainer = build(arm, kit, opts, seed, tmp)
        timed = timed_train(trainer)
        wall, cpu_seconds, rollout = timed["wall"], timed["cpu"], timed["rollout"]
        final = _accuracy(trainer.model, trainer.processing_class, eval_dataset, kit)
    history = trainer.state.log_history
    n = len(eval_dataset)
    return dict(
        arm=arm, seed=seed, mu=1 if arm == "on_policy_grpo" else opts.updates,
        initial_accuracy=initial, final_accuracy=final,
        final_accuracy_se=math.sqrt(max(final * (1 - final), 1e-12) / n),
        wall_seconds=round(wall, 3), cpu_seconds=round(cpu_seconds, 3),
        rollout_seconds=round(rollout["seconds"], 3), rollouts=rollout["calls"], sequences=rollout["sequences"],
        sequences_per_second=rollout["sequences"] / max(rollout["seconds"], 1e-9),
        optimizer_steps=trainer.state.global_step,
        mean_reward=_mean_of(history, "reward"),
        clip_fraction=_mean_of(history, "clip_ratio/region_mean"),
        veto_fraction=_mean_of(history, "veto/fraction") or 0.0,
        trigger_fraction=_mean_of(history, "veto/trigger_fraction"),
        would_trigger_fraction=_mean_of(history, "veto/would_trigger_fraction"),
        neg_adv_ratio_mean=_mean_of(history, "mu_grpo/neg_adv_ratio_mean"),
        adaptive_clip_low=_mean_of(history, "adaptive_clip/low"),
        adaptive_clip_high=_mean_of(history, "adaptive_clip/high"),
        adaptive_clip_low_per_update=[r["adaptive_clip/low"] for r in history if "adaptive_clip/low" in r],
        adaptive_clip_high_per_update=[r["adaptive_clip/high"] for r in history if "adaptive_clip/high" in r],
        reward_per_update=[r["reward"] for r in history if "reward" in r],
        veto_fraction_per_update=[r["veto/fraction"] for r in history if "veto/fraction" in r],
    )


def summarise(runs: list[dict], n_eval: int) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue

        def mean(key, mine=mine):
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.mean(values) if values else None

        accs = [r["final_accuracy"] for r in mine]
        # Standard error of the mean over seeds, combined with the evaluation's own binomial error.
        binom = math.sqrt(sum(r["final_accuracy_se"] ** 2 for r in mine)) / len(mine)
        seeds_se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else None
        out[arm] = dict(
            label=LABELS[arm], seeds=[r["seed"] for r in mine], mu=mine[0]["mu"],
            final_accuracy=statistics.mean(accs), final_accuracy_per_seed=accs,
            final_accuracy_se_seeds=seeds_se, final_accuracy_se_eval=binom,
            initial_accuracy=mean("initial_accuracy"),
            wall_seconds=mean("wall_seconds"), cpu_seconds=mean("cpu_seconds"),
            sequences_per_second=mean("sequences_per_second"), sequences=mean("sequences"),
            optimizer_steps=mean("optimizer_steps"), mean_reward=mean("mean_reward"),
            clip_fraction=mean("clip_fraction"), veto_fraction=mean("veto_fraction"),
            trigger_fraction=mean("trigger_fraction"), would_trigger_fraction=mean("would_trigger_fraction"),
            adaptive_clip_low=mean("adaptive_clip_low"), adaptive_clip_high=mean("adaptive_clip_high"),
        )
    return out


def write_markdown(path: Path, summary: dict, opts, meta: dict) -> None:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    num = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    on = summary.get("on_policy_grpo")
    lines = [
        "# µ-GRPO veto / trust-region ablation (chain-of-thought toy task)",
        "",
        f"Generated by `benchmarks/mu_grpo_ablation.py` on {meta['created']} ({meta['threads']} torch thread(s), "
        "a 2-core machine shared with other jobs: compare the arms' wall seconds with each other only; CPU "
        "seconds of this process are the steadier figure).",
        "",
        f"Setting: {opts.updates} optimizer updates per arm of {opts.batch} completions "
        f"({opts.batch // opts.group} prompts x G = {opts.group}); stage arms: one stage of {opts.stage_prompts} "
        f"prompts x {opts.group} = {opts.stage_prompts * opts.group} completions, µ = {opts.updates} "
        f"({opts.stage_prompts * opts.group // opts.batch} mini-batches x "
        f"{opts.updates * opts.batch // (opts.stage_prompts * opts.group)} passes); lr {opts.lr} constant, "
        f"temperature {opts.temperature}, ≤ {meta['max_completion_length']} completion tokens, veto threshold "
        f"{opts.threshold}, adaptive target {opts.adaptive_target}; seeds {opts.seeds}; held-out greedy accuracy "
        f"on {opts.eval_size} problems (start: {pct(meta['initial_accuracy'])}).",
        "",
        "| arm | final accuracy (mean ± SE over seeds) | per seed | Δ vs on-policy | wall s | CPU s | "
        "CPU speed-up vs on-policy | rollout seq/s | veto fraction | (would-be) trigger fraction | clipped fraction | "
        "adaptive [low, high] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        a = summary.get(arm)
        if a is None:
            continue
        se = a["final_accuracy_se_seeds"]
        acc = pct(a["final_accuracy"]) + ("" if se is None else f" ± {100 * se:.1f}")
        delta = "-" if on is None or arm == "on_policy_grpo" else f"{100 * (a['final_accuracy'] - on['final_accuracy']):+.1f} pt"
        trig = a["trigger_fraction"] if a["trigger_fraction"] is not None else a["would_trigger_fraction"]
        speed = "-" if on is None else f"{on['cpu_seconds'] / max(a['cpu_seconds'], 1e-9):.2f}x"
        bounds = "-" if a["adaptive_clip_low"] is None else f"[{a['adaptive_clip_low']:.2f}, {a['adaptive_clip_high']:.2f}]"
        lines.append(
            f"| {a['label']} | {acc} | {', '.join(pct(x) for x in a['final_accuracy_per_seed'])} | {delta} | "
            f"{num(a['wall_seconds'], '.0f')} | {num(a['cpu_seconds'], '.0f')} | {speed} | "
            f"{num(a['sequences_per_second'], '.1f')} | {pct(a['veto_fraction'])} | {num(trig, '.4f')} | "
            f"{num(None if a['clip_fraction'] is None else 100 * a['clip_fraction'], '.2f')}% | {bounds} |"
        )
    lines += ["", f"Evaluation standard error alone (binomial, {opts.eval_size} problems, one seed): about "
              f"{100 * math.sqrt(0.25 / opts.eval_size):.1f} pt at most.", ""]
    if meta.get("verdict"):
        lines += ["## Reading", "", *meta["verdict"], ""]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[dict], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in summary]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    means = [summary[a]["final_accuracy"] * 100 for a in arms]
    errs = [(summary[a]["final_accuracy_se_seeds"] or 0) * 100 for a in arms]
    ax.barh(range(len(arms)), means, xerr=errs, color="tab:blue", alpha=0.75)
    for i, a in enumerate(arms):
        for x in summary[a]["final_accuracy_per_seed"]:
            ax.plot(100 * x, i, "k.", ms=6)
    init = summary[arms[0]]["initial_accuracy"] * 100
    ax.axvline(init, color="grey", ls="--", lw=1, label="start")
    ax.set_yticks(range(len(arms)), [summary[a]["label"] for a in arms], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(max(0.0, min(m - e for m, e in zip(means, errs)) - 6), None)
    ax.set_xlabel("held-out greedy accuracy (%), mean ± SE over seeds, dots = seeds")
    ax.legend(fontsize=8)
    ax = axes[1]
    for arm, color in (("veto_T", "tab:orange"), ("veto_S_kappa", "tab:green"), ("veto_H_kappa", "tab:red"),
                       ("veto_S_seq", "tab:purple"), ("adaptive_H_kappa", "tab:brown")):
        for k, r in enumerate(r for r in runs if r["arm"] == arm):
            ax.plot(r["veto_fraction_per_update"], color=color, alpha=0.8, label=LABELS[arm] if k == 0 else None)
    ax.set_xlabel("update within the stage (staleness)")
    ax.set_ylabel("vetoed share of trained tokens")
    ax.legend(fontsize=7)
    ax = axes[2]
    for k, r in enumerate(r for r in runs if r["arm"] == "adaptive_H_kappa"):
        ax.plot(r["adaptive_clip_low_per_update"], color="tab:blue", label="lower bound" if k == 0 else None)
        ax.plot(r["adaptive_clip_high_per_update"], color="tab:red", label="upper bound" if k == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("update within the stage")
    ax.set_ylabel("adaptive clip bound (ratio)")
    ax.set_title("adaptive trust region", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--updates", type=int, default=40, help="optimizer updates per arm (= µ of the one stage)")
    ap.add_argument("--batch", type=int, default=32, help="completions per update")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--stage-prompts", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threshold", type=float, default=1e-2, help="veto threshold")
    ap.add_argument("--adaptive-target", type=float, default=0.02)
    ap.add_argument("--eval-size", type=int, default=300)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--name", default="mu_grpo_ablation")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--append", action="store_true", help="add these seeds' runs to an existing .json (same settings)")
    ap.add_argument("--from-json", action="store_true", help="only re-render the .md and .png from the .json")
    opts = ap.parse_args(argv)
    if opts.from_json:
        out = Path(opts.out)
        data = json.loads((out / f"{opts.name}.json").read_text())
        saved = argparse.Namespace(**{**data["meta"]["options"], "out": opts.out})
        write_markdown(out / f"{opts.name}.md", data["summary"], saved, data["meta"])
        plot(out / f"{opts.name}.png", data["runs"], data["summary"])
        return 0
    if opts.quick:
        opts.seeds, opts.updates, opts.stage_prompts, opts.eval_size = "0", 4, 8, 50
        opts.arms = "on_policy_grpo,veto_H_kappa,adaptive_H_kappa"
    seeds = [int(s) for s in opts.seeds.split(",")]
    arms = [a for a in opts.arms.split(",") if a]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    kit = toy.prepare(task="chain", verbose=False)
    eval_dataset = kit.eval_dataset.select(range(min(opts.eval_size, len(kit.eval_dataset))))
    init_trainer = build("on_policy_grpo", kit, opts, seeds[0], tempfile.mkdtemp(prefix="mu-ablation-init-"))
    initial = _accuracy(init_trainer.model, init_trainer.processing_class, eval_dataset, kit)
    del init_trainer
    meta = dict(created=time.strftime("%Y-%m-%d %H:%M:%S"), threads=torch.get_num_threads(),
                max_completion_length=kit.max_completion_length, initial_accuracy=initial,
                options={k: v for k, v in vars(opts).items() if k != "out"}, warm_start=kit.warmstart.get("probe_accuracy"))
    runs: list[dict] = []
    json_path = out / f"{opts.name}.json"
    if opts.append and json_path.exists():
        previous = json.loads(json_path.read_text())
        keep = ("updates", "batch", "group", "stage_prompts", "lr", "temperature", "threshold", "adaptive_target",
                "eval_size")
        if any(previous["meta"]["options"][k] != getattr(opts, k) for k in keep):
            raise SystemExit(f"--append: {json_path} was made with other settings; use the same ones or another --name")
        runs = previous["runs"]
        meta["options"]["seeds"] = ",".join(sorted({str(r["seed"]) for r in runs} | set(opts.seeds.split(","))))
        meta["options"]["arms"] = previous["meta"]["options"]["arms"]
    for seed in seeds:
        for arm in arms:
            t0 = time.time()
            runs.append(run_arm(arm, kit, eval_dataset, opts, seed, initial))
            r = runs[-1]
            print(f"[{time.strftime('%H:%M:%S')}] seed {seed} {arm}: acc {r['final_accuracy']:.3f} wall "
                  f"{r['wall_seconds']:.0f}s veto {r['veto_fraction']:.4f} (took {time.time() - t0:.0f}s)", flush=True)
            summary = summarise(runs, len(eval_dataset))
            json_path.write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=1))
    write_markdown(out / f"{opts.name}.md", summary, opts, meta)
    plot(out / f"{opts.name}.png", runs, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
