"""Write the tutorial notebooks (without outputs) from the cell sources below.

    python notebooks/_build.py          # regenerate notebooks/*.ipynb

Edit the cells here rather than in Jupyter, so that the committed notebooks stay output-free and
reviewable; tests/test_notebooks.py executes them and checks that their plots render.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os
import time

import torch

# the toy model runs on CPU; OMP_NUM_THREADS, when set (the test suite sets 1), wins
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, min(4, os.cpu_count() or 1)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib.pyplot as plt

%matplotlib inline"""

def parameters_cell(source: str):
    """A code cell tagged ``parameters`` (papermill's convention): the run's size, which a test may override by
    executing a cell of its own right after it."""
    cell = new_code_cell(source)
    cell.metadata["tags"] = ["parameters"]
    return cell


PARAMETERS_01 = parameters_cell("""\
MAX_STEPS = 40  # optimizer steps of 128 completions
EVAL_EVERY = 10  # held-out evaluation every EVAL_EVERY steps
EVAL_SIZE = 200  # held-out problems per evaluation""")

PARAMETERS_02 = parameters_cell("""\
BUDGET_TOKENS = 16_000  # generated tokens per arm (about 35 GRPO steps of 128 completions)
EVAL_EVERY = 5  # held-out evaluation every EVAL_EVERY steps
EVAL_SIZE = 200  # held-out problems per evaluation""")

QUICKSTART = [
    new_markdown_cell("""\
# Quickstart: train a toy policy with GRPO, watch it learn, evaluate it

Everything here runs offline on a CPU in a couple of minutes. The **toy kit** (`grpo_variants.tasks.toy`)
builds a tiny Qwen2 model (about 1M parameters, a character vocabulary), warm-starts it with a few
hundred supervised steps on two-digit addition (`"37+45="` -> `"82"`) until it is right about a
third of the time, and saves it to disk. From there we train it with GRPO on a verifiable reward
(+1 when the answer is right) and measure held-out accuracy on problems it never saw.

The trainer is `trl.GRPOTrainer` underneath: same constructor, same config fields, same logs."""),
    new_code_cell(SETUP),
    new_code_cell("""\
from grpo_variants import get_variant, list_variants, toy
from grpo_variants.callbacks import MetricsJSONLCallback, ToyEvalCallback, read_jsonl

kit = toy.prepare(task="addition")  # first call builds and caches the warm-started model (~1 min); then instant
tokenizer = kit.tokenizer
print("model folder:", kit.model_path)
print("train / held-out problems:", len(kit.train_dataset), "/", len(kit.eval_dataset))
kit.train_dataset.select(range(3)).to_pandas()"""),
    new_markdown_cell("""\
The held-out set is never trained on. We evaluate greedy accuracy on 200 of its problems (about
±3.5 points of standard error: enough to see learning, not to rank close variants).

The next cell holds the run's size (tagged `parameters`, papermill's convention): the test suite executes
this notebook with a few steps to check that it runs; the numbers discussed here come from these values."""),
    PARAMETERS_01,
    new_code_cell("""\
eval_set = kit.eval_dataset.select(range(EVAL_SIZE))
before = toy.evaluate(kit.model_path, eval_set)
print(f"held-out greedy accuracy before RL: {before:.1%}")"""),
    new_markdown_cell("""\
## Pick a variant

Every variant is a registered trainer + config pair. `get_variant(name)` returns both; the
config class carries the paper's defaults, and any `trl.GRPOConfig` field can be set on it."""),
    new_code_cell("""\
for spec in list_variants():
    print(f"{spec.name:11s} {spec.paper:18s} {spec.description}")"""),
    new_code_cell("""\
import tempfile
from pathlib import Path

from transformers.trainer_callback import PrinterCallback

out = Path(tempfile.mkdtemp(prefix="grpo-quickstart-"))
spec = get_variant("grpo")
config = spec.config_cls(
    output_dir=str(out / "checkpoints"),
    max_steps=MAX_STEPS,
    per_device_train_batch_size=128,  # completions per step: 16 prompts x 8 completions
    num_generations=8,
    max_completion_length=6,
    temperature=1.0,
    learning_rate=1e-4,  # the paper's 1e-6 is for 7B models; a 1M-parameter toy needs more
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)
print(f"{spec.name}: beta={config.beta}, epsilon={config.epsilon}, loss_type={config.loss_type}, "
      f"scale_rewards={config.scale_rewards}")

evaluator = ToyEvalCallback(eval_set, tokenizer, every=EVAL_EVERY)
trainer = spec.trainer_cls(
    model=kit.model_path,
    reward_funcs="toy_accuracy",  # a registered reward; any TRL-style callable works too
    args=config,
    train_dataset=kit.train_dataset,
    callbacks=[evaluator, MetricsJSONLCallback(out / "metrics.jsonl")],
)
trainer.remove_callback(PrinterCallback)  # keep the notebook quiet; metrics go to metrics.jsonl"""),
    new_code_cell("""\
start = time.perf_counter()
trainer.train()
print(f"trained {trainer.state.global_step} steps in {time.perf_counter() - start:.0f} s")
print("held-out accuracy during training:", [(step, f"{acc:.1%}") for step, acc in evaluator.history])"""),
    new_markdown_cell("""\
## Watch the curves

`metrics.jsonl` holds one record per step with TRL's metrics (`reward`, `entropy`, `clip_ratio/*`,
`completions/*`) plus ours: `useful_token_fraction` (tokens that actually received gradient: groups
whose completions all got the same reward carry none), per-phase times (`time/generation_s`, ...)
and generation throughput."""),
    new_code_cell("""\
records = [r for r in read_jsonl(out / "metrics.jsonl") if "reward" in r]
steps = [r["step"] for r in records]
evals = [(r["step"], r["eval_toy_accuracy"]) for r in records if r.get("eval_toy_accuracy") is not None]

fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
axes[0].plot(steps, [r["reward"] for r in records], alpha=0.7, label="mean training reward (sampled, T=1)")
axes[0].plot([0] + [s for s, _ in evals], [before] + [a for _, a in evals], "o-", label="held-out greedy accuracy")
axes[0].set_xlabel("optimizer step"); axes[0].set_ylim(0, 1); axes[0].legend(); axes[0].set_title("learning")
axes[1].plot(steps, [r["useful_token_fraction"] for r in records], label="useful-token fraction")
axes[1].plot(steps, [r["frac_reward_zero_std"] for r in records], label="groups with zero reward variance")
axes[1].set_xlabel("optimizer step"); axes[1].set_ylim(0, 1); axes[1].legend(); axes[1].set_title("signal")
axes[2].plot(steps, [r["entropy"] for r in records], color="tab:purple")
axes[2].set_xlabel("optimizer step"); axes[2].set_title("policy entropy (nats / token)")
plt.tight_layout()
plt.show()"""),
    new_markdown_cell("## Evaluate"),
    new_code_cell("""\
after = toy.evaluate(trainer.model, eval_set, tokenizer)
print(f"held-out greedy accuracy: {before:.1%} before RL -> {after:.1%} after {trainer.state.global_step} GRPO steps")

# A few held-out problems, greedy
model = trainer.model.eval()
sample = eval_set.select(range(8))
prompts, golds = list(sample["prompt"]), list(sample["answer"])
batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
with torch.no_grad():
    generated = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
answers = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
for prompt, gold, answer in zip(prompts, golds, answers):
    print(f"{prompt:8s} model: {answer:5s} gold: {gold:4s} {'ok' if answer.strip() == gold else ''}")"""),
    new_markdown_cell("""\
The trained policy is a normal `transformers` model: `trainer.save_model(path)` and
`AutoModelForCausalLM.from_pretrained(path)` work as usual."""),
    new_code_cell("""\
trainer.save_model(str(out / "final_model"))
print("reloaded from disk:", f"{toy.evaluate(str(out / 'final_model'), eval_set):.1%}")"""),
    new_markdown_cell("""\
## Next

* `02_compare_variants.ipynb`: GRPO vs DAPO vs Dr.GRPO vs µ-GRPO side by side, at the same
  generation budget, through the variant lab (`grpo_variants.lab`).
* The same run from a shell: `grpo-variants demo`, or `grpo-variants train --help`.
* Real models: replace `kit.model_path` with a hub id and the dataset with yours; see `recipes/`."""),
]

COMPARE = [
    new_markdown_cell("""\
# Compare variants at the same generation budget

Which GRPO variant should you use? This notebook answers it the way the lab does: **same
starting model, same seed, same recipe, same generation budget**, then curves per optimizer step,
per generated token and per wall-second, plus how much of the generated work actually trained the
model (the *useful-token fraction*).

`grpo_variants.lab.compare` runs one training arm per variant (and per seed). Each arm stops once
its rollouts have generated the budget of tokens: groups DAPO's dynamic sampling throws away count
against DAPO, the extra updates µ-GRPO squeezes out of a stage are free in tokens but cost wall
time. All arms share the toy recipe `lab.TOY_CONFIG` (batch shape, learning rate, temperature);
everything else comes from each variant's own defaults:

| variant | what differs |
|---|---|
| `grpo` | group-std advantage, clip 0.2, per-sequence token mean, k3 KL with beta 0.04 |
| `dapo` | clip-higher (0.2 / 0.28), dynamic sampling (drops groups with equal rewards), token-level loss, overlong filtering, no KL |
| `dr_grpo` | no std division, constant normaliser (no length bias), no KL |
| `mu_grpo` | few large rollout stages, many updates per stage, relaxed clipping [0, 5] + negative-advantage veto |

A few minutes on a laptop CPU."""),
    new_code_cell(SETUP),
    new_code_cell("""\
from grpo_variants import lab, list_variants

print("registered variants:", [spec.name for spec in list_variants()])
print("shared recipe:", {k: lab.TOY_CONFIG[k] for k in ("per_device_train_batch_size", "num_generations",
                                                         "max_completion_length", "temperature", "learning_rate")})
VARIANTS = ["grpo", "dapo", "dr_grpo", "mu_grpo"]"""),
    new_markdown_cell("""\
The comparison's size (tagged `parameters`, papermill's convention: the test suite executes this notebook
with a small budget to check that it runs; what is discussed below comes from these values)."""),
    PARAMETERS_02,
    new_code_cell("""\
result = lab.compare(
    VARIANTS,
    task="addition",
    seeds=[0],
    budget_tokens=BUDGET_TOKENS,
    eval_every=EVAL_EVERY,
    eval_size=EVAL_SIZE,  # held-out problems per evaluation
)"""),
    new_markdown_cell("""\
## Summary

One row per variant. `final_accuracy` is held-out greedy accuracy where the budget ran out;
`useful_token_fraction` is the mean over steps of the fraction of generated tokens that received a
non-zero policy gradient (after DAPO's filtering, clipping, the veto and zero-advantage groups);
`useful_tokens_per_generated` counts reuse too (above 1 for µ-GRPO, which trains on each rollout
several times)."""),
    new_code_cell("""\
columns = ["variant", "initial_accuracy", "final_accuracy", "best_accuracy", "steps", "generated_tokens",
           "wall_seconds", "useful_token_fraction", "useful_tokens_per_generated", "clip_fraction",
           "veto_fraction", "final_entropy"]
result.summary[columns].round(3)"""),
    new_markdown_cell("""\
## Curves

The top row is the question you care about: held-out accuracy against optimizer steps, against
generated tokens (the budget everyone shares) and against wall-clock seconds. The bottom row
explains it: how much of each batch trained the model, how often the clip or the veto bit, and
what happened to the policy's entropy."""),
    new_code_cell("""\
fig = result.plot_dashboard()
plt.show()"""),
    new_code_cell("""\
fig, axes = plt.subplots(1, 3, figsize=(16, 3.8), sharey=True)
for ax, x in zip(axes, ["step", "generated_tokens", "wall_seconds"]):
    result.plot("eval_accuracy", x=x, ax=ax)
plt.tight_layout()
plt.show()"""),
    new_markdown_cell("""\
## The tidy table

`result.table` has one row per (variant, seed, optimizer step): filter, group and plot it any way
you like. `result.to_json(path)` keeps everything, `lab.LabResult.from_json(path)` reads it back."""),
    new_code_cell("""\
table = result.table
table[table["eval_accuracy"].notna()][["variant", "step", "generated_tokens", "wall_seconds", "eval_accuracy"]]"""),
    new_markdown_cell("""\
## Reading it honestly

* One seed and 200 held-out problems give about ±3.5 points of standard error per point on the
  curve: differences smaller than that are noise. Use `seeds=[0, 1, 2]` and `eval_size=500` before
  drawing conclusions (`benchmarks/variants.py` does).
* The budget is in *generated* tokens. On this toy model an optimizer update costs more than
  generating its batch, so µ-GRPO (many updates per rollout) spends more wall time per token; on
  real models generation dominates and the balance flips, which is the paper's point.
* Change a variant's settings with `overrides={"dapo": {"epsilon_high": 0.3}}`, the shared recipe
  with `config={...}`, and the budget with `budget_completions=...` instead of tokens."""),
]


PROCESS_READING = """\
## Reading the process-supervision study honestly (15,000 generated tokens per run, 3 seeds, 200 problems)

* **The budget is small** (about 17 steps of 32 completions; the 2-core machine was shared by six jobs)
  and the outcome-only arm ends *below* the start (13.8% ± 1.1 vs 16.5%): at lr 1e-4 the first steps
  perturb the warm-started policy. Differences of a few points over 3 seeds are hints, not results.
* **DeepSeekMath's finding** (process supervision beats outcome supervision for GRPO): only outcome +
  process is clearly above outcome-only (18.2% ± 0.2 vs 13.8% ± 1.1, the only arm above the start);
  the step reward alone with sum-form credit is within one standard error (15.7% ± 2.7), with min-form
  credit below it (10.8% ± 2.1). Partly reproduced, at this budget.
* **PURE's finding** (sum-form credit invites hacking: more, easier steps) is *not* reproduced: the
  sum-form policy writes as many steps per held-out completion as the outcome-only one (4.73 vs 4.80)
  and is right for the wrong reason as often (10.2% vs 10.3%). Min-form credit gives the fewest steps
  (4.37) and the lowest "right for the wrong reason" share (7.2%), but also the lowest accuracy. On this
  task the steps are not easier than the answer, so there is little to hack in 17 steps.
* **Right for the wrong reason is common**: at the start 45% of the right answers carry a wrong partial
  sum, and 63-75% after training in every arm: the tiny policy's final answer is only loosely tied to
  its trace, which is exactly what an outcome reward cannot see.
* **kl_target**: with a target of 0.01 (horizon 64 sequences) the adaptive arm is within one standard
  error of the best fixed beta (14.3% ± 1.0 vs beta 0.16: 14.8% ± 0.7) but its KL per token is 8.7x the
  target: the controller starts by *lowering* beta (the KL is 0 on the first on-policy step, below any
  target) and then raises it by at most 20% x n / H per step, too slowly for a 17-step run. A target of
  0.05 ends at 2.8x (horizon 32) and 3.1x (horizon 8) the target: with H = 8 the first steps cut beta
  from 0.04 to its floor (factor 0.2 per step) and it then climbs back exponentially, late
  (`process_rewards_kl_target_0.05*.md`; the trainer now warns when 0.2 x n / H > 0.5).
* **Given 40 steps it tracks the target**: at 36,000 tokens per run (`process_rewards_kl_long.md`) the
  adaptive arm (target 0.05, H = 32) ends at a KL per token of 0.0488 ± 0.0014, as steady as the fixed
  beta 0.16 that happens to give the same KL (0.0500 ± 0.0034), with beta ending at 0.13. Its accuracy
  (12.2% ± 1.7) is within one standard error of beta 0.16's (13.7% ± 1.4) but not of the best fixed beta
  (0.04: 15.0% ± 1.3); every arm of that run ends at or below the start, so the accuracy ranking of the
  KL weights is noise here. The study shows the controller reaching its target, not that a KL target
  beats a tuned beta.
* **Where the policy learns, a tuned beta wins** (`process_rewards_kl.md`, the table and plots above:
  40 steps of 128 completions, 500 problems, start 14.0%). Over 8 seeds the fixed betas 0.04 and 0.16 end
  level, 18.8 ± 0.7 and 18.3 ± 0.6% (beta 0 and 0.01: 14.4 and 14.6%, 3 seeds). Over the first 3 seeds
  beta 0.16 looked best at 20.1%: a 500-problem eval puts about 1.7 points of noise on each run, so the
  best of four arms over 3 seeds flatters itself. The rule alone (beta from 0.04, floor 1e-4) hits its
  targets (0.01 → 0.0097, 0.03 → 0.027) yet ends 1.3-3.9 points below: beta first *falls* (the first
  on-policy steps have KL ≈ 0), the KL overshoots to 2-3x the target in steps 8-20, and the controller
  then pulls the policy back with beta 0.45-5. With its start as a floor (`kl_beta_min=beta`) the collapse
  is gone and the KL sits on or near the target (H = 128: 0.029, 17.0 ± 0.7%; H = 512: 0.041, 17.7 ±
  0.7%, 8 seeds), still 1.1-1.8 points below the best fixed beta, not within one standard error. Accuracy
  is flat between beta 0.04 and 0.16 here, so moving beta mid-run has nothing to gain."""

REASONING = [
    new_markdown_cell("""\
# A short study: the variants on a task that needs reasoning

The arithmetic toy task answers in 3-6 tokens, so none of the problems the variants were designed for
shows up on it. The **chain task** (`toy.prepare(task="chain")`, `grpo_variants.tasks.toy_reasoning`) adds
3, 5 or 7 one-digit numbers and writes every partial sum: `7+5+9=` -> `7+5=12,12+9=21>21`. The warm
start taught four verbosities (answer only, running sums, full steps, "make ten" steps) with injected
mistakes, and refinement rows in iGRPO's template, so completions run from 3 to about 80 tokens, the
56-token budget truncates some, and wrong answers are longer than right ones.

This notebook reads what `benchmarks/reasoning.py` committed (it trains nothing, so it runs in
seconds): every variant, 3 seeds, the same generated-token budget, each with its paper settings."""),
    new_code_cell(SETUP),
    new_code_cell("""\
import json
from pathlib import Path

import grpo_variants
from grpo_variants import lab, toy_reasoning

RESULTS = Path(grpo_variants.__file__).resolve().parents[1] / "benchmarks" / "results"
for form in toy_reasoning.FORMS:
    print(f"{form:>8}: 7+5+9={toy_reasoning.make_trace([7, 5, 9], form)[0]}")
blob = json.loads((RESULTS / "reasoning.json").read_text())
result = lab.LabResult.from_json(RESULTS / "reasoning_lab.json")
settings = blob["settings"]
print("budget per arm:", settings["budget_tokens"], "generated tokens; seeds", settings["seeds"],
      "; held-out problems", settings["eval_problems"])"""),
    new_markdown_cell("""\
## What each arm reached, and what its mechanism did

Accuracy is held-out greedy accuracy (mean over seeds, ± standard error). The mechanism columns are
means over training steps: length of right / wrong completions (tokens), truncation rate, lower /
upper clip fractions, dynamic-sampling drop rate, veto fraction, FIPO weight mean, iGRPO draft and
refined accuracy (training reward)."""),
    new_code_cell("""\
import pandas as pd

rows = []
for r in blob["records"]:
    rows.append({"arm": r["variant"], "start": r["initial_accuracy"], "final": r["final_accuracy"]["mean"],
                 "se": r["final_accuracy"]["se"], "tokens": r["generated_tokens"],
                 "useful": r["useful_token_fraction"], "len right": r["mean_length_right"],
                 "len wrong": r["mean_length_wrong"], "trunc start": r["truncation_rate_start"],
                 "clip low": r["clip_low"], "clip high": r["clip_high"], "DS drop": r["ds_drop_rate"],
                 "veto": r["veto_fraction"], "FIPO w": r["fipo_weight_mean"],
                 "draft acc": r["igrpo_draft_accuracy"], "refined acc": r["igrpo_refined_accuracy"]})
pd.DataFrame(rows).set_index("arm").round(3)"""),
    new_code_cell("""\
fig = result.plot_dashboard()
plt.show()"""),
    new_code_cell("""\
fig = result.plot_mechanisms()
plt.show()
ax = result.plot_igrpo()
plt.show()"""),
    new_markdown_cell("""\
## Reading it honestly (the committed run: 8,000 generated tokens per arm, 3 seeds, 500 problems)

* **The budget is small** (the 2-core machine was shared by several jobs): 4-6 optimizer steps for
  most arms. DAPO and FIPO train 4 updates on one 256-completion rollout whose dynamic-sampling
  rounds overshoot the budget (about 18.5k tokens); µ-GRPO runs two stages. **No arm improves on
  the starting 24.2% at this budget** (GRPO 24.0% ± 0.5, Dr.GRPO 22.1, iGRPO 21.9, FIPO 20.2,
  DAPO 19.7, µ-GRPO 16.6, GSPO 15.9, stale µ-GRPO 12.1): the first RL steps at lr 1e-4 perturb the
  warm-started policy. The table does not rank the variants; it shows each mechanism at work.
* **Length bias**: wrong completions are longer than right ones in every arm (GRPO: 28.3 vs 23.1
  tokens): long problems are harder, and the verbose form of 7-operand problems is cut by the budget.
* **Truncation** is non-zero at the start but small (2-5% of sampled completions at temperature 0.7).
* **DAPO**: the upper clip acts on 0.6% of tokens (lower 2.9%); dynamic sampling dropped 49% of the
  groups, so its useful-token fraction is 0.33 against GRPO's 0.54.
* **GSPO**'s sequence clip of 3e-4 / 4e-4 clips 19% (low) and 4% (high) of tokens.
* **FIPO**'s future-KL weights average 1.04 (up to 1.15) once the policy moves off the rollout policy.
* **µ-GRPO**'s veto never fires at 8 updates per stage and the 1e-4 threshold; with 32 updates per
  stage and a 1e-2 threshold it vetoes 2.7% of tokens on average (up to ~9% late in a stage), and that
  arm still ends lowest: on this model staleness costs more than the veto saves.
* **iGRPO**'s refinements are right more often than its average draft (16.0% vs 12.8% training reward),
  so the policy reads the draft a little; but far less often than the best draft it was shown (38.2%):
  it does not yet copy a right draft reliably.
* Longer GRPO runs do learn: 40 steps of 128 completions lift held-out accuracy from 24.2% to 36.6%
  and 32.2% (seeds 0 and 1: 4.3 and 2.8 standard errors, 100 CPU-seconds each); with 64 completions
  per step the gain is not robust (+6.2 and -4.6 points). See `benchmarks/results/reasoning_grpo.md`.
  A comparison of the variants at that scale (about 160k tokens per arm) is the next run to make."""),
    new_markdown_cell("""\
## Process supervision and an adaptive KL weight (`benchmarks/process_rewards.py`)

Every partial sum of a chain trace is checkable, so the chain task has a rule-based *process* reward:
`toy_chain_steps` scores each step 1/0 and the final answer 1/0 (`@grpo_variants.step_reward`; the
trainer maps each step's end to the completion token that holds it). The study compares, at the same
generated-token budget and 3 seeds: the outcome reward alone, the step reward with DeepSeekMath's
sum-form credit (a token's advantage is the sum of the normalised rewards of the steps that end at or
after it), with PURE's min-form credit (their minimum), and outcome + process. It also compares fixed KL
weights with `kl_target` (beta adapted toward a target KL per token). "Right for the wrong reason" is
the share of held-out completions whose final answer is right while a stated partial sum is wrong."""),
    new_code_cell("""\
from grpo_variants.tasks.toy_reasoning import score_trace

print(score_trace([7, 5, 9], "7+5=12,12+9=21>21"))   # (end character, score) per step
print(score_trace([7, 5, 9], "7+5=13,13+9=21>21"))   # right answer, wrong partial sum
study = json.loads((RESULTS / "process_rewards.json").read_text())
print("budget per run:", study["meta"]["budget_tokens"], "generated tokens; seeds", study["meta"]["seeds"],
      "; held-out problems", study["meta"]["eval_problems"])
extra_path = RESULTS / "process_rewards_kl_target_0.05.json"
extra = json.loads(extra_path.read_text()) if extra_path.exists() else None
long_path = RESULTS / "process_rewards_kl_long.json"  # the KL arms again at 36,000 tokens (about 40 steps)
long = json.loads(long_path.read_text()) if long_path.exists() else None
rows = []
for name, s in (list(study["summary"].items())
                + ([("kl_target_0.05", extra["summary"]["kl_target"])] if extra else [])
                + ([(f"{arm} @36k", v) for arm, v in long["summary"].items()] if long else [])):
    rows.append({"arm": name, "accuracy": s["accuracy"], "se": s["accuracy_se"],
                 "right for wrong reason": s["right_for_wrong_reason"], "steps/completion": s["mean_steps"],
                 "KL/token (last third)": s["kl_last_third"], "final beta": s["final_beta"]})
print("start:", {k: round(v, 3) for k, v in study["initial"].items() if isinstance(v, float)})
pd.DataFrame(rows).set_index("arm").round(4)"""),
    new_code_cell("""\
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
arms = ["outcome", "process_sum", "process_min", "outcome_process"]
summary = study["summary"]
axes[0].bar(arms, [100 * summary[a]["accuracy"] for a in arms],
            yerr=[100 * (summary[a]["accuracy_se"] or 0) for a in arms], label="held-out accuracy")
axes[0].bar(arms, [100 * summary[a]["right_for_wrong_reason"] for a in arms], color="tab:red",
            label="right for the wrong reason")
axes[0].axhline(100 * study["initial"]["accuracy"], color="gray", ls="--", label="start")
axes[0].set_ylabel("%")
axes[0].legend(fontsize=8)
for blob_, color, target in ((study, "tab:purple", study["meta"]["kl_target"]),
                             (extra, "tab:green", extra["meta"]["kl_target"] if extra else None),
                             (long, "tab:red", long["meta"]["kl_target"] if long else None)):
    if blob_ is None:
        continue
    for run in blob_["runs"]:
        if run["arm"] == "kl_target":
            axes[1].plot([k or 0.0 for k in run["kl_trajectory"]], color=color, alpha=0.6)
    axes[1].axhline(target, color=color, ls="--")
axes[1].set_xlabel("optimizer step")
axes[1].set_ylabel("KL per token (dashed: target; red: 36k tokens)")
axes[1].set_title("kl_target runs")
plt.show()"""),
    new_code_cell("""\
# The KL grid where the policy learns: 40 steps of 128 completions (about 155,000 generated tokens per run),
# 500 held-out problems, 3 seeds (8 for beta 0.04, beta 0.16 and the two adaptive arms with a floor); the adaptive
# arms are named kl_target_<target>[_h<horizon>][_min<kl_beta_min>].
grid = json.loads((RESULTS / "process_rewards_kl.json").read_text())
print("start:", round(grid["initial"]["accuracy"], 3), "| horizon of the study:", grid["meta"]["kl_horizon"])
rows = [{"arm": arm, "seeds": len(s["seeds"]), "accuracy": s["accuracy"], "se": s["accuracy_se"],
         "KL/token (last third)": s["kl_last_third"],
         "final beta": s["final_beta"]} for arm, s in grid["summary"].items()]
display(pd.DataFrame(rows).set_index("arm").round(4))
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
adaptive = sorted({r["arm"] for r in grid["runs"] if r["arm"].startswith("kl_target")})
for color, arm in zip(("tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:orange", "tab:pink", "tab:blue",
                       "tab:red"), adaptive):
    for i, run in enumerate(r for r in grid["runs"] if r["arm"] == arm):
        axes[0].plot(run["beta_trajectory"], color=color, alpha=0.7, label=arm if i == 0 else None)
        axes[1].plot([k or 0.0 for k in run["kl_trajectory"]], color=color, alpha=0.7)
for arm in ("beta_0.04", "beta_0.16"):
    for run in (r for r in grid["runs"] if r["arm"] == arm):
        axes[1].plot([k or 0.0 for k in run["kl_trajectory"]], color="gray", alpha=0.4, ls=":")
axes[0].set_yscale("log")
axes[0].set_title("beta of the adaptive arms")
axes[0].legend(fontsize=8)
axes[1].set_title("KL per token (dotted gray: fixed beta 0.04 and 0.16)")
for ax in axes:
    ax.set_xlabel("optimizer step")
plt.show()"""),
    new_markdown_cell(PROCESS_READING),
]


def write(name: str, cells: list) -> Path:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep regenerated notebooks diff-free
        cell["id"] = f"{Path(name).stem.split('_')[0]}-{i:02d}"
    path = HERE / name
    nbformat.validate(nb)
    nbformat.write(nb, str(path))
    return path


def main() -> None:
    for name, cells in (("01_quickstart.ipynb", QUICKSTART), ("02_compare_variants.ipynb", COMPARE),
                        ("03_reasoning_study.ipynb", REASONING)):
        print("wrote", write(name, cells))


if __name__ == "__main__":
    main()
