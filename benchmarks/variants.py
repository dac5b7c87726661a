"""Every registered variant on the toy task, same seed(s) and generation budget, through the variant lab.

Held-out accuracy curve (per step, per generated token, per wall-second), wall time and
useful-token fraction for each variant, from one run of :func:`grpo_variants.lab.compare`.

    python benchmarks/variants.py            # full run: seeds 0,1,2, 100k generated tokens per arm, 500 problems
    python benchmarks/variants.py --quick    # end-to-end check: seed 0, 4k tokens per arm, 100 problems
    python benchmarks/variants.py --seeds 0 --budget-tokens 50000 --variants grpo,dapo

Writes to benchmarks/results/:
* variants.json: one record per variant (final_accuracy, wall_seconds, useful_token_fraction, ...)
  plus the run's settings;
* variants.md and variants.png: the compact table and the lab's dashboard plot;
* lab_comparison.md: the lab's full comparison table (every summary column) and settings;
* lab_variants.json: the lab's whole result (tidy per-step table included), readable with
  ``grpo_variants.lab.LabResult.from_json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import _bench  # noqa: E402, F401  (the offline environment, before torch / transformers)

RECORD_KEYS = [
    "final_accuracy", "final_accuracy_std", "initial_accuracy", "best_accuracy", "wall_seconds",
    "useful_token_fraction", "useful_tokens_per_generated", "steps", "generated_tokens", "completions",
    "clip_fraction", "veto_fraction", "final_entropy", "tokens_per_wall_s", "budget_reached",
]


def _fmt(v, pct=False):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 100):
        return f"{int(v):,}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def write_outputs(result, out: Path, quick: bool) -> None:
    from grpo_variants.lab import SUMMARY_MARKDOWN_COLUMNS

    out.mkdir(parents=True, exist_ok=True)
    meta = result.meta
    records = [{"variant": s["variant"], **{k: s.get(k) for k in RECORD_KEYS}} for s in result.summary_rows]
    settings = {k: meta.get(k) for k in ("task", "seeds", "budget_tokens", "budget_completions", "stop", "eval_every",
                                         "eval_problems", "shared_config", "overrides", "device", "versions",
                                         "created", "seconds")}
    settings["quick"] = quick
    (out / "variants.json").write_text(json.dumps({"settings": settings, "records": records}, indent=1))
    result.to_json(out / "lab_variants.json")
    result.plot_dashboard(out / "variants.png",
                          title=f"toy addition, seeds {meta['seeds']}, {meta['budget_tokens']:,} generated tokens "
                                "per variant" + (" (quick check)" if quick else ""))

    header = (f"{meta['created']} · {meta.get('device', '?')} · budget {meta['budget_tokens']:,} generated tokens per "
              f"arm · seeds {meta['seeds']} · {meta['eval_problems']} held-out problems · "
              f"{'**quick check, not a result**' if quick else 'full run'} · {meta['seconds']:.0f} s in total")
    lines = [
        "# All variants on the toy task (same seed, same generation budget)",
        "",
        header,
        "",
        "| variant | held-out accuracy start → end | best | wall seconds | useful-token fraction | steps |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        std = f" ± {100 * r['final_accuracy_std']:.1f}" if r.get("final_accuracy_std") else ""
        lines.append(
            f"| {r['variant']} | {_fmt(r['initial_accuracy'], True)} → {_fmt(r['final_accuracy'], True)}{std} | "
            f"{_fmt(r['best_accuracy'], True)} | {_fmt(r['wall_seconds'])} | {_fmt(r['useful_token_fraction'])} | "
            f"{_fmt(r['steps'])} |"
        )
    lines += ["", "![variants](variants.png)", "",
              "Rerun: `python benchmarks/variants.py` (see benchmarks/README.md)."]
    (out / "variants.md").write_text("\n".join(lines) + "\n")

    shared = meta["shared_config"]
    lab_lines = [
        "# Variant lab: comparison table on the toy task",
        "",
        header,
        "",
        "Produced by `grpo_variants.lab.compare` (benchmarks/variants.py). Every arm starts from the same "
        "warm-started toy policy, trains with the same seed(s) and the shared recipe below, and stops once its "
        "rollouts have generated the budget (everything generated counts: groups dynamic sampling discards, "
        "drafts, truncated completions). Means over seeds.",
        "",
        result.to_markdown(SUMMARY_MARKDOWN_COLUMNS + ["useful_tokens_per_generated", "budget_reached"]),
        "",
        "Columns: accuracies are held-out greedy accuracy (start, where the budget ran out, best evaluation); "
        "`wall_seconds` is training time without evaluation; `useful_token_fraction` is the mean over steps of "
        "the fraction of generated tokens whose policy gradient was non-zero after filtering, clipping, masking "
        "and the veto; `useful_tokens_per_generated` counts reuse (above 1 when a rollout trains several updates); "
        "`clip_fraction` is the share of tokens in the clipped region, `veto_fraction` the share vetoed "
        "(µ-GRPO); `tokens_per_wall_s` generated tokens per training second.",
        "",
        "Shared recipe: " + ", ".join(f"`{k}={shared[k]}`" for k in (
            "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature",
            "learning_rate", "lr_scheduler_type") if k in shared) + ".",
        "Per-variant settings (variant defaults, `lab.toy_preset`, overrides): see `lab_variants.json` → `meta.arms`.",
    ]
    (out / "lab_comparison.md").write_text("\n".join(lab_lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget: checks the pipeline end to end")
    parser.add_argument("--variants", default=None, help="comma-separated (default: every registered variant)")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick: 0)")
    parser.add_argument("--budget-tokens", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    import torch

    from grpo_variants import lab, list_variants

    if args.threads:
        torch.set_num_threads(args.threads)
    variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants
                else [spec.name for spec in list_variants()])
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    budget = args.budget_tokens or (4_000 if args.quick else 100_000)
    started = time.perf_counter()
    result = lab.compare(
        variants,
        task="addition",
        seeds=seeds,
        budget_tokens=budget,
        eval_every=args.eval_every or (5 if args.quick else 10),
        eval_size=args.eval_size or (100 if args.quick else 500),
    )
    write_outputs(result, Path(args.out), args.quick)
    print(result.to_markdown())
    print(f"wrote {Path(args.out)}/variants.json, variants.md, variants.png, lab_comparison.md, lab_variants.json "
          f"in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
