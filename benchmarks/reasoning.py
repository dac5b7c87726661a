"""Every registered variant on the chain-of-thought toy task (``toy.prepare(task="chain")``), through the lab.

Two parts, both written to benchmarks/results/:

* ``--grpo-check``: one GRPO run (shared recipe) for a fixed number of optimizer steps, held-out greedy
  accuracy on 500 problems before and after, its standard error, wall and process-CPU seconds
  -> ``reasoning_grpo.json``.
* default: every registered variant, 3 seeds, the same generated-token budget per arm, each variant with
  its own paper settings where they are part of the algorithm (updates per rollout, clip widths: the
  table :data:`PAPER` sets them explicitly, whatever the config defaults are) and the shared batch shape
  otherwise; plus the ablations that show a mechanism at work (µ-GRPO with more staleness and a higher
  veto threshold) -> ``reasoning.json`` (one record per arm), ``reasoning.md``, ``reasoning.png``
  (the lab's dashboard), ``reasoning_mechanisms.png``, ``reasoning_lab.json`` (the tidy table).

    python benchmarks/reasoning.py --grpo-check --steps 40
    python benchmarks/reasoning.py --budget-tokens 40000 --seeds 0,1,2
    python benchmarks/reasoning.py --quick          # pipeline check: seed 0, tiny budget, 100 problems
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import _bench  # noqa: E402, F401  (the offline environment, before torch / transformers)

# The batch shape every arm shares (lab.TOY_CONFIG with the chain task's completion budget): 64 completions
# (8 prompts x 8) per optimizer update, lr 1e-4 constant (the papers' 1e-6 does not move a 1M-parameter
# policy), temperature 0.7: at 1.0 the warm-started policy's sampled traces are right 3-12% of the time
# (greedy: 24%), mostly the terse answers of 3-operand problems, and a first GRPO run at 1.0 lowered
# held-out greedy accuracy (24.2% -> 15.8% after 6 steps) by reinforcing them.
SHARED = dict(per_device_train_batch_size=64, num_generations=8, learning_rate=1e-4, lr_scheduler_type="constant",
              temperature=0.7)

# Paper settings that are part of each algorithm, set explicitly here (not read from config defaults, which
# may change). "updates per rollout" = optimizer updates on one rollout (steps_per_generation / stages).
PAPER: dict[str, dict] = {
    # DeepSeekMath: symmetric clip 0.2, one update per exploration stage, k3 KL beta 0.04
    "grpo": dict(epsilon=0.2, epsilon_high=None, steps_per_generation=1, beta=0.04),
    # DAPO: clip-higher 0.2 / 0.28, dynamic sampling, token-mean, overlong filtering, beta 0; the paper's 16
    # mini-batches per rollout scaled to 4 (16 x 64 completions would overshoot the budget by a whole rollout)
    "dapo": dict(epsilon=0.2, epsilon_high=0.28, steps_per_generation=4, beta=0.0, dynamic_sampling=True,
                 mask_truncated_completions=True),
    # Dr.GRPO: clip 0.2, group-mean advantage, constant normaliser, beta 0, one update per rollout
    "dr_grpo": dict(epsilon=0.2, epsilon_high=None, steps_per_generation=1, beta=0.0),
    # GSPO: sequence-level clip 3e-4 / 4e-4, 4 mini-batches per rollout
    "gspo": dict(epsilon=3e-4, epsilon_high=4e-4, mini_batches_per_rollout=4, beta=0.0),
    "gspo_token": dict(epsilon=3e-4, epsilon_high=4e-4, mini_batches_per_rollout=4, beta=0.0),
    # µ-GRPO: relaxed clip [0, 5], H_kappa veto at 1e-4; a stage of 4 mini-batches visited twice (8 updates per
    # refresh; the paper's µ = 1,024 does not fit a toy budget)
    "mu_grpo": dict(relaxed_clip=True, mu_clip_lower=0.0, mu_clip_upper=5.0, veto_scope="H_kappa",
                    stage_prompts=32, updates_per_stage=8),
    # iGRPO: N = 4 drafts + G = 4 refinements (the paper's 4 + 4), clip 0.2, beta 0, one update per rollout
    # (the toy template "{prompt}({draft}){prompt}": the vocabulary has no letters; the warm start saw it)
    "igrpo": dict(epsilon=0.2, epsilon_high=None, steps_per_generation=1, beta=0.0, num_drafts=4, num_generations=4,
                  draft_template="{prompt}({draft}){prompt}"),
    # FIPO: dual clip 0.2 / 0.28, c = 10, tau 32, weights in [1, 1.2]; 16 mini-batches per rollout scaled to 4
    "fipo": dict(epsilon=0.2, epsilon_high=0.28, clip_ratio_c=10.0, fipo_tau=32.0, mini_batches_per_rollout=4,
                 beta=0.0),
}

# Ablations where a mechanism should show: µ-GRPO with much staler rollouts (the same stage of 4 mini-batches
# visited eight times: 32 updates per refresh) and a veto threshold 100x higher (1e-2).
ABLATIONS: dict[str, tuple[str, dict]] = {
    "mu_grpo_stale": ("mu_grpo", dict(relaxed_clip=True, mu_clip_lower=0.0, mu_clip_upper=5.0, veto_scope="H_kappa",
                                      stage_prompts=32, updates_per_stage=32, veto_threshold=1e-2)),
}

RECORD_KEYS = [
    "seeds", "initial_accuracy", "final_accuracy", "final_accuracy_std", "final_accuracy_se", "best_accuracy",
    "wall_seconds", "generated_tokens", "completions", "steps", "useful_token_fraction", "useful_tokens_per_generated",
    "mean_length_right", "mean_length_wrong", "mean_length_right_start", "mean_length_wrong_start",
    "truncation_rate", "truncation_rate_start", "entropy", "final_entropy", "clip_low", "clip_high", "clip_dual",
    "clip_fraction", "ds_drop_rate", "veto_fraction", "fipo_weight_mean", "fipo_weight_max", "igrpo_draft_accuracy",
    "igrpo_best_draft_accuracy", "igrpo_refined_accuracy", "mean_reward", "budget_reached",
]


def _known_fields(variant: str, values: dict) -> dict:
    """Keep the fields the variant's config class has (a renamed field is reported, not silently dropped)."""
    import dataclasses

    from grpo_variants.registry import get_variant

    names = {f.name for f in dataclasses.fields(get_variant(variant).config_cls)}
    missing = sorted(set(values) - names)
    if missing:
        print(f"[reasoning] {variant}: config has no field(s) {missing}; left at the variant's defaults", flush=True)
    return {k: v for k, v in values.items() if k in names}


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def grpo_check(args) -> dict:
    """GRPO on the chain task for ``args.steps`` updates: held-out greedy accuracy before / after."""
    import torch
    from transformers import AutoTokenizer

    from grpo_variants import get_variant
    from grpo_variants.tasks import toy, toy_reasoning
    from grpo_variants.lab import TOY_CONFIG

    kit = toy.prepare(task="chain")
    spec = get_variant("grpo")
    values = {**TOY_CONFIG, **SHARED, **_known_fields("grpo", PAPER["grpo"]),
              "max_completion_length": kit.max_completion_length, "max_steps": args.steps, "seed": args.seed,
              **({"per_device_train_batch_size": args.batch} if args.batch else {}),
              "output_dir": tempfile.mkdtemp(prefix="reasoning-grpo-check-"), "save_strategy": "no"}
    config = spec.config_cls(**values)
    trainer = spec.trainer_cls(model=kit.model_path, reward_funcs=kit.reward, args=config,
                               train_dataset=kit.train_dataset)
    tokenizer = AutoTokenizer.from_pretrained(kit.model_path)
    before = toy_reasoning.evaluate_details(kit.model_path, kit.eval_dataset, tokenizer,
                                            max_new_tokens=kit.max_completion_length)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = toy_reasoning.evaluate_details(trainer.model, kit.eval_dataset, tokenizer,
                                           max_new_tokens=kit.max_completion_length)
    n = after["problems"]
    se = math.sqrt(binomial_se(before["accuracy"], n) ** 2 + binomial_se(after["accuracy"], n) ** 2)
    gain = after["accuracy"] - before["accuracy"]
    result = {
        "variant": "grpo", "steps": args.steps, "seed": args.seed, "threads": torch.get_num_threads(),
        "problems": n, "before": before, "after": after, "gain": gain, "gain_se": se,
        "gain_over_se": gain / se if se else None, "train_wall_seconds": round(wall, 1),
        "train_cpu_seconds": round(cpu, 1), "generated_tokens": int(trainer._tokens_generated_total),
        "config": {k: values[k] for k in ("per_device_train_batch_size", "num_generations", "learning_rate",
                                          "max_completion_length", "temperature", "beta", "epsilon")},
        "warm_start": {k: kit.warmstart.get(k) for k in ("steps", "probe_accuracy", "seconds")},
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": "the machine is shared by several jobs: train_cpu_seconds (this process) is the comparable figure; "
                "wall seconds include waiting for the CPU",
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("before", "after")}, indent=1))
    print(f"held-out {before['accuracy']:.1%} -> {after['accuracy']:.1%} (gain {gain:+.1%} ± {se:.1%}), "
          f"{cpu:.0f} CPU s, {wall:.0f} wall s")
    return result


def write_grpo_md(result: dict, out: Path) -> None:
    b, a = result["before"], result["after"]
    lines = [
        "# GRPO on the chain-of-thought toy task: held-out gain vs its standard error", "",
        f"{result['created']} · {result['steps']} optimizer steps of "
        f"{result['config']['per_device_train_batch_size']} "
        f"completions (G = {result['config']['num_generations']}), lr {result['config']['learning_rate']}, "
        f"temperature {result['config']['temperature']}, beta {result['config']['beta']}, seed {result['seed']} · "
        f"{result['problems']} held-out problems, greedy", "",
        "| | accuracy | mean length right / wrong | truncated | accuracy by level (3 / 5 / 7 operands) |",
        "|---|---|---|---|---|",
    ]
    for name, d in (("before", b), ("after", a)):
        levels = " / ".join(f"{100 * v:.1f}%" for _, v in sorted(d["accuracy_by_level"].items()))
        lines.append(f"| {name} | {100 * d['accuracy']:.1f}% | {d['mean_length_right'] or 0:.1f} / "
                     f"{d['mean_length_wrong'] or 0:.1f} | {100 * d['truncation_rate']:.1f}% | {levels} |")
    lines += ["", f"Gain {100 * result['gain']:+.1f} points, standard error {100 * result['gain_se']:.1f} "
              f"(binomial, both evaluations): **{result['gain_over_se']:.1f} standard errors**. Training took "
              f"**{result['train_cpu_seconds']:.0f} s of process CPU time** "
              f"({result['train_wall_seconds']:.0f} s wall on "
              f"a 2-core machine shared with other jobs; {result['threads']} thread(s)); "
              f"{result['generated_tokens']:,} tokens generated.", "",
              "Rerun: `python benchmarks/reasoning.py --grpo-check --steps 40`."]
    (out / "reasoning_grpo.md").write_text("\n".join(lines) + "\n")


def write_grpo_runs_md(runs: list[dict], out: Path) -> None:
    """One row per GRPO check run (seeds, batch sizes), with the gain in standard errors."""
    lines = ["# GRPO on the chain-of-thought toy task: held-out gain vs its standard error", "",
             f"{runs[0]['problems']} held-out problems, greedy; 40 optimizer steps each; lr "
             f"{runs[0]['config']['learning_rate']}, temperature {runs[0]['config']['temperature']}, beta "
             f"{runs[0]['config']['beta']}, G = {runs[0]['config']['num_generations']}. Standard error: binomial, both "
             "evaluations. CPU seconds: this process (1 thread); wall seconds on a 2-core machine shared with other "
             "jobs.", "",
             "| seed | completions / step | before | after | gain | gain / se | length right / wrong after | "
             "CPU s | wall s | tokens |", "|" + "---|" * 10]
    for r in runs:
        a = r["after"]
        lines.append(f"| {r['seed']} | {r['config']['per_device_train_batch_size']} | "
                     f"{100 * r['before']['accuracy']:.1f}% | {100 * a['accuracy']:.1f}% | "
                     f"{100 * r['gain']:+.1f} ± {100 * r['gain_se']:.1f} | {r['gain_over_se']:+.1f} | "
                     f"{a['mean_length_right'] or 0:.1f} / {a['mean_length_wrong'] or 0:.1f} | "
                     f"{r['train_cpu_seconds']:.0f} | {r['train_wall_seconds']:.0f} | {r['generated_tokens']:,} |")
    lines += ["", "Rerun: `python benchmarks/reasoning.py --grpo-check --steps 40 --seed S [--batch 128]`; "
              "`--grpo-collect dir1,dir2,...` joins runs into this table."]
    (out / "reasoning_grpo.md").write_text("\n".join(lines) + "\n")


def run_all(args) -> None:
    from grpo_variants import lab, list_variants

    variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants
                else [spec.name for spec in list_variants()])
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    budget = args.budget_tokens or (3_000 if args.quick else 40_000)
    eval_size = args.eval_size or (100 if args.quick else 500)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, results, overridden = [], [], {}
    started = time.perf_counter()
    arms = [(v, v, PAPER.get(v, {})) for v in variants]
    if not args.no_ablations:  # each ablation right after its base variant
        for name, (base, fields) in ABLATIONS.items():
            if base in variants:
                at = next(i for i, arm in enumerate(arms) if arm[0] == base) + 1
                arms.insert(at, (name, base, fields))
    for name, base, paper in arms:
        fields = _known_fields(base, paper)
        overridden[name] = {"variant": base, "paper_settings": fields, "shared": SHARED}
        result = lab.compare([base], task="chain", seeds=seeds, budget_tokens=budget, config=SHARED,
                             overrides={base: fields}, eval_every=args.eval_every, eval_size=eval_size,
                             presets=False, verbose=True)
        for row in result.rows:
            row["variant"] = name
        summary = dict(result.summary_rows[0], variant=name)
        result.summary_rows[0] = summary
        results.append(result)
        record = {"variant": name, "base_variant": base, **{k: summary.get(k) for k in RECORD_KEYS}}
        record["final_accuracy"] = {"mean": summary.get("final_accuracy"), "se": summary.get("final_accuracy_se"),
                                    "per_seed_std": summary.get("final_accuracy_std")}
        records.append(record)
        _write(out, records, results, overridden, seeds, budget, eval_size, args, time.perf_counter() - started)
        print(f"[reasoning] {name} done at {time.perf_counter() - started:.0f} s", flush=True)


def _write(out, records, results, overridden, seeds, budget, eval_size, args, seconds) -> None:
    from grpo_variants.lab import LabResult

    merged = LabResult(rows=[r for res in results for r in res.rows],
                       summary_rows=[res.summary_rows[0] for res in results],
                       meta={**results[0].meta, "variants": [r["variant"] for r in records], "seconds": seconds})
    settings = {"task": "chain", "seeds": seeds, "budget_tokens": budget, "eval_problems": eval_size,
                "shared": {**merged.meta.get("shared_config", {})}, "per_variant": overridden,
                "quick": args.quick, "seconds": round(seconds, 1), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "warm_start": results[0].meta.get("model"),
                "note": "7 jobs share this 2-core machine: wall_seconds are measured arm after arm and are noisy; "
                        "compare per generated token first"}
    (out / "reasoning.json").write_text(json.dumps({"settings": settings, "records": records}, indent=1, default=str))
    merged.to_json(out / "reasoning_lab.json")
    title = f"chain task, seeds {seeds}, {budget:,} generated tokens per arm" + (" (quick check)" if args.quick else "")
    merged.plot_dashboard(out / "reasoning.png", title=title)
    merged.plot_mechanisms(out / "reasoning_mechanisms.png", title="mechanism metrics, " + title)
    lines = ["# All variants on the chain-of-thought toy task", "", title + f" · {eval_size} held-out problems · "
             f"{seconds:.0f} s in total", "",
             "| arm | held-out accuracy start → end (± se) | generated tokens | useful-token fraction | "
             "length right / wrong | truncation start → mean | clip low / high | DS drop | veto | FIPO w | "
             "iGRPO draft → refined |", "|" + "---|" * 11]

    def f(v, pct=False):
        if v is None:
            return "–"
        if pct:
            return f"{100 * v:.1f}%"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"

    for r in records:
        acc = r["final_accuracy"]
        lines.append(
            f"| {r['variant']} | {f(r['initial_accuracy'], True)} → {f(acc['mean'], True)}"
            f"{' ± ' + f(acc['se'], True) if acc['se'] is not None else ''} | {f(r['generated_tokens'])} | "
            f"{f(r['useful_token_fraction'])} | {f(r['mean_length_right'])} / {f(r['mean_length_wrong'])} | "
            f"{f(r['truncation_rate_start'], True)} → {f(r['truncation_rate'], True)} | {f(r['clip_low'])} / "
            f"{f(r['clip_high'])} | {f(r['ds_drop_rate'], True)} | {f(r['veto_fraction'])} | "
            f"{f(r['fipo_weight_mean'])} | {f(r['igrpo_draft_accuracy'], True)} → "
            f"{f(r['igrpo_refined_accuracy'], True)} |")
    lines += ["", "Per-arm settings (paper settings set explicitly, shared batch shape): `reasoning.json` → "
              "`settings.per_variant`.", "", "![dashboard](reasoning.png)", "",
              "![mechanisms](reasoning_mechanisms.png)"]
    (out / "reasoning.md").write_text("\n".join(lines) + "\n")


def merge(parts: list[str], out: Path) -> None:
    """Join the outputs of several runs (e.g. two processes, each on some arms) into one set of files."""
    from grpo_variants.lab import LabResult

    records, results, per_variant, settings = [], [], {}, None
    for part in parts:
        blob = json.loads((Path(part) / "reasoning.json").read_text())
        settings = settings or blob["settings"]
        lab_result = LabResult.from_json(Path(part) / "reasoning_lab.json")
        for record, summary in zip(blob["records"], lab_result.summary_rows, strict=True):
            records.append(record)
            results.append(LabResult(rows=[r for r in lab_result.rows if r["variant"] == record["variant"]],
                                     summary_rows=[summary], meta=lab_result.meta))
        per_variant.update(blob["settings"]["per_variant"])
    args = argparse.Namespace(quick=settings["quick"])
    seconds = max(json.loads((Path(p) / "reasoning.json").read_text())["settings"]["seconds"] for p in parts)
    _write(out, records, results, per_variant, settings["seeds"], settings["budget_tokens"], settings["eval_problems"],
           args, seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo-check", action="store_true", help="one GRPO run: accuracy gain vs its standard error")
    parser.add_argument("--steps", type=int, default=40, help="--grpo-check: optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=None, help="--grpo-check: completions per update (default 64)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--variants", default=None)
    parser.add_argument("--seeds", default=None)
    parser.add_argument("--budget-tokens", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=0, help="0: evaluate at the start and the stop only")
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--grpo-md", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grpo-collect", default=None, help="join --grpo-check output folders into one table")
    parser.add_argument("--merge", default=None,
                        help="comma-separated output folders of partial runs to join into --out")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge.split(","), Path(args.out))
        return 0
    if args.grpo_collect:
        runs = [json.loads((Path(d) / "reasoning_grpo.json").read_text()) for d in args.grpo_collect.split(",")]
        runs = [r for blob in runs for r in (blob["runs"] if "runs" in blob else [blob])]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "reasoning_grpo.json").write_text(json.dumps({"runs": runs}, indent=1))
        write_grpo_runs_md(runs, Path(args.out))
        return 0
    if args.grpo_md:  # the table from an existing reasoning_grpo.json
        write_grpo_md(json.loads((Path(args.out) / "reasoning_grpo.json").read_text()), Path(args.out))
        return 0
    if args.grpo_check:
        result = grpo_check(args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "reasoning_grpo.json").write_text(json.dumps(result, indent=1))
        write_grpo_md(result, Path(args.out))
        return 0
    run_all(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
