"""Training time when every completion the code reward sees is hostile, vs when every one is correct.

A 3-step toy GRPO run (16 completions a step, the code reward's default pool) whose reward is
``code_pass`` fed, for every sampled completion, either a correct ``add`` or one of the hostile
programs of ``tests/test_code_judge.py`` (crash, stall, forged records, output flood, hash-flood set,
deep nesting), with the reward's default time limits (each completion's budget is ``time_factor=4`` x a
program-free run's time, at least ``min_timeout=0.5`` s, at most ``timeout=10`` s) and, for comparison,
with the whole 2 s ``timeout`` per completion (``time_factor=None``, the behaviour before the relative
limit). The trainer must finish (``reward_on_error="raise"``); the ratio shows what hostile programs
cost: the stalling ones use their whole wall-clock budget. Correct and hostile runs alternate, 3 pairs
for the default setting, side by side in one process.

    python benchmarks/code_reward_hostile_training.py

Writes benchmarks/results/code_reward_hostile_training.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from _bench import toy  # noqa: E402  (sets the offline environment)

import test_code_judge as tcj  # noqa: E402
from conftest import tiny_args  # noqa: E402
from grpo_variants import GRPOVariantTrainer  # noqa: E402
from grpo_variants.rewards import make_code_reward  # noqa: E402

HOSTILES = dict(tcj.TRAINING_HOSTILES)


def run(kind: str, options: dict, kit) -> dict:
    tcj.TRAINING_HOSTILES = HOSTILES if kind == "hostile" else {"correct": tcj.CORRECT_ADD}
    reward = tcj._EveryCompletionHostile(make_code_reward("all", **options))
    with tempfile.TemporaryDirectory() as d:
        args = tiny_args(output_dir=d, max_steps=3, reward_on_error="raise")
        trainer = GRPOVariantTrainer(model=kit.model_path, reward_funcs=[reward], args=args,
                                     train_dataset=kit.train_dataset.select(range(256)))
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    budgets = [b for b in reward.reward.last_budgets if b is not None]
    return {"steps": trainer.state.global_step, "train_seconds": round(wall, 2),
            "trainer_cpu_seconds": round(cpu, 2),
            "last_step_budget_seconds": [round(min(budgets), 3), round(max(budgets), 3)] if budgets else None,
            "reward_mean": [r.get("rewards/code_pass/mean") for r in trainer.state.log_history if "loss" in r]}


SETTINGS = {
    "default": ({}, 3),  # options, pairs of runs
    "time_factor=None, timeout=2s": ({"time_factor": None, "timeout": 2.0}, 1),
}


def main() -> dict:
    import statistics

    kit = toy.prepare(task="addition", verbose=False)
    out: dict = {"steps": 3, "completions_per_step": 16, "hostile_kinds": sorted(HOSTILES),
                 "cpu_count": os.cpu_count(), "load_average_before": os.getloadavg(), "runs": {}}
    for name, (options, pairs) in SETTINGS.items():
        arms: dict = {"options": options, "correct": [], "hostile": []}
        for _ in range(pairs):
            for kind in ("correct", "hostile"):
                arms[kind].append(run(kind, options, kit))
        ratios = [h["train_seconds"] / c["train_seconds"] for c, h in zip(arms["correct"], arms["hostile"])]
        arms["hostile_over_correct"] = [round(r, 2) for r in ratios]
        arms["hostile_over_correct_median"] = round(statistics.median(ratios), 2)
        out["runs"][name] = arms
        print(name, arms["hostile_over_correct"], flush=True)
    out["load_average_after"] = os.getloadavg()
    out["note"] = ("pairs of runs (correct, then hostile) on one 2-core machine; the hostile arm's extra time is the "
                   "wall-clock budget of the programs that run to it (stall, flood, hash flood: half of the kinds) "
                   "divided by the pool's workers; the trainer's own CPU stays that of the correct arm")
    (HERE / "results" / "code_reward_hostile_training.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
