"""µ-GRPO end-to-end speed-up on the chain-of-thought toy task, where generation is most of a step.

Arms, same warm-started chain policy (``toy.prepare(task="chain")``, completions up to 56 tokens), same
seeds, same number of optimizer updates, same completions per update, learning rate, temperature and loss
(GRPO's seq-mean-token-mean, group-std advantages, k3 KL to the reference with ``--beta`` the same in every
arm, default 0.04 as in DeepSeekMath and ``reasoning_grpo.md``):

* ``on_policy_grpo`` — our GRPO (``GRPOVariantTrainer``), one rollout of one update's worth of
  completions per update (µ = 1), clip [0.8, 1.2];
* ``naive_large_mu`` — ``MuGRPOTrainer`` stages (``--stage-prompts`` prompts x G completions, µ =
  passes x mini-batches per stage) with standard clipping [0.8, 1.2] and no veto;
* ``relaxed_no_veto`` — the same stages with relaxed clipping [0, 5] and no veto;
* ``mu_grpo`` — [0, 5] + the H_kappa negative-advantage veto (``--veto-threshold``, the paper's 1e-4):
  the paper's method;
* ``adaptive_mu_grpo`` — the adaptive trust region (``adaptive_clip_target``, bounds re-chosen at
  every update within [0, 0.8] x [1.2, 5]) + the H_kappa veto (beyond the paper).

The stage arms run once per stage setting in ``--passes`` (times each stored response is used); the
on-policy runs are shared by the settings. Measured per run: held-out greedy accuracy
(``toy_reasoning.evaluate`` on ``--eval-size`` problems, at the start, every ``--eval-every`` updates and
at the end; evaluation time excluded), training wall seconds and process CPU seconds, rollout throughput
(sequences and generated tokens per second of the rollout phase), HF-generate-only throughput, and the time
per phase: generation (HF generate, behaviour log-probs recorded on the way), reward, behaviour /
reference log-prob forward passes, the rest of the rollout (tokenising, advantages, concatenation), and
update + other (forward / backward / optimizer step / logging). Speed-ups are ratios of the arms' training
wall seconds measured in this one run; the arms alternate seed by seed (their order rotated per seed), so
background load hits all of them. The JSON is rewritten after every run (a cut-short run keeps what
finished).

    python benchmarks/mu_grpo_speedup.py                    # full run: 3 seeds x 5 arms x 40 updates of 128
    python benchmarks/mu_grpo_speedup.py --passes 4 2       # several stage settings side by side (µ = 40, 20)
    python benchmarks/mu_grpo_speedup.py --quick            # end-to-end check (a few minutes)
    python benchmarks/mu_grpo_speedup.py --from-json        # re-render .md / .png from the .json

Writes benchmarks/results/mu_grpo.json, mu_grpo.md and mu_grpo.png (``--out`` / ``--name`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from _bench import HeldOutEval, mu_arm_fields, timed_train, toy_run_config  # noqa: E402  (sets the offline environment first)

import torch  # noqa: E402

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig, MuGRPOTrainer, toy  # noqa: E402
from grpo_variants.tasks import toy_reasoning  # noqa: E402

ARMS = ("on_policy_grpo", "naive_large_mu", "relaxed_no_veto", "mu_grpo", "adaptive_mu_grpo")
STAGE_ARMS = ARMS[1:]
LABELS = {
    "on_policy_grpo": "on-policy GRPO (µ=1)",
    "naive_large_mu": "naive large µ ([0.8,1.2], no veto)",
    "relaxed_no_veto": "relaxed [0,5], no veto",
    "mu_grpo": "µ-GRPO ([0,5] + H_kappa veto)",
    "adaptive_mu_grpo": "adaptive trust region + H_kappa veto",
}
PHASES = ("generation", "reward", "logprobs", "rollout_other", "update_other")
PHASE_LABELS = {
    "generation": "generation (HF generate)",
    "reward": "reward",
    "logprobs": "behaviour / reference log-prob passes",
    "rollout_other": "rest of the rollout (tokenise, advantages, ...)",
    "update_other": "update + other (forward/backward/optimizer/logging)",
}


def build(arm: str, kit, opts, seed: int, output_dir: str):
    common = toy_run_config(output_dir, seed, opts.batch, opts.group, opts.lr, loss_type="grpo",
                            scale_rewards="group", beta=opts.beta, kl_estimator="k3", use_bias_correction_kl=False,
                            max_steps=opts.updates,
                            max_completion_length=kit.max_completion_length, temperature=opts.temperature)
    if arm == "on_policy_grpo":
        return GRPOVariantTrainer(model=kit.model_path, reward_funcs=kit.reward,
                                  args=GRPOVariantConfig(epsilon=0.2, **common), train_dataset=kit.train_dataset)
    stage = dict(stage_prompts=opts.stage_prompts, updates_per_stage=opts.mu,
                 generation_chunk_prompts=opts.chunk_prompts)
    if arm != "naive_large_mu":
        stage["veto_threshold"] = opts.veto_threshold
    config = MuGRPOConfig(**mu_arm_fields(arm, opts.adaptive_target), **stage, **common)
    return MuGRPOTrainer(model=kit.model_path, reward_funcs=kit.reward, args=config, train_dataset=kit.train_dataset)


def _values(history, key):
    return [r[key] for r in history if key in r and r[key] is not None and math.isfinite(r[key])]


def _mean_of(history, key):
    values = _values(history, key)
    return statistics.mean(values) if values else None


def run_arm(arm: str, kit, eval_dataset, opts, seed: int) -> dict:
    torch.manual_seed(seed)

    def accuracy(model, tokenizer):
        return toy_reasoning.evaluate(model, eval_dataset, tokenizer, max_new_tokens=kit.max_completion_length)

    with tempfile.TemporaryDirectory(prefix=f"mu-bench-{arm}-") as tmp:
        trainer = build(arm, kit, opts, seed, tmp)
        evaluator = HeldOutEval(trainer, eval_dataset, every_steps=opts.eval_every, evaluate=accuracy)
        trainer.add_callback(evaluator)
        timed = timed_train(trainer, evaluator)
        tokens = int(trainer._tokens_generated_total)
    history = trainer.state.log_history
    wall, cpu_seconds, rollout, phase = timed["wall"], timed["cpu"], timed["rollout"], timed["phase"]
    n_eval = len(eval_dataset)
    final = evaluator.curve[-1]["accuracy"]
    return dict(
        arm=arm,
        passes=None if arm == "on_policy_grpo" else opts.passes,
        mu=1 if arm == "on_policy_grpo" else opts.mu,
        seed=seed,
        final_accuracy=final,
        final_accuracy_eval_se=math.sqrt(max(final * (1 - final), 0.0) / n_eval),
        initial_accuracy=evaluator.curve[0]["accuracy"],
        best_accuracy=max(pt["accuracy"] for pt in evaluator.curve),
        wall_seconds=round(wall, 3),
        cpu_seconds=round(cpu_seconds, 3),
        rollout_seconds=round(rollout["seconds"], 3),
        phase_seconds={k: round(v, 3) for k, v in phase.items()},
        rollouts=rollout["calls"],
        sequences=rollout["sequences"],
        generated_tokens=tokens,
        sequences_per_second=rollout["sequences"] / max(rollout["seconds"], 1e-9),
        tokens_per_second=tokens / max(rollout["seconds"], 1e-9),
        generate_only_sequences_per_second=rollout["sequences"] / max(phase["generation"], 1e-9),
        generate_only_tokens_per_second=tokens / max(phase["generation"], 1e-9),
        optimizer_steps=trainer.state.global_step,
        mean_reward=_mean_of(history, "reward"),
        clip_region_fraction=_mean_of(history, "clip_ratio/region_mean"),
        veto_fraction=_mean_of(history, "veto/fraction"),
        would_trigger_fraction=_mean_of(history, "veto/would_trigger_fraction"),
        useful_token_fraction=_mean_of(history, "useful_token_fraction"),
        mean_staleness=_mean_of(history, "mu_grpo/staleness") or 0.0,
        adaptive_clip_low=_mean_of(history, "adaptive_clip/low"),
        adaptive_clip_high=_mean_of(history, "adaptive_clip/high"),
        behaviour_logprobs_recorded=len(_values(history, "rollout_logprobs/recorded")),
        curve=evaluator.curve,
    )


def _se(values):
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def summarise(runs: list[dict], passes: int) -> dict:
    """The arms of one stage setting (stage arms with ``passes``; the on-policy runs are shared)."""
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm and (arm == "on_policy_grpo" or r["passes"] == passes)]
        if not mine:
            continue

        def mean(key, mine=mine):
            values = [r[key] for r in mine if r[key] is not None]
            return statistics.mean(values) if values else None

        accs = [r["final_accuracy"] for r in mine]
        out[arm] = dict(
            label=LABELS[arm],
            seeds=[r["seed"] for r in mine],
            mu=mine[0]["mu"],
            final_accuracy=statistics.mean(accs),
            final_accuracy_se=_se(accs),
            final_accuracy_per_seed=accs,
            final_accuracy_eval_se=math.sqrt(sum(r["final_accuracy_eval_se"] ** 2 for r in mine)) / len(mine),
            initial_accuracy=mean("initial_accuracy"),
            best_accuracy=mean("best_accuracy"),
            wall_seconds=mean("wall_seconds"),
            wall_seconds_per_seed=[r["wall_seconds"] for r in mine],
            cpu_seconds=mean("cpu_seconds"),
            cpu_seconds_per_seed=[r["cpu_seconds"] for r in mine],
            phase_seconds={p: statistics.mean(r["phase_seconds"][p] for r in mine) for p in PHASES},
            rollout_seconds=mean("rollout_seconds"),
            sequences_per_second=mean("sequences_per_second"),
            tokens_per_second=mean("tokens_per_second"),
            generate_only_sequences_per_second=mean("generate_only_sequences_per_second"),
            generate_only_tokens_per_second=mean("generate_only_tokens_per_second"),
            rollouts=mean("rollouts"),
            sequences=mean("sequences"),
            generated_tokens=mean("generated_tokens"),
            optimizer_steps=mean("optimizer_steps"),
            mean_reward=mean("mean_reward"),
            clip_region_fraction=mean("clip_region_fraction"),
            veto_fraction=mean("veto_fraction"),
            would_trigger_fraction=mean("would_trigger_fraction"),
            useful_token_fraction=mean("useful_token_fraction"),
            mean_staleness=mean("mean_staleness"),
            adaptive_clip_low=mean("adaptive_clip_low"),
            adaptive_clip_high=mean("adaptive_clip_high"),
            behaviour_logprobs_recorded=mean("behaviour_logprobs_recorded"),
        )
    out["passes"] = passes
    out["mu"] = next((r["mu"] for r in runs if r["passes"] == passes), None)
    on = out.get("on_policy_grpo")
    by_seed = {(r["arm"], r["seed"]): r for r in runs if r["arm"] == "on_policy_grpo" or r["passes"] == passes}
    for arm in STAGE_ARMS:
        a = out.get(arm)
        if a is None or on is None:
            continue
        common = [s for s in on["seeds"] if (arm, s) in by_seed]
        wall_on = statistics.mean(by_seed[("on_policy_grpo", s)]["wall_seconds"] for s in common)
        wall_arm = statistics.mean(by_seed[(arm, s)]["wall_seconds"] for s in common)
        cpu_on = statistics.mean(by_seed[("on_policy_grpo", s)]["cpu_seconds"] for s in common)
        cpu_arm = statistics.mean(by_seed[(arm, s)]["cpu_seconds"] for s in common)
        diffs = [by_seed[(arm, s)]["final_accuracy"] - by_seed[("on_policy_grpo", s)]["final_accuracy"] for s in common]
        a["end_to_end_speedup"] = wall_on / max(wall_arm, 1e-9)
        a["end_to_end_speedup_per_seed"] = [
            by_seed[("on_policy_grpo", s)]["wall_seconds"] / max(by_seed[(arm, s)]["wall_seconds"], 1e-9)
            for s in common
        ]
        a["end_to_end_speedup_cpu_seconds"] = cpu_on / max(cpu_arm, 1e-9)
        a["rollout_throughput_speedup"] = a["sequences_per_second"] / max(on["sequences_per_second"], 1e-9)
        a["accuracy_minus_on_policy"] = statistics.mean(diffs)
        a["accuracy_minus_on_policy_paired_se"] = _se(diffs)
        se_on = on["final_accuracy_se"]
        gap = abs(a["final_accuracy"] - on["final_accuracy"])
        a["within_one_se_of_on_policy"] = None if se_on is None else gap <= se_on
    return out


def _pct(x, digits=1):
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _num(x, f=".2f"):
    return "-" if x is None else format(x, f)


def _acc_text(a):
    se = a.get("final_accuracy_se")
    return _pct(a["final_accuracy"]) + ("" if se is None else f" ± {100 * se:.1f}")


def _setting_text(summary: dict, opts) -> str:
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    p = summary["passes"]
    reuse = ("each stored response used once: the same sequences as on-policy GRPO" if p == 1 else
             f"each stored response used {p} times: 1/{p} of on-policy GRPO's sequences")
    return (f"µ = {summary['mu']} ({opts.updates // summary['mu']} stage(s) of {opts.stage_prompts} prompts x "
            f"{opts.group} = {opts.stage_prompts * opts.group} completions, {mini_batches} mini-batches x {p} "
            f"pass(es); {reuse})")


def _table(summary: dict) -> list[str]:
    arms = [a for a in ARMS if a in summary]
    rows_of = [summary[a] for a in arms]

    def phase_row(p):
        return (f"  {PHASE_LABELS[p]} s", *[_num(a["phase_seconds"][p], ".1f") for a in rows_of])

    rows = [
        ("final held-out accuracy (greedy, mean ± s.e. over seeds)", *[_acc_text(a) for a in rows_of]),
        ("per seed", *[", ".join(_pct(x) for x in a["final_accuracy_per_seed"]) for a in rows_of]),
        ("Δ accuracy vs on-policy (paired mean ± s.e.)",
         *["-" if a is summary.get("on_policy_grpo") else
           f"{100 * a['accuracy_minus_on_policy']:+.1f}"
           + ("" if a["accuracy_minus_on_policy_paired_se"] is None else
              f" ± {100 * a['accuracy_minus_on_policy_paired_se']:.1f} pt") for a in rows_of]),
        ("end-to-end speed-up vs on-policy (wall; per seed)",
         *["1.00x" if a is summary.get("on_policy_grpo") else
           f"**{a['end_to_end_speedup']:.2f}x** ({', '.join(f'{x:.2f}' for x in a['end_to_end_speedup_per_seed'])})"
           for a in rows_of]),
        ("speed-up by process CPU seconds",
         *["1.00x" if a is summary.get("on_policy_grpo") else f"{a['end_to_end_speedup_cpu_seconds']:.2f}x"
           for a in rows_of]),
        ("training wall seconds (eval excluded)", *[_num(a["wall_seconds"], ".1f") for a in rows_of]),
        ("training CPU seconds (this process)", *[_num(a["cpu_seconds"], ".1f") for a in rows_of]),
        *[phase_row(p) for p in PHASES],
        ("rollout throughput: sequences/s", *[_num(a["sequences_per_second"], ".1f") for a in rows_of]),
        ("rollout throughput: tokens/s", *[_num(a["tokens_per_second"], ",.0f") for a in rows_of]),
        ("HF generate only: sequences/s", *[_num(a["generate_only_sequences_per_second"], ".1f") for a in rows_of]),
        ("rollouts (generate/score phases)", *[_num(a["rollouts"], ".0f") for a in rows_of]),
        ("sequences generated", *[_num(a["sequences"], ",.0f") for a in rows_of]),
        ("tokens generated", *[_num(a["generated_tokens"], ",.0f") for a in rows_of]),
        ("optimizer updates", *[_num(a["optimizer_steps"], ".0f") for a in rows_of]),
        ("mean staleness (updates)", *[_num(a["mean_staleness"], ".1f") for a in rows_of]),
        ("clipped tokens (region)", *[_pct(a["clip_region_fraction"], 2) for a in rows_of]),
        ("vetoed tokens (veto_fraction)", *[_pct(a["veto_fraction"], 3) for a in rows_of]),
        ("would-be veto triggers (arms without veto)", *[_pct(a["would_trigger_fraction"], 3) for a in rows_of]),
        ("adaptive bounds [low, high] (mean)",
         *["-" if a["adaptive_clip_low"] is None else f"[{a['adaptive_clip_low']:.2f}, {a['adaptive_clip_high']:.2f}]"
           for a in rows_of]),
        ("useful-token fraction", *[_num(a["useful_token_fraction"], ".3f") for a in rows_of]),
        ("mean training reward", *[_num(a["mean_reward"], ".3f") for a in rows_of]),
    ]
    return [
        "| metric | " + " | ".join(LABELS[a] for a in arms) + " |",
        "|---|" + "---|" * len(arms),
        *["| " + " | ".join(r) + " |" for r in rows],
    ]


def _speed_argument(summary: dict) -> str | None:
    """Predicted speed-up from on-policy GRPO's rollout share, the batching gain and the reuse, vs measured."""
    on, mu = summary.get("on_policy_grpo"), summary.get("mu_grpo")
    if on is None or mu is None:
        return None
    share = on["rollout_seconds"] / max(on["wall_seconds"], 1e-9)
    gain = mu["sequences_per_second"] / max(on["sequences_per_second"], 1e-9)
    passes = summary["passes"]
    update_ratio = mu["phase_seconds"]["update_other"] / max(on["phase_seconds"]["update_other"], 1e-9)
    predicted = 1.0 / ((1 - share) + share / (gain * passes))
    return (f"Speed argument (µ = {summary['mu']}): the rollout is {100 * share:.0f}% of on-policy GRPO's training "
            f"wall time; the stage rollout runs {gain:.2f}x faster per sequence (batching gain) and generates "
            f"1/{passes} of the sequences (reuse); with the update unchanged that predicts 1 / ((1 - {share:.2f}) + "
            f"{share:.2f} / ({gain:.2f} x {passes})) = {predicted:.2f}x, measured {mu['end_to_end_speedup']:.2f}x "
            f"(µ-GRPO's update + other time is {update_ratio:.2f}x on-policy's).")


def write_markdown(path: Path, settings: list[dict], opts, meta: dict) -> None:
    head = settings[0]
    on = head.get("on_policy_grpo")
    se = 100 * (0.25 / meta["eval_size"]) ** 0.5
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    lines = [
        f"# µ-GRPO vs on-policy GRPO on the chain-of-thought toy task (same updates, same seeds): µ = {head['mu']}",
        "",
        f"Generated by `benchmarks/mu_grpo_speedup.py` on {meta['created']}. Warm-started chain policy "
        f"(`toy.prepare(task=\"chain\")`, ≤ {meta['max_completion_length']} completion tokens; held-out greedy "
        f"accuracy at start {_pct(on['initial_accuracy']) if on else '-'}); {opts.updates} optimizer updates of "
        f"{opts.batch} completions ({opts.batch // opts.group} prompts x {opts.group}) in every arm; lr {opts.lr:g} "
        f"constant, temperature {opts.temperature}, beta {opts.beta:g} (every arm), GRPO loss (seq-mean-token-mean), "
        f"group-std advantages; veto threshold {opts.veto_threshold:g} (the paper's 1e-4 unless changed), adaptive "
        f"target {opts.adaptive_target:g}. Stage arms: stages of {opts.stage_prompts} prompts x {opts.group} = "
        f"{opts.stage_prompts * opts.group} completions = {mini_batches} mini-batches, generated in "
        + ("one HF generate call per stage" if not opts.chunk_prompts else f"chunks of {opts.chunk_prompts} prompts")
        + f". Seeds {meta['seeds']}; {meta['eval_size']} held-out problems (one accuracy value has a binomial "
        f"standard error of about {se:.1f} points; the ± below are standard errors of the mean over seeds). Torch "
        f"threads: {meta['torch_threads']}, on a 2-core machine shared with other jobs (load average at start / end "
        f"{meta['load_start']} / {meta['load_end']}): wall seconds include waiting for the CPU, process CPU seconds "
        f"are the steadier figure; both are reported. Mode: {'quick' if opts.quick else 'full'}.",
        "",
        "| stage setting | sequences (stage / on-policy) | accuracy on-policy / naive / relaxed / µ-GRPO / adaptive | "
        "µ-GRPO speed-up wall (CPU) | µ-GRPO within 1 s.e. of on-policy |",
        "|---|---|---|---|---|",
    ]
    for s in settings:
        if "mu_grpo" not in s or on is None:
            continue
        accs = " / ".join(_acc_text(s[a]) if a in s else "-" for a in ARMS)
        m = s["mu_grpo"]
        lines.append(
            f"| µ = {s['mu']}, {s['passes']} pass(es) | {m['sequences']:,.0f} / {on['sequences']:,.0f} | {accs} | "
            f"**{m['end_to_end_speedup']:.2f}x** ({m['end_to_end_speedup_cpu_seconds']:.2f}x) | "
            f"{ {None: '-', True: 'yes', False: 'no'}[m['within_one_se_of_on_policy']]} |"
        )
    for k, s in enumerate(settings):
        if s["mu"] is None:
            continue
        title = "Headline setting" if k == 0 else "Setting"
        lines += ["", f"## {title}: {_setting_text(s, opts)}", "", *_table(s), ""]
        arg = _speed_argument(s)
        if arg:
            lines += [arg, ""]
    if meta.get("reading"):
        lines += ["## Reading", "", *meta["reading"], ""]
    lines += [f"Command: `{meta['command']}`. Plot: {path.stem}.png.", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, runs: list[dict], passes: list[int]) -> None:
    from matplotlib.figure import Figure  # its own canvas: no global backend switch

    colors = {"on_policy_grpo": "tab:blue", "naive_large_mu": "tab:gray", "relaxed_no_veto": "tab:orange",
              "mu_grpo": "tab:red", "adaptive_mu_grpo": "tab:green"}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r["seed"] for r in runs})
    fig = Figure(figsize=(17, 4.6))
    axes = fig.subplots(1, 3)
    for arm in ARMS:
        for p in [None] if arm == "on_policy_grpo" else passes:
            mine = [r for r in runs if r["arm"] == arm and r["passes"] == p]
            if not mine:
                continue
            n = min(len(r["curve"]) for r in mine)
            curve = [100 * statistics.mean(r["curve"][i]["accuracy"] for r in mine) for i in range(n)]
            steps = [mine[0]["curve"][i]["step"] for i in range(n)]
            seconds = [statistics.mean(r["curve"][i]["seconds"] for r in mine) for i in range(n)]
            label = LABELS[arm] + ("" if p is None else f", µ = {mine[0]['mu']}") + f" ({len(mine)} seeds)"
            style = "-" if p is None else styles[passes.index(p) % len(styles)]
            for ax, xs in zip(axes[:2], (steps, seconds)):
                ax.plot(xs, curve, style, marker="o", ms=3, color=colors[arm], alpha=0.85, label=label)
    axes[0].set_xlabel("optimizer updates")
    axes[1].set_xlabel("training wall seconds (evaluation excluded)")
    for ax in axes[:2]:
        ax.set_ylabel("held-out greedy accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    # time per phase, mean over seeds, first stage setting's arms
    ax = axes[2]
    names = [("on_policy_grpo", None)] + [(a, passes[0]) for a in STAGE_ARMS]
    bars = []
    for arm, p in names:
        mine = [r for r in runs if r["arm"] == arm and r["passes"] == p]
        if mine:
            bars.append((LABELS[arm], {ph: statistics.mean(r["phase_seconds"][ph] for r in mine) for ph in PHASES}))
    left = [0.0] * len(bars)
    phase_colors = ["tab:red", "tab:olive", "tab:purple", "tab:pink", "tab:blue"]
    for ph, color in zip(PHASES, phase_colors):
        widths = [b[1][ph] for b in bars]
        ax.barh(range(len(bars)), widths, left=left, color=color, label=PHASE_LABELS[ph])
        left = [x + w for x, w in zip(left, widths)]
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("training wall seconds per run (mean over seeds)")
    ax.legend(fontsize=6, loc="lower right")
    fig.suptitle(f"µ-GRPO vs on-policy GRPO, chain-of-thought toy task, same updates, seeds {seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _reading(settings: list[dict], opts) -> list[str]:
    """Plain statements computed from the numbers (no hand-written figures)."""
    out = []
    head = settings[0]
    on = head.get("on_policy_grpo")
    if on is None:
        return out
    gain = on["final_accuracy"] - on["initial_accuracy"]
    out.append(f"- On-policy GRPO: {_pct(on['initial_accuracy'])} → {_acc_text(on)} after {opts.updates} updates "
               f"({100 * gain:+.1f} points; per seed " + ", ".join(
                   f"{100 * (x - on['initial_accuracy']):+.1f}" for x in on["final_accuracy_per_seed"]) + ").")
    for s in settings:
        m = s.get("mu_grpo")
        if m is None:
            continue
        within = m["within_one_se_of_on_policy"]
        verdict = ("no standard error with one seed" if within is None else
                   ("within" if within else "not within") + " one standard error")
        out.append(
            f"- µ = {s['mu']}: µ-GRPO {_acc_text(m)} ({verdict} of on-policy's {_acc_text(on)}), "
            f"{m['end_to_end_speedup']:.2f}x faster end to end by wall seconds "
            f"({m['end_to_end_speedup_cpu_seconds']:.2f}x by process CPU seconds); veto fraction "
            f"{_pct(m['veto_fraction'], 3)}. "
            + "; ".join(f"{LABELS[a]}: {_acc_text(s[a])}, {s[a]['end_to_end_speedup']:.2f}x"
                        for a in STAGE_ARMS if a in s and a != "mu_grpo") + ".")
        gains = ", ".join(f"{LABELS[a]} {100 * (s[a]['final_accuracy'] - s[a]['initial_accuracy']):+.1f}"
                          for a in STAGE_ARMS if a in s)
        out.append(f"- µ = {s['mu']}: gain over the start, points: on-policy {100 * gain:+.1f}; {gains}.")
        relaxed = s.get("relaxed_no_veto")
        if not m["veto_fraction"] and relaxed and relaxed["final_accuracy_per_seed"] == m["final_accuracy_per_seed"]:
            out.append(f"- µ = {s['mu']}: the veto never fired at threshold {opts.veto_threshold:g} (no "
                       "negative-advantage token's ratio fell below it), so µ-GRPO ran exactly the updates of relaxed "
                       "clipping without veto "
                       "(the same accuracy on every seed); whether the veto matters is the ablation's question "
                       "(`mu_grpo_ablation*.md`, raised thresholds).")
    return out


def _render(out: Path, name: str, runs: list[dict], opts, meta: dict) -> dict:
    settings = [summarise(runs, p) for p in opts.passes]
    head = settings[0]
    # a re-render (--from-json) keeps the run's own load_end
    meta = {"load_end": round(os.getloadavg()[0], 2), **meta, "reading": _reading(settings, opts)}
    mu = head.get("mu_grpo", {})
    result = {
        "meta": meta,
        "headline_setting": {"passes": head["passes"], "mu": head.get("mu")},
        "end_to_end_speedup": mu.get("end_to_end_speedup"),
        "end_to_end_speedup_per_seed": mu.get("end_to_end_speedup_per_seed"),
        "end_to_end_speedup_cpu_seconds": mu.get("end_to_end_speedup_cpu_seconds"),
        "rollout_throughput_speedup": mu.get("rollout_throughput_speedup"),
        "accuracy_mu_grpo_minus_on_policy": mu.get("accuracy_minus_on_policy"),
        "mu_grpo_within_one_se_of_on_policy": mu.get("within_one_se_of_on_policy"),
        "arms": {arm: head[arm] for arm in ARMS if arm in head},
        "settings": [{"passes": s["passes"], "mu": s.get("mu"), "arms": {a: s[a] for a in STAGE_ARMS if a in s}}
                     for s in settings],
        "runs": runs,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / f"{name}.md", settings, opts, meta)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run: an end-to-end check")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--updates", type=int, default=None, help="optimizer updates per arm (default 40; quick 4)")
    parser.add_argument("--batch", type=int, default=None, help="completions per update (default 128; quick 32)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--stage-prompts", type=int, default=None, help="prompts per stage (default 160; quick 8)")
    parser.add_argument("--passes", type=int, nargs="+", default=None,
                        help="stage settings: times each stored response is used (µ = passes x mini-batches per "
                        "stage); 1 = the same sequences as on-policy GRPO; the first is the headline (default 4)")
    parser.add_argument("--chunk-prompts", type=int, default=None,
                        help="prompts per HF generate call in a stage (default 80 = 640 sequences; quick: the whole "
                        "stage); 0 = the whole stage in one call")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--beta", type=float, default=0.04,
                        help="k3 KL coefficient, the same in every arm (default 0.04: the regime where on-policy GRPO "
                        "measurably learns on this task, reasoning_grpo.md; a beta-0 pilot did not)")
    parser.add_argument("--veto-threshold", type=float, default=1e-4)
    parser.add_argument("--adaptive-target", type=float, default=0.02)
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 500; quick 50)")
    parser.add_argument("--eval-every", type=int, default=None, help="updates between evaluations (default 10)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine a busy neighbour makes OpenMP "
                        "threads spin, which swamps the ratio)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the discarded 2-update warm-up run")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--name", default="mu_grpo", help="file stem of the .json / .md / .png")
    parser.add_argument("--from-json", action="store_true", help="only re-render the .md and .png from the .json")
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    if opts.from_json:
        data = json.loads((out / f"{opts.name}.json").read_text())
        saved = argparse.Namespace(**data["meta"]["options"])
        _render(out, opts.name, data["runs"], saved, {k: v for k, v in data["meta"].items() if k != "reading"})
        plot(out / f"{opts.name}.png", data["runs"], saved.passes)
        return 0
    opts.seeds = opts.seeds or ([0] if opts.quick else [0, 1, 2])
    opts.updates = opts.updates or (4 if opts.quick else 40)
    opts.batch = opts.batch or (32 if opts.quick else 128)
    opts.stage_prompts = opts.stage_prompts or (8 if opts.quick else 160)
    opts.passes = opts.passes or ([2] if opts.quick else [4])
    if opts.chunk_prompts is None and not opts.quick:
        opts.chunk_prompts = min(80, opts.stage_prompts)  # 640 sequences: the fastest HF generate batch measured here
    opts.eval_size = opts.eval_size or (50 if opts.quick else 500)
    opts.eval_every = opts.eval_every or (opts.updates if opts.quick else 20)
    if opts.chunk_prompts == 0:
        opts.chunk_prompts = None
    arms = [a for a in opts.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or "on_policy_grpo" not in arms:
        parser.error(f"--arms: unknown {unknown}; on_policy_grpo (the reference) is required; choose from {ARMS}")
    if (opts.stage_prompts * opts.group) % opts.batch:
        parser.error(f"--stage-prompts x --group ({opts.stage_prompts * opts.group}) must be a multiple of --batch")
    mini_batches = opts.stage_prompts * opts.group // opts.batch
    setting_opts = {}
    for passes in opts.passes:
        mu = passes * mini_batches
        if opts.updates % mu:
            parser.error(f"--updates ({opts.updates}) must be a multiple of µ = {mu} (passes {passes}; whole stages).")
        setting_opts[passes] = argparse.Namespace(**{**vars(opts), "passes": passes, "mu": mu})
    torch.set_num_threads(opts.threads)

    kit = toy.prepare(task="chain", verbose=False)
    eval_dataset = kit.eval_dataset.select(range(min(opts.eval_size, len(kit.eval_dataset))))
    if not opts.no_warmup:  # the first training run in a process pays one-off start-up costs: keep them out
        warm = argparse.Namespace(**{**vars(opts), "updates": 2})
        with tempfile.TemporaryDirectory(prefix="mu-bench-warmup-") as tmp:
            build("on_policy_grpo", kit, warm, opts.seeds[0], tmp).train()
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python benchmarks/mu_grpo_speedup.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seeds=opts.seeds,
                eval_size=len(eval_dataset), max_completion_length=kit.max_completion_length,
                torch_threads=torch.get_num_threads(), load_start=round(os.getloadavg()[0], 2),
                warmstart_probe_accuracy=kit.warmstart.get("probe_accuracy"),
                options={k: v for k, v in vars(opts).items() if k not in ("out", "from_json")})
    jobs = [("on_policy_grpo", setting_opts[opts.passes[0]])]
    jobs += [(arm, setting_opts[p]) for p in opts.passes for arm in STAGE_ARMS if arm in arms]
    runs: list[dict] = []
    for k, seed in enumerate(opts.seeds):  # arms alternate seed by seed, order rotated so none is always first
        order = jobs[k % len(jobs):] + jobs[: k % len(jobs)]
        for arm, arm_opts in order:
            tag = arm if arm == "on_policy_grpo" else f"{arm} µ={arm_opts.mu}"
            t0 = time.time()
            run = run_arm(arm, kit, eval_dataset, arm_opts, seed)
            ph = run["phase_seconds"]
            print(f"[mu_grpo_speedup {time.strftime('%H:%M:%S')}] {tag} seed {seed}: accuracy "
                  f"{run['initial_accuracy']:.1%} -> {run['final_accuracy']:.1%}, wall {run['wall_seconds']:.1f} s, "
                  f"CPU {run['cpu_seconds']:.1f} s (generation {ph['generation']:.1f}, reward {ph['reward']:.1f}, "
                  f"logprobs {ph['logprobs']:.1f}, rollout other {ph['rollout_other']:.1f}, update+other "
                  f"{ph['update_other']:.1f}), {run['rollouts']} rollouts, {run['sequences_per_second']:.1f} seq/s, "
                  f"clipped {run['clip_region_fraction'] or 0:.4f}, vetoed {run['veto_fraction'] or 0:.4f} "
                  f"(took {time.time() - t0:.0f} s)", flush=True)
            runs.append(run)
            _render(out, opts.name, runs, opts, meta)
    plot(out / f"{opts.name}.png", runs, opts.passes)
    print((out / f"{opts.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
