"""µ-GRPO end-to-end speed-up on the toy task: on-policy GRPO vs naive large µ vs µ-GRPO, same updates.

Three arms, same warm-started toy policy, same seed(s), same number of optimizer updates, same
completions per update, learning rate, loss (GRPO's seq-mean-token-mean, beta 0, group-std
advantages) and the same prompts (one pass over the same number of generated completions unless
``--passes`` > 1):

* ``on_policy_grpo`` — our GRPO (``GRPOVariantTrainer``), one rollout of one update's worth of
  completions per update (µ = 1), clip [0.8, 1.2];
* ``naive_large_mu`` — ``MuGRPOTrainer`` stages (``--stage-prompts`` prompts x G completions,
  µ = passes x mini-batches per stage) with standard clipping [0.8, 1.2] and no veto;
* ``mu_grpo`` — the same stages with relaxed clipping [0, 5] and the H_kappa negative-advantage veto
  (threshold 1e-4): the paper's method.

Measured per arm: held-out greedy accuracy (``toy.evaluate``; ``--eval-size`` problems, at the start,
at every stage boundary and at the end; evaluation time excluded), training wall seconds, rollout
throughput (sequences per second spent in the rollout phase: generation + scoring + behaviour
log-probs) and HF-generate-only throughput. Speed-ups are ratios of the arms' wall seconds measured
in this one run; the arms alternate seed by seed so that background load hits all of them.

    python benchmarks/mu_grpo_speedup.py            # full run: 128 updates x 3 arms x 2 seeds (~4 min, quiet CPU)
    python benchmarks/mu_grpo_speedup.py --passes 2 # each stored response used twice (µ = 64, half the rollouts)
    python benchmarks/mu_grpo_speedup.py --quick    # end-to-end check (a couple of minutes)

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
REPO = HERE.parent
os.environ.setdefault("GRPO_VARIANTS_CACHE", str(REPO / ".cache" / "grpo_variants"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig, MuGRPOTrainer, toy  # noqa: E402

ARMS = ("on_policy_grpo", "naive_large_mu", "mu_grpo")
LABELS = {
    "on_policy_grpo": "on-policy GRPO (µ=1)",
    "naive_large_mu": "naive large µ ([0.8,1.2], no veto)",
    "mu_grpo": "µ-GRPO ([0,5] + H_kappa veto)",
}


class StepEvalCallback(TrainerCallback):
    """Held-out greedy accuracy at the start, every ``every`` updates and at the end (eval time excluded)."""

    def __init__(self, trainer, eval_dataset, every: int):
        self.trainer, self.eval_dataset, self.every = trainer, eval_dataset, every
        self.curve: list[dict] = []
        self.eval_seconds = 0.0
        self.eval_cpu_seconds = 0.0
        self._start = None

    def _evaluate(self, state) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        accuracy = toy.evaluate(self.trainer.model, self.eval_dataset, self.trainer.processing_class)
        self.eval_seconds += time.perf_counter() - start
        self.eval_cpu_seconds += time.process_time() - cpu
        seconds = time.perf_counter() - self._start - self.eval_seconds
        self.curve.append(dict(step=state.global_step, seconds=round(seconds, 3), accuracy=accuracy))

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._evaluate(state)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self._evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.curve[-1]["step"] != state.global_step:
            self._evaluate(state)


def build(arm: str, kit, opts, seed: int, output_dir: str):
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.group,
        max_completion_length=6,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        temperature=1.0,
        loss_type="grpo",
        scale_rewards="group",
        beta=0.0,
        max_steps=opts.updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
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
        evaluator = StepEvalCallback(trainer, eval_dataset, opts.mu)
        trainer.add_callback(evaluator)
        # Time the outermost rollout call (generation + scoring + behaviour log-probs + memory release).
        rollout = {"seconds": 0.0, "sequences": 0, "calls": 0}
        inner = trainer._generate_and_score_completions

        def timed_rollout(inputs):
            start = time.perf_counter()
            out = inner(inputs)
            if trainer.model.training:
                rollout["seconds"] += time.perf_counter() - start
                rollout["sequences"] += len(inputs) * trainer.accelerator.num_processes
                rollout["calls"] += 1
            return out

        trainer._generate_and_score_completions = timed_rollout
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        wall = time.perf_counter() - start - evaluator.eval_seconds
        cpu_seconds = time.process_time() - cpu - evaluator.eval_cpu_seconds
    history = trainer.state.log_history
    generate_seconds = sum(r["time/generation_s"] for r in history if "time/generation_s" in r)
    return dict(
        arm=arm,
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


def summarise(runs: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]

        def mean(key, mine=mine):
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.mean(values) if values else None

        out[arm] = dict(
            label=LABELS[arm],
            seeds=[r["seed"] for r in mine],
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
    out["end_to_end_speedup"] = on["wall_seconds"] / max(mu["wall_seconds"], 1e-9)
    out["rollout_speedup"] = mu["sequences_per_second"] / max(on["sequences_per_second"], 1e-9)
    by_seed = {(r["arm"], r["seed"]): r for r in runs}
    out["end_to_end_speedup_per_seed"] = [
        by_seed[("on_policy_grpo", seed)]["wall_seconds"] / max(by_seed[("mu_grpo", seed)]["wall_seconds"], 1e-9)
        for seed in on["seeds"]
    ]
    out["end_to_end_speedup_cpu_seconds"] = on["cpu_seconds"] / max(mu["cpu_seconds"], 1e-9)
    out["naive_end_to_end_speedup"] = on["wall_seconds"] / max(naive["wall_seconds"], 1e-9)
    out["accuracy_mu_grpo_minus_on_policy"] = mu["final_accuracy"] - on["final_accuracy"]
    out["accuracy_naive_minus_on_policy"] = naive["final_accuracy"] - on["final_accuracy"]
    return out


def write_markdown(path: Path, summary: dict, opts, meta: dict) -> None:
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
    stage_completions = opts.stage_prompts * opts.group
    lines = [
        "# µ-GRPO vs on-policy GRPO on the toy task (same updates, same seeds)",
        "",
        f"Warm-started toy policy (held-out greedy accuracy at start {pct(arms[0]['initial_accuracy'])}); "
        f"{opts.updates} optimizer updates of {opts.batch} completions ({opts.batch // opts.group} prompts x "
        f"{opts.group}); lr {opts.lr:g} constant; GRPO loss (seq-mean-token-mean), beta 0. Stage arms: "
        f"{opts.stage_prompts} prompts x {opts.group} = {stage_completions} completions per stage "
        f"({stage_completions // opts.batch} mini-batches, µ = {opts.mu}, {opts.updates // opts.mu} stages, generated "
        f"in chunks of {opts.chunk_prompts or opts.stage_prompts} prompts). Seeds {meta['seeds']}, "
        f"{meta['eval_size']} held-out problems, torch threads: {meta['torch_threads']}. "
        f"Mode: {'quick' if opts.quick else 'full'}. Load average at start / end: {meta['load_start']} / "
        f"{meta['load_end']}.",
        "",
        "| metric | " + " | ".join(LABELS[a] for a in ARMS) + " |",
        "|---|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        f"**End-to-end speed-up of µ-GRPO over on-policy GRPO: {summary['end_to_end_speedup']:.2f}x** (ratio of "
        f"training wall seconds measured in this run; per seed "
        f"{', '.join(f'{x:.2f}x' for x in summary['end_to_end_speedup_per_seed'])}; by process CPU seconds "
        f"{summary['end_to_end_speedup_cpu_seconds']:.2f}x); rollout-throughput ratio "
        f"{summary['rollout_speedup']:.2f}x; "
        f"naive large µ: {summary['naive_end_to_end_speedup']:.2f}x. Accuracy difference vs on-policy: µ-GRPO "
        f"{100 * summary['accuracy_mu_grpo_minus_on_policy']:+.1f} points, naive large µ "
        f"{100 * summary['accuracy_naive_minus_on_policy']:+.1f} points.",
        "",
        "Paper (arXiv:2605.17570, GPU clusters, LLMs): 1.53x end to end and 1.82x rollout speed at equal "
        "accuracy; naive GRPO at µ = 1,024 loses accuracy. Here a gain can only come from larger generation "
        "batches and fewer generate/score phases (HF generate alone: "
        f"{arms[2]['generate_only_sequences_per_second'] / max(arms[0]['generate_only_sequences_per_second'], 1e-9):.2f}x "
        "the on-policy arm's sequences/s; the same number of sequences is generated"
        + (")" if opts.passes == 1 else f" ÷ {opts.passes}: each stored response is used {opts.passes} times)")
        + ". The stage arms also pay costs on-policy GRPO does not have on this path: one extra forward pass "
        "over every sequence for the behaviour log-probs (with HF generate and µ = 1 the ratio is 1 and TRL skips "
        "it; with vLLM both pay it), and TRL's data loader re-reads and re-sends the whole stage's prompt rows at "
        "every update. A toy completion is 3-6 tokens, so generation is a small share of a step here, unlike the "
        "long chains of thought the paper measures. The veto fires only when pi_theta / pi_behav < 1e-4 on a "
        "negative-advantage token and relaxed clipping only outside [0, 5]; the vetoed and clipped rows show whether "
        "either was active in this regime. With "
        f"{meta['eval_size']} held-out problems one accuracy value has a standard error of about "
        f"{100 * (0.25 / meta['eval_size']) ** 0.5:.1f} points.",
        "",
        f"Command: `{meta['command']}`. Plot: mu_grpo.png.",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"on_policy_grpo": "tab:blue", "naive_large_mu": "tab:gray", "mu_grpo": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in runs:
        label = f"{LABELS[run['arm']]}, seed {run['seed']}"
        ys = [p["accuracy"] for p in run["curve"]]
        style = "o-" if run["seed"] == runs[0]["seed"] else "s--"
        axes[0].plot([p["step"] for p in run["curve"]], ys, style, ms=3, color=colors[run["arm"]], alpha=0.85,
                     label=label)
        axes[1].plot([p["seconds"] for p in run["curve"]], ys, style, ms=3, color=colors[run["arm"]], alpha=0.85,
                     label=label)
    axes[0].set_xlabel("optimizer updates")
    axes[1].set_xlabel("training seconds (evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("µ-GRPO vs on-policy GRPO vs naive large µ, toy addition task, same updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run: an end-to-end check")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 (quick: 0)")
    parser.add_argument("--updates", type=int, default=None, help="optimizer updates per arm (default 128; quick 8)")
    parser.add_argument("--batch", type=int, default=None, help="completions per update (default 128; quick 64)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--stage-prompts", type=int, default=None, help="prompts per stage (default 512; quick 32)")
    parser.add_argument("--passes", type=int, default=1, help="times each stored response is used (µ = passes x "
                        "mini-batches per stage); 1 = the same sequences as on-policy GRPO")
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
    opts.updates = opts.updates or (8 if opts.quick else 128)
    opts.batch = opts.batch or (64 if opts.quick else 128)
    opts.stage_prompts = opts.stage_prompts or (32 if opts.quick else 512)
    if opts.chunk_prompts is None and not opts.quick:
        opts.chunk_prompts = min(256, opts.stage_prompts)
    opts.eval_size = opts.eval_size or (100 if opts.quick else 500)
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    opts.mu = opts.passes * mini_batches
    if opts.updates % opts.mu:
        parser.error(f"--updates ({opts.updates}) must be a multiple of µ = {opts.mu} (whole stages).")
    torch.set_num_threads(opts.threads)

    kit = toy.prepare(task="addition", verbose=True)
    eval_dataset = kit.eval_dataset.select(range(min(opts.eval_size, len(kit.eval_dataset))))
    if not opts.no_warmup:  # the first training run in a process pays one-off start-up costs: keep them out
        warm = argparse.Namespace(**{**vars(opts), "updates": 2})
        with tempfile.TemporaryDirectory(prefix="mu-bench-warmup-") as tmp:
            build("on_policy_grpo", kit, warm, opts.seeds[0], tmp).train()
    load_start = round(os.getloadavg()[0], 2)
    runs = []
    for seed in opts.seeds:
        for arm in ARMS:
            print(f"[mu_grpo_speedup] {arm} seed {seed}: {opts.updates} updates", flush=True)
            run = run_arm(arm, kit, eval_dataset, opts, seed)
            print(f"[mu_grpo_speedup] {arm} seed {seed}: accuracy {run['initial_accuracy']:.1%} -> "
                  f"{run['final_accuracy']:.1%}, {run['wall_seconds']:.1f} s (rollout {run['rollout_seconds']:.1f} s, "
                  f"{run['rollouts']} rollouts, {run['sequences_per_second']:.0f} seq/s), clipped "
                  f"{run['clip_region_fraction'] or 0:.3f}, vetoed {run['veto_fraction'] or 0:.4f}", flush=True)
            runs.append(run)
    summary = summarise(runs)
    meta = dict(command="python benchmarks/mu_grpo_speedup.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                seeds=opts.seeds, eval_size=len(eval_dataset), updates=opts.updates, batch=opts.batch,
                group=opts.group, stage_prompts=opts.stage_prompts, mu=opts.mu, passes=opts.passes,
                chunk_prompts=opts.chunk_prompts, lr=opts.lr, quick=opts.quick, torch_threads=torch.get_num_threads(),
                load_start=load_start, load_end=round(os.getloadavg()[0], 2),
                warmstart_probe_accuracy=kit.warmstart.get("probe_accuracy"))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "meta": meta,
        "end_to_end_speedup": summary["end_to_end_speedup"],
        "end_to_end_speedup_per_seed": summary["end_to_end_speedup_per_seed"],
        "end_to_end_speedup_cpu_seconds": summary["end_to_end_speedup_cpu_seconds"],
        "rollout_speedup": summary["rollout_speedup"],
        "naive_end_to_end_speedup": summary["naive_end_to_end_speedup"],
        "accuracy_mu_grpo_minus_on_policy": summary["accuracy_mu_grpo_minus_on_policy"],
        "accuracy_naive_minus_on_policy": summary["accuracy_naive_minus_on_policy"],
        **{arm: summary[arm] for arm in ARMS},
        "runs": runs,
    }
    (out / "mu_grpo.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "mu_grpo.md", summary, opts, meta)
    plot(out / "mu_grpo.png", runs)
    print((out / "mu_grpo.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
