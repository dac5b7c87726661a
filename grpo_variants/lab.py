"""The variant lab: compute-matched, side-by-side comparisons of GRPO variants.

Users choose a variant by evidence. :func:`compare` trains several variants on one task from the
same starting model, with the same seeds, the same recipe and the same *generation budget*, and
returns a tidy table of what happened::

    from grpo_variants import lab
    result = lab.compare(["grpo", "dapo", "dr_grpo", "mu_grpo"], task="addition", seeds=[0],
                         budget_tokens=60_000, eval_every=10)
    result.summary                      # one row per variant
    result.table                        # one row per (variant, seed, optimizer step)
    result.plot("eval_accuracy", x="generated_tokens")
    result.plot_dashboard("lab.png")    # accuracy vs step / tokens / wall-seconds, useful tokens, clips, entropy
    result.to_json("lab.json")

What is matched between arms

* the starting model, the training data and its order (``seed``), the held-out evaluation set;
* the recipe: the ``config`` fields (batch shape, completions per prompt, completion length,
  temperature, learning rate and schedule; :data:`TOY_CONFIG` on toy tasks) override every
  variant's own defaults, so only the algorithm differs. ``overrides[variant]`` wins over both
  (µ-GRPO's stage size on the toy task comes from :func:`toy_preset`);
* the generation budget: every arm stops once it has generated ``budget_tokens`` tokens (or
  ``budget_completions`` completions), counting *everything* its rollouts produced: groups DAPO
  discards, iGRPO's drafts, truncated completions. By default an arm finishes training on the
  rollout it already paid for and stops before the next one (:class:`GenerationBudgetCallback`),
  so µ-GRPO gets all the updates of its last stage; the last rollout can overshoot the budget, and
  the table records exactly what was spent.

What the table holds (``None`` where a variant does not log a metric): ``step``,
``wall_seconds`` (training time, held-out evaluation excluded), ``generated_tokens`` and
``completions`` (cumulative), ``reward`` (mean training reward), ``eval_accuracy`` (held-out
greedy accuracy, every ``eval_every`` steps and at the stop; step 0 is the starting model),
``useful_token_fraction`` (tokens whose policy gradient was non-zero after filtering, clipping and
masking, over every token generated for the batch), ``clip_fraction`` (tokens in the clipped
region) with its ``clip_low`` / ``clip_high`` / ``clip_dual`` parts, ``veto_fraction``
(µ-GRPO), ``entropy``, ``kl``, ``tokens_per_s`` (generation throughput), ``step_time`` and the
per-phase times.

Wall-seconds are measured arm after arm in one process: on a busy machine they are noisier than
steps or tokens. Compare curves per generated token first.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpo_variants.callbacks import (
    GenerationBudgetCallback,
    MetricsJSONLCallback,
    MFUCallback,
    ToyEvalCallback,
    read_jsonl,
)
from grpo_variants.errors import ConfigError

__all__ = [
    "compare",
    "LabResult",
    "TOY_CONFIG",
    "toy_preset",
    "COLUMNS",
    "plot_curves",
    "GenerationBudgetCallback",
    "MFUCallback",
]

# The recipe every arm shares on the toy task (measured on the 1M-parameter toy policy): lr 1e-4 with a
# constant schedule learns; 1e-6 (the papers' value for 7B+ models) does not move a 1M-parameter policy.
TOY_CONFIG: dict = dict(
    per_device_train_batch_size=128,  # completions per optimizer step (16 prompts x 8)
    gradient_accumulation_steps=1,
    num_generations=8,
    max_completion_length=6,
    temperature=1.0,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    max_steps=10_000,  # a cap: the generation budget stops each arm long before
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
    dataloader_pin_memory=False,
)

# (table column, logged metric name)
_METRIC_COLUMNS = [
    ("reward", "reward"),
    ("eval_accuracy", "eval_toy_accuracy"),
    ("useful_token_fraction", "useful_token_fraction"),
    ("clip_fraction", "clip_ratio/region_mean"),
    ("clip_low", "clip_ratio/low_mean"),
    ("clip_high", "clip_ratio/high_mean"),
    ("clip_dual", "clip_ratio/dual_mean"),
    ("veto_fraction", "veto/fraction"),
    ("entropy", "entropy"),
    ("kl", "kl"),
    ("kept_fraction", "tokens/kept_fraction"),
    ("tokens_per_s", "throughput/generated_tokens_per_s"),
    ("step_time", "step_time"),
    ("time_generation_s", "time/generation_s"),
    ("time_reward_s", "time/reward_s"),
    ("time_update_s", "time/update_s"),
    ("mfu", "throughput/mfu"),
    ("useful_tokens_total", "tokens/useful_total"),
    ("loss", "loss"),
    # mechanism metrics (grpo_variants.mechanisms): length bias, truncation, dynamic sampling, FIPO, iGRPO
    ("mean_length", "completions/mean_length"),
    ("mean_length_right", "completions/mean_length_right"),
    ("mean_length_wrong", "completions/mean_length_wrong"),
    ("truncation_rate", "completions/clipped_ratio"),
    ("ds_pass_rate", "dynamic_sampling/pass_rate"),
    ("fipo_weight_mean", "fipo/weight_mean"),
    ("fipo_weight_max", "fipo/weight_max"),
    ("igrpo_draft_accuracy", "igrpo/draft_reward_mean"),
    ("igrpo_best_draft_accuracy", "igrpo/best_draft_reward_mean"),
    ("igrpo_refined_accuracy", "igrpo/refined_reward_mean"),
]
COLUMNS = ["variant", "seed", "step", "wall_seconds", "generated_tokens", "completions"] + [
    c for c, _ in _METRIC_COLUMNS
] + ["ds_drop_rate"]
# per-run mechanism summaries: mean over training steps of each column (and the first step's value)
MECHANISM_COLUMNS = [
    "mean_length", "mean_length_right", "mean_length_wrong", "truncation_rate", "entropy", "clip_low", "clip_high",
    "clip_dual", "ds_drop_rate", "veto_fraction", "fipo_weight_mean", "fipo_weight_max", "igrpo_draft_accuracy",
    "igrpo_best_draft_accuracy", "igrpo_refined_accuracy",
]

_X_LABELS = {
    "step": "optimizer step",
    "generated_tokens": "generated tokens (cumulative)",
    "wall_seconds": "wall-clock seconds (training, eval excluded)",
    "completions": "generated completions (cumulative)",
}
_Y_LABELS = {
    "eval_accuracy": "held-out greedy accuracy",
    "reward": "mean training reward",
    "useful_token_fraction": "useful-token fraction",
    "clip_fraction": "clipped-token fraction",
    "veto_fraction": "vetoed-token fraction",
    "entropy": "entropy (nats/token)",
    "tokens_per_s": "generated tokens / s",
    "mean_length_right": "mean length of right completions",
    "mean_length_wrong": "mean length of wrong completions",
    "truncation_rate": "truncated completions (no EOS)",
    "clip_high": "upper-clipped token fraction",
    "clip_low": "lower-clipped token fraction",
    "ds_drop_rate": "dynamic sampling: dropped groups",
    "fipo_weight_mean": "FIPO future-KL weight (mean)",
}


def toy_preset(variant: str, config: dict) -> dict:
    """Per-variant settings a variant needs to run meaningfully at toy scale, given the shared recipe ``config``.

    * µ-GRPO: a stage of 4 optimizer mini-batches (stage_prompts = 4 x completions per update / G), each
      visited twice (µ = 8 updates per rollout refresh; the paper uses µ = 1,024 at 7B scale). On the toy
      model an update costs more than generating its batch, so a larger µ mostly buys wall time here.
    * DAPO, FIPO: 4 mini-batches per rollout instead of the recipe's 16 (more than one makes the clip act
      at all; 16 x 128 completions would overshoot small budgets by a whole rollout).
    * iGRPO: N + G = the shared group size (N = G = num_generations / 2, the paper's 4 + 4 for G = 8) and
      the toy kit's draft template (the toy vocabulary has no letters).
    """
    per_update = config.get("per_device_train_batch_size", 8) * config.get("gradient_accumulation_steps", 1)
    generations = config.get("num_generations", 8)
    if variant == "mu_grpo":
        stage_prompts = max(1, 4 * per_update // generations)
        mini_batches = stage_prompts * generations // per_update
        return {"stage_prompts": stage_prompts, "updates_per_stage": 2 * mini_batches}
    if variant in ("dapo", "fipo"):
        return {"mini_batches_per_rollout": 4}
    if variant == "igrpo" and generations >= 4 and generations % 2 == 0:
        from grpo_variants.variants.igrpo import TOY_DRAFT_TEMPLATE

        return {"num_drafts": generations // 2, "num_generations": generations // 2,
                "draft_template": TOY_DRAFT_TEMPLATE}
    return {}


# ------------------------------------------------------------------------------------------------
# The result
# ------------------------------------------------------------------------------------------------
def _pandas():
    try:
        import pandas

        return pandas
    except ImportError:  # pragma: no cover - pandas is in the [plots] extra
        return None


def _num(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _mean(values):
    values = [v for v in values if _num(v) is not None]
    return sum(values) / len(values) if values else None


def _std(values):
    values = [v for v in values if _num(v) is not None]
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


@dataclass
class LabResult:
    """Rows (one per variant, seed and step), a summary per variant, and how they were produced."""

    rows: list[dict]
    summary_rows: list[dict]
    meta: dict = field(default_factory=dict)

    # ---- views --------------------------------------------------------------------------------
    @property
    def table(self):
        """The tidy table: a pandas DataFrame when pandas is installed, else the list of dicts."""
        pd = _pandas()
        return pd.DataFrame(self.rows, columns=COLUMNS) if pd is not None else self.rows

    @property
    def summary(self):
        """One row per variant (means over seeds): a DataFrame when pandas is installed, else dicts."""
        pd = _pandas()
        return pd.DataFrame(self.summary_rows) if pd is not None else self.summary_rows

    @property
    def variants(self) -> list[str]:
        return [s["variant"] for s in self.summary_rows]

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = {"meta": self.meta, "summary": self.summary_rows, "rows": self.rows}
        path.write_text(json.dumps(blob, indent=1, default=str))
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "LabResult":
        blob = json.loads(Path(path).read_text())
        return cls(rows=blob["rows"], summary_rows=blob["summary"], meta=blob.get("meta", {}))

    def to_markdown(self, columns: Sequence[str] | None = None) -> str:
        """The summary as a GitHub markdown table."""
        columns = list(columns or SUMMARY_MARKDOWN_COLUMNS)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in self.summary_rows:
            lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
        return "\n".join(lines)

    # ---- plots --------------------------------------------------------------------------------
    def plot(self, y: str = "eval_accuracy", x: str = "step", ax=None, path: str | os.PathLike | None = None,
             title: str | None = None):
        """One metric against ``x`` (step | generated_tokens | wall_seconds | completions), a line per variant."""
        plt = _pyplot()
        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
        plot_curves(self.rows, y=y, x=x, ax=ax)
        if title:
            ax.set_title(title)
        if path is not None:
            (fig or ax.figure).tight_layout()
            (fig or ax.figure).savefig(path, dpi=110)
        return ax

    def plot_mechanisms(self, path: str | os.PathLike | None = None, title: str | None = None):
        """Eight panels of mechanism metrics vs step: length of right and of wrong completions, truncation
        rate, upper / lower clip fractions, dynamic-sampling drop rate, veto fraction, FIPO weight mean and
        iGRPO draft vs refined accuracy (a panel says so when no variant logged its metric)."""
        plt = _pyplot()
        fig, axes = plt.subplots(2, 4, figsize=(19, 8))
        panels = [("mean_length_right", None), ("mean_length_wrong", None), ("truncation_rate", None),
                  ("clip_high", None), ("clip_low", None), ("ds_drop_rate", None), ("veto_fraction", None),
                  ("fipo_weight_mean", None)]
        for ax, (y, _) in zip(axes.flat, panels, strict=True):
            plot_curves(self.rows, y=y, x="step", ax=ax, legend=(ax is axes.flat[0]))
        fig.suptitle(title or "mechanism metrics per optimizer step")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def plot_igrpo(self, ax=None, path: str | os.PathLike | None = None):
        """iGRPO: mean draft accuracy, best-draft accuracy and refined accuracy per step (training rollouts)."""
        plt = _pyplot()
        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
        rows = [r for r in self.rows if r.get("igrpo_refined_accuracy") is not None]
        for i, (col, label) in enumerate((("igrpo_draft_accuracy", "drafts (mean)"),
                                          ("igrpo_best_draft_accuracy", "best draft"),
                                          ("igrpo_refined_accuracy", "refined"))):
            renamed = [{**r, "variant": label} for r in rows]
            plot_curves(renamed, y=col, x="step", ax=ax, legend=False)
        ax.set_ylabel("training reward (accuracy)")
        ax.set_title("iGRPO: drafts vs refinements", fontsize=10)
        if rows:
            ax.legend(fontsize=8)
        if path is not None:
            (fig or ax.figure).tight_layout()
            (fig or ax.figure).savefig(path, dpi=110)
        return ax

    def plot_dashboard(self, path: str | os.PathLike | None = None, title: str | None = None):
        """Eight panels: accuracy vs step / generated tokens / wall-seconds, reward vs tokens,
        useful-token fraction, clipped fraction, vetoed fraction and entropy vs step."""
        plt = _pyplot()
        panels = [
            ("eval_accuracy", "step"),
            ("eval_accuracy", "generated_tokens"),
            ("eval_accuracy", "wall_seconds"),
            ("reward", "generated_tokens"),
            ("useful_token_fraction", "step"),
            ("clip_fraction", "step"),
            ("veto_fraction", "step"),
            ("entropy", "step"),
        ]
        fig, axes = plt.subplots(2, 4, figsize=(19, 8))
        for ax, (y, x) in zip(axes.flat, panels, strict=True):
            plot_curves(self.rows, y=y, x=x, ax=ax, legend=(ax is axes.flat[0]))
        budget = self.meta.get("budget_tokens") or self.meta.get("budget_completions")
        unit = "tokens" if self.meta.get("budget_tokens") else "completions"
        fig.suptitle(title or f"{self.meta.get('task', '')}: same seeds {self.meta.get('seeds')}, "
                     f"budget {budget:,} generated {unit}" if budget else (title or ""))
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


SUMMARY_MARKDOWN_COLUMNS = [
    "variant",
    "initial_accuracy",
    "final_accuracy",
    "best_accuracy",
    "steps",
    "generated_tokens",
    "wall_seconds",
    "useful_token_fraction",
    "clip_fraction",
    "veto_fraction",
    "final_entropy",
    "tokens_per_wall_s",
]


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "–"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def _pyplot():
    import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg; in Jupyter: the inline backend

    return plt


def plot_curves(rows, y: str = "eval_accuracy", x: str = "step", ax=None, legend: bool = True):
    """Plot ``y`` against ``x`` for every variant in ``rows`` (list of dicts or a DataFrame).

    With several seeds the line is the mean over seeds at each step (x averaged as well) and each
    seed is drawn faintly behind it.
    """
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    if ax is None:
        ax = _pyplot().subplots(figsize=(6.4, 4.0))[1]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    any_data = False
    for i, variant in enumerate(variants):
        color = f"C{i % 10}"
        mine = [r for r in rows if r["variant"] == variant and _num(r.get(y)) is not None and _num(r.get(x)) is not None]
        if not mine:
            continue
        any_data = True
        seeds = sorted({r["seed"] for r in mine})
        if len(seeds) > 1:
            for seed in seeds:
                pts = [(r[x], r[y]) for r in sorted(mine, key=lambda r: r["step"]) if r["seed"] == seed]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.25, lw=1)
        by_step: dict[int, list[dict]] = {}
        for r in mine:
            by_step.setdefault(r["step"], []).append(r)
        # in step order: x may stay flat (tokens during a µ-GRPO stage) but never goes back
        pts = [(_mean([r[x] for r in rs]), _mean([r[y] for r in rs])) for _, rs in sorted(by_step.items())]
        marker = "o" if y in ("eval_accuracy", "ds_drop_rate", "igrpo_refined_accuracy") else None
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, ms=3, lw=1.6,
                label=variant + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else ""))
    ax.set_xlabel(_X_LABELS.get(x, x))
    ax.set_ylabel(_Y_LABELS.get(y, y))
    ax.set_title(f"{_Y_LABELS.get(y, y)} vs {x.replace('_', ' ')}", fontsize=10)
    ax.grid(alpha=0.3)
    if not any_data:
        ax.text(0.5, 0.5, "not logged by these variants", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    elif legend:
        ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------------------------------------
# Running the arms
# ------------------------------------------------------------------------------------------------
def _records_to_rows(records: list[dict], variant: str, seed: int) -> list[dict]:
    rows = []
    eval_seconds = 0.0
    for rec in records:
        if "train_runtime" in rec or "budget/generated_tokens" not in rec:
            continue  # the end-of-training summary record, or a record from outside training
        eval_seconds += rec.get("eval_toy_seconds") or 0.0
        row = {
            "variant": variant,
            "seed": seed,
            "step": int(rec["step"]),
            "wall_seconds": round(max(float(rec.get("wall_seconds", 0.0)) - eval_seconds, 0.0), 3),
            "generated_tokens": int(rec["budget/generated_tokens"]),
            "completions": int(rec.get("budget/completions") or 0),
        }
        for column, name in _METRIC_COLUMNS:
            row[column] = _num(rec.get(name))
        row["ds_drop_rate"] = 1.0 - row["ds_pass_rate"] if row["ds_pass_rate"] is not None else None
        rows.append(row)
    return rows


def _summarise(variant: str, rows: list[dict], initial: dict[int, float | None], budget_reached: dict) -> dict:
    seeds = sorted({r["seed"] for r in rows}) or sorted(initial)

    def per_seed(fn):
        return [fn([r for r in rows if r["seed"] == s], s) for s in seeds]

    def last(rs, key):
        vals = [r[key] for r in rs if _num(r.get(key)) is not None]
        return vals[-1] if vals else None

    def evals(rs):
        return [r["eval_accuracy"] for r in rs if _num(r.get("eval_accuracy")) is not None]

    final_acc = per_seed(lambda rs, s: last(rs, "eval_accuracy"))
    best_acc = per_seed(lambda rs, s: max(evals(rs), default=None))
    generated = per_seed(lambda rs, s: last(rs, "generated_tokens"))
    wall = per_seed(lambda rs, s: last(rs, "wall_seconds"))
    useful_total = per_seed(lambda rs, s: last(rs, "useful_tokens_total"))
    train_rows = [r for r in rows if r["step"] > 0]
    summary = {
        "variant": variant,
        "seeds": len(seeds),
        "initial_accuracy": _mean([initial.get(s) for s in seeds]),
        "final_accuracy": _mean(final_acc),
        "final_accuracy_std": _std(final_acc),
        "best_accuracy": _mean(best_acc),
        "steps": _mean(per_seed(lambda rs, s: max((r["step"] for r in rs), default=0))),
        "generated_tokens": _mean(generated),
        "completions": _mean(per_seed(lambda rs, s: last(rs, "completions"))),
        "wall_seconds": _mean(wall),
        "useful_token_fraction": _mean([r["useful_token_fraction"] for r in train_rows]),
        "useful_tokens_per_generated": _mean(
            [u / g for u, g in zip(useful_total, generated, strict=True) if _num(u) is not None and g]
        ),
        "clip_fraction": _mean([r["clip_fraction"] for r in train_rows]),
        "veto_fraction": _mean([r["veto_fraction"] for r in train_rows]),
        "final_entropy": _mean(per_seed(lambda rs, s: last(rs, "entropy"))),
        "mean_reward": _mean([r["reward"] for r in train_rows]),
        "tokens_per_wall_s": _mean([g / w for g, w in zip(generated, wall, strict=True) if g and w]),
        "mfu": _mean([r["mfu"] for r in train_rows]),
        "budget_reached": all(budget_reached.get(s, False) for s in seeds),
    }
    for column in MECHANISM_COLUMNS:  # mean over training steps and seeds; "_start": the first step of each seed
        summary[column] = _mean([r[column] for r in train_rows])
        summary[f"{column}_start"] = _mean(per_seed(lambda rs, s, c=column: next(
            (r[c] for r in sorted(rs, key=lambda r: r["step"]) if r["step"] > 0 and _num(r.get(c)) is not None),
            None)))
    summary["final_accuracy_se"] = (summary["final_accuracy_std"] / math.sqrt(len(seeds))
                                    if summary["final_accuracy_std"] is not None else None)
    for key in ("steps", "generated_tokens", "completions"):
        if summary[key] is not None:
            summary[key] = int(round(summary[key]))
    return summary


def _build_config(spec, common: dict, override: dict, output_dir: str, seed: int):
    values = dict(common)
    values.update(override)
    values["output_dir"] = output_dir
    values["seed"] = seed
    try:
        return spec.config_cls(**values)
    except TypeError as err:
        raise ConfigError(f"variant {spec.name!r}: {err}. Check the keys of config= / overrides[{spec.name!r}].") from err


def compare(
    variants: Sequence[str] = ("grpo", "dapo", "dr_grpo", "mu_grpo"),
    task: str = "addition",
    seeds: Sequence[int] = (0,),
    *,
    budget_tokens: int | None = None,
    budget_completions: int | None = None,
    overrides: dict[str, dict] | None = None,
    config: dict | None = None,
    eval_every: int = 10,
    eval_size: int | None = None,
    stop: str = "rollout",
    output_dir: str | os.PathLike | None = None,
    model: str | os.PathLike | None = None,
    train_dataset=None,
    eval_dataset=None,
    reward_funcs=None,
    eval_fn: Callable | None = None,
    presets: bool = True,
    verbose: bool = True,
) -> LabResult:
    """Train every variant in ``variants`` on ``task`` with the same seeds and generation budget.

    Args:
        variants: registered variant names (``grpo_variants.list_variants()``).
        task: a toy task (``"addition"``, ``"subtraction"``, ``"mixed"``) built with
            :func:`grpo_variants.tasks.toy.prepare`, or any label when ``model`` / datasets / rewards are given.
        seeds: training seeds; every variant runs once per seed (same data order per seed).
        budget_tokens / budget_completions: the generation budget of each arm (at least one).
        overrides: ``{variant: {config field: value}}``, applied last for that variant.
        config: config fields shared by every arm, on top of :data:`TOY_CONFIG` (toy tasks) and
            overriding the variants' own defaults; include ``max_steps`` as a cap if you like.
        eval_every: held-out evaluation every this many optimizer steps (plus at the start and stop).
        eval_size: evaluate on the first ``eval_size`` held-out problems (default: all, 500 on toy tasks).
        stop: "rollout" (finish the paid-for rollout, default) or "step" (stop as soon as spent).
        output_dir: where each arm writes ``<variant>/seed<k>/metrics.jsonl`` (default: a temporary folder,
            removed once the result is built).
        model, train_dataset, eval_dataset, reward_funcs: a non-toy task. ``eval_fn(model, tokenizer)
            -> float`` then gives held-out accuracy (without it the table has no eval_accuracy).
        presets: apply :func:`toy_preset` (µ-GRPO's stage size) on toy tasks.
    """
    from grpo_variants.tasks import toy
    from grpo_variants.registry import get_variant

    if budget_tokens is None and budget_completions is None:
        raise ConfigError(
            "compare() needs a generation budget: budget_tokens=... or budget_completions=... (the same for every "
            "variant, so that the comparison is compute-matched)."
        )
    if not variants:
        raise ConfigError("compare() needs at least one variant name.")
    if not seeds:
        raise ConfigError("compare() needs at least one seed.")
    specs = [get_variant(v) for v in variants]  # fail early on an unknown name
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"variants lists a variant twice: {list(variants)}.")
    overrides = {get_variant(k).name: dict(v) for k, v in (overrides or {}).items()}
    unknown = set(overrides) - set(names)
    if unknown:
        raise ConfigError(f"overrides names variants that are not compared: {sorted(unknown)}.")

    from grpo_variants.tasks import toy_reasoning

    is_toy = model is None
    reasoning = is_toy and task in toy_reasoning.TASKS
    if reasoning:  # the chain-of-thought toy task: its own reward, completion budget and evaluator
        kit = toy_reasoning.prepare(task, verbose=verbose)
        model = kit.model_path
        train_dataset = train_dataset if train_dataset is not None else kit.train_dataset
        eval_dataset = eval_dataset if eval_dataset is not None else kit.eval_dataset
        reward_funcs = reward_funcs or kit.reward
        common = dict(TOY_CONFIG, max_completion_length=kit.max_completion_length)
        if eval_fn is None:
            def eval_fn(m, tok):
                return toy_reasoning.evaluate(m, eval_dataset, tok, max_new_tokens=common["max_completion_length"])
    elif is_toy:
        if task not in toy.TASKS:
            raise ConfigError(f"task={task!r} is not a toy task ({toy.TASKS}); pass model=, train_dataset=, ... for "
                              "another task.")
        kit = toy.prepare(task=task, verbose=False)
        model = kit.model_path
        train_dataset = train_dataset if train_dataset is not None else kit.train_dataset
        eval_dataset = eval_dataset if eval_dataset is not None else kit.eval_dataset
        reward_funcs = reward_funcs or "toy_accuracy"
        common = dict(TOY_CONFIG)
    else:
        if train_dataset is None or reward_funcs is None:
            raise ConfigError("a non-toy task needs model=, train_dataset= and reward_funcs=.")
        from grpo_variants.tasks.models import resolve_model

        model = resolve_model(model)  # e.g. "smollm2" -> the prepared SmolLM2-135M-Instruct folder
        common = {"logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True}
    common.update(config or {})
    common["logging_steps"] = 1  # one row per optimizer step
    if eval_dataset is not None and eval_size is not None:
        eval_dataset = eval_dataset.select(range(min(eval_size, len(eval_dataset))))

    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    tokenizer = AutoTokenizer.from_pretrained(model) if isinstance(model, (str, os.PathLike)) else None
    root = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="grpo-lab-"))

    def evaluate_model(m) -> float | None:
        if eval_fn is not None:
            return float(eval_fn(m, tokenizer))
        if is_toy:
            return toy.evaluate(m, eval_dataset, tokenizer)
        return None

    # The starting model is the same for every arm: evaluate it once.
    initial_accuracy = evaluate_model(model) if (is_toy or eval_fn is not None) else None
    started = time.perf_counter()
    rows: list[dict] = []
    summaries: list[dict] = []
    arm_meta = {}
    try:
        for spec in specs:
            variant_rows = []
            initial = {}
            reached = {}
            for seed in seeds:
                arm_dir = root / spec.name / f"seed{seed}"
                arm_dir.mkdir(parents=True, exist_ok=True)
                metrics_path = arm_dir / "metrics.jsonl"
                if metrics_path.exists():
                    metrics_path.unlink()
                override = dict(toy_preset(spec.name, common)) if (is_toy and presets) else {}
                override.update(overrides.get(spec.name, {}))
                args = _build_config(spec, common, override, str(arm_dir / "checkpoints"), seed)
                trainer = spec.trainer_cls(model=model, reward_funcs=reward_funcs, args=args,
                                           train_dataset=train_dataset)
                budget = GenerationBudgetCallback(trainer, budget_tokens=budget_tokens,
                                                  budget_completions=budget_completions, stop=stop)
                # Order matters: the budget decides to stop before the evaluator looks at should_training_stop,
                # and both add their values to the log before the JSONL writer sees it.
                trainer.remove_callback(PrinterCallback)  # the lab prints one line per arm instead of every log
                trainer.add_callback(budget)
                if is_toy or eval_fn is not None:
                    trainer.add_callback(_EvalCallback(evaluate_model, eval_every))
                trainer.add_callback(MetricsJSONLCallback(metrics_path))
                arm_start = time.perf_counter()
                trainer.train()
                arm_seconds = time.perf_counter() - arm_start
                seed_rows = _records_to_rows(read_jsonl(metrics_path), spec.name, seed)
                initial[seed] = initial_accuracy
                reached[seed] = budget.exhausted()
                start_row = {c: None for c in COLUMNS}
                start_row.update(variant=spec.name, seed=seed, step=0, wall_seconds=0.0, generated_tokens=0,
                                 completions=0, eval_accuracy=initial_accuracy)
                variant_rows.extend([start_row] + seed_rows)
                arm_meta[f"{spec.name}/seed{seed}"] = {
                    "seconds_total": round(arm_seconds, 2),
                    "stopped_at_step": budget.stopped_at_step,
                    "config": {k: _jsonable(getattr(args, k, None)) for k in _CONFIG_KEYS if hasattr(args, k)},
                }
                if verbose:
                    last = seed_rows[-1] if seed_rows else {}
                    accs = [r["eval_accuracy"] for r in seed_rows if r.get("eval_accuracy") is not None]
                    print(
                        f"[lab] {spec.name:>10} seed {seed}: {last.get('step', 0)} steps, "
                        f"{last.get('generated_tokens', 0):,} tokens, {last.get('wall_seconds', 0.0):.0f} s train"
                        + (f", held-out accuracy {initial_accuracy:.1%} -> {accs[-1]:.1%}" if accs and initial_accuracy
                           is not None else "")
                        + ("" if reached[seed] else "  (stopped by max_steps before the budget was spent)"),
                        flush=True,
                    )
                del trainer, budget
                gc.collect()
            rows.extend(variant_rows)
            summaries.append(_summarise(spec.name, variant_rows, initial, reached))
    finally:
        if output_dir is None:  # everything is in the result; files are kept only in a folder you named
            shutil.rmtree(root, ignore_errors=True)

    meta = {
        "task": task,
        "variants": names,
        "seeds": list(seeds),
        "budget_tokens": budget_tokens,
        "budget_completions": budget_completions,
        "stop": stop,
        "eval_every": eval_every,
        "eval_problems": len(eval_dataset) if eval_dataset is not None else None,
        "model": _portable_model_name(model),
        "shared_config": {k: _jsonable(v) for k, v in common.items()},
        "overrides": {k: {kk: _jsonable(vv) for kk, vv in v.items()} for k, v in overrides.items()},
        "arms": arm_meta,
        "seconds": round(time.perf_counter() - started, 1),
        "host": platform.node(),
        "platform": platform.platform(),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import torch
        import trl

        meta["versions"] = {"torch": torch.__version__, "trl": trl.__version__}
        meta["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover
        pass
    return LabResult(rows=rows, summary_rows=summaries, meta=meta)


_CONFIG_KEYS = (
    "loss_type", "aggregation", "scale_rewards", "advantage_estimator", "importance_sampling_level", "ratio_level",
    "epsilon", "epsilon_high", "clip_ratio_c", "beta", "kl_estimator", "learning_rate", "lr_scheduler_type",
    "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature", "steps_per_generation",
    "num_iterations", "generation_batch_size", "mask_truncated_completions", "veto_scope", "fipo", "weight_decay",
)


def _portable_model_name(model) -> str:
    """The model as recorded in a result: a toy-cache folder relative to the cache, so committed results
    name no path of the machine that produced them; anything else (a hub id, a user's folder) as given."""
    from grpo_variants.tasks.toy import cache_dir

    text = str(model)
    try:
        relative = Path(text).resolve().relative_to(cache_dir().resolve())
    except (ValueError, OSError):
        return text
    return f"$GRPO_VARIANTS_CACHE/{relative.as_posix()}"


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


class _EvalCallback(ToyEvalCallback):
    """:class:`ToyEvalCallback` with a pluggable evaluator, evaluating also at the step where training stops."""

    def __init__(self, evaluate_model: Callable, every: int):
        super().__init__(eval_dataset=None, tokenizer=None, every=every, eval_at_end=True)
        self._evaluate_model = evaluate_model

    def _evaluate(self, model) -> float:
        return self._evaluate_model(model)
