"""The variant lab: generation budgets, the comparison table, MFU, and no extra forward passes vs TRL."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from grpo_variants import ConfigError, GRPOVariantTrainer, UnknownVariantError, lab
from grpo_variants.callbacks import (
    GenerationBudgetCallback,
    MFUCallback,
    peak_bf16_flops,
    rollout_due,
    step_flops,
)

REPO = Path(__file__).resolve().parents[1]
TINY = dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=6, learning_rate=1e-4)


def _overhead_module():
    spec = importlib.util.spec_from_file_location("bench_overhead", REPO / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(toy_model_path, dataset, args, **kwargs):
    return GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args, train_dataset=dataset,
                              **kwargs)


# ---- generation budget -----------------------------------------------------------------------------
def test_token_budget_stops_at_first_step_past_budget(toy_model_path, small_train_dataset, make_args):
    trainer = _trainer(toy_model_path, small_train_dataset, make_args(max_steps=20))
    seen = []

    class Spy(GenerationBudgetCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(self.spent()["generated_tokens"])
            return super().on_step_end(args, state, control, **kwargs)

    budget = Spy(trainer, budget_tokens=100)  # one step of 16 completions generates about 55 tokens
    trainer.add_callback(budget)
    trainer.train()
    steps = trainer.state.global_step
    assert 1 < steps < 20
    assert seen[-1] >= 100 > seen[-2], seen  # stopped at the first step whose rollout spent the budget
    assert budget.stopped_at_step == steps
    assert trainer._tokens_generated_total == seen[-1]
    assert trainer._completions_generated_total == 16 * steps


def test_completion_budget(toy_model_path, small_train_dataset, make_args):
    trainer = _trainer(toy_model_path, small_train_dataset, make_args(max_steps=20))
    trainer.add_callback(GenerationBudgetCallback(trainer, budget_completions=40))
    trainer.train()
    assert trainer.state.global_step == 3  # 16, 32, 48 completions
    assert trainer._completions_generated_total == 48


@pytest.mark.parametrize("stop, expected_steps", [("rollout", 2), ("step", 1)])
def test_budget_stop_modes_with_reused_rollout(toy_model_path, small_train_dataset, make_args, stop, expected_steps):
    # One rollout feeds two optimizer steps: "rollout" trains on all of it, "step" stops at once.
    args = make_args(max_steps=10, steps_per_generation=2)
    trainer = _trainer(toy_model_path, small_train_dataset, args)
    trainer.add_callback(GenerationBudgetCallback(trainer, budget_tokens=1, stop=stop))
    trainer.train()
    assert trainer.state.global_step == expected_steps
    assert trainer._generation_rounds_total == 1
    assert rollout_due(trainer) == (stop == "rollout")


def test_budget_callback_errors(toy_model_path, small_train_dataset, make_args):
    trainer = _trainer(toy_model_path, small_train_dataset, make_args())
    with pytest.raises(ConfigError, match="budget_tokens or budget_completions"):
        GenerationBudgetCallback(trainer)
    with pytest.raises(ConfigError, match="positive"):
        GenerationBudgetCallback(trainer, budget_tokens=0)
    with pytest.raises(ConfigError, match="'rollout' or 'step'"):
        GenerationBudgetCallback(trainer, budget_tokens=10, stop="soon")
    with pytest.raises(ConfigError, match="GRPOVariantTrainer"):
        GenerationBudgetCallback(object(), budget_tokens=10)


# ---- the lab ---------------------------------------------------------------------------------------
def test_compare_is_compute_matched_and_tidy(tmp_path):
    result = lab.compare(
        ["grpo", "dr_grpo"], task="addition", seeds=[0], budget_tokens=150, config=TINY, eval_every=2, eval_size=48,
        output_dir=tmp_path, verbose=False,
    )
    table = result.table
    assert list(table.columns) == lab.COLUMNS
    assert set(table["variant"]) == {"grpo", "dr_grpo"}
    assert (table.groupby(["variant", "seed", "step"]).size() == 1).all()  # one row per (variant, seed, step)
    start = table[table["step"] == 0]
    assert len(start) == 2 and start["eval_accuracy"].nunique() == 1  # same starting model
    for variant, rows in table.groupby("variant"):
        rows = rows.sort_values("step")
        tokens = rows["generated_tokens"].tolist()
        assert tokens == sorted(tokens) and tokens[-1] >= 150 > tokens[-2], (variant, tokens)
        assert rows["wall_seconds"].is_monotonic_increasing
        train = rows[rows["step"] > 0]
        assert train["reward"].notna().all() and train["entropy"].notna().all()
        assert train["useful_token_fraction"].between(0, 1).all()
        assert train["clip_fraction"].between(0, 1).all()
        assert train["veto_fraction"].isna().all()  # no veto in these variants
        last = rows.iloc[-1]
        assert not math.isnan(last["eval_accuracy"])  # evaluated where the budget stopped training
    # Same seed: the first rollout is identical in every arm.
    first = table[table["step"] == 1].set_index("variant")
    assert first.loc["grpo", "reward"] == first.loc["dr_grpo", "reward"]
    assert first.loc["grpo", "generated_tokens"] == first.loc["dr_grpo", "generated_tokens"]
    # The metrics came through the JSONL callback.
    assert (tmp_path / "grpo" / "seed0" / "metrics.jsonl").exists()

    summary = result.summary.set_index("variant")
    assert summary.loc["grpo", "generated_tokens"] >= 150 and bool(summary.loc["grpo", "budget_reached"])
    assert 0 <= summary.loc["dr_grpo", "useful_token_fraction"] <= 1
    assert "| grpo |" in result.to_markdown()

    path = result.to_json(tmp_path / "lab.json")
    again = lab.LabResult.from_json(path)
    assert again.rows == result.rows and again.summary_rows == result.summary_rows
    assert again.meta["budget_tokens"] == 150 and again.meta["seeds"] == [0]
    result.plot_dashboard(tmp_path / "dash.png")
    result.plot("eval_accuracy", x="generated_tokens", path=tmp_path / "acc.png")
    assert (tmp_path / "dash.png").stat().st_size > 10_000 and (tmp_path / "acc.png").exists()


def test_compare_rejects_bad_requests():
    with pytest.raises(ConfigError, match="generation budget"):
        lab.compare(["grpo"])
    with pytest.raises(UnknownVariantError):
        lab.compare(["grpo", "no_such_variant"], budget_tokens=100)
    with pytest.raises(ConfigError, match="not compared"):
        lab.compare(["grpo"], budget_tokens=100, overrides={"dr_grpo": {"beta": 0.1}})
    with pytest.raises(ConfigError, match="toy task"):
        lab.compare(["grpo"], task="gsm8k", budget_tokens=100)


def test_toy_preset_sizes_a_valid_mu_grpo_stage():
    preset = lab.toy_preset("mu_grpo", lab.TOY_CONFIG)
    per_update = lab.TOY_CONFIG["per_device_train_batch_size"]
    completions = preset["stage_prompts"] * lab.TOY_CONFIG["num_generations"]
    assert completions % per_update == 0 and preset["updates_per_stage"] % (completions // per_update) == 0
    assert lab.toy_preset("grpo", lab.TOY_CONFIG) == {}


# ---- MFU ---------------------------------------------------------------------------------------------
def test_peak_flops_table(monkeypatch):
    monkeypatch.delenv("GRPO_VARIANTS_PEAK_FLOPS", raising=False)
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H20") == 148e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L40S") == 362e12 and peak_bf16_flops("NVIDIA L4") == 121e12
    assert peak_bf16_flops("NVIDIA A10G") is None  # unknown: MFU is not logged rather than guessed
    monkeypatch.setenv("GRPO_VARIANTS_PEAK_FLOPS", "1e12")
    assert peak_bf16_flops("NVIDIA A10G") == 1e12
    assert step_flops(1_000, trained_tokens=10, generated_tokens=5) == 6 * 1_000 * 10 + 2 * 1_000 * 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_no_mfu_on_cpu(toy_model_path, small_train_dataset, make_args):
    trainer = _trainer(toy_model_path, small_train_dataset, make_args(max_steps=1))
    assert not any(isinstance(cb, MFUCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    logged = {k for record in trainer.state.log_history for k in record}
    assert "throughput/mfu" not in logged and "throughput/generated_tokens_per_s" in logged
    assert "time/update_s" in logged and "time/generation_s" in logged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="MFU is logged only on a CUDA GPU")
def test_mfu_logged_on_gpu(toy_model_path, small_train_dataset, make_args, monkeypatch):
    monkeypatch.setenv("GRPO_VARIANTS_PEAK_FLOPS", "989e12")  # any GPU, known to the table or not
    trainer = _trainer(toy_model_path, small_train_dataset, make_args(max_steps=2))
    trainer.train()
    values = [r["throughput/mfu"] for r in trainer.state.log_history if "throughput/mfu" in r]
    assert len(values) == 2 and all(0 < v < 1 for v in values)


def test_mfu_arithmetic_with_a_given_peak(toy_model_path, small_train_dataset, make_args):
    # The callback's bookkeeping, exercised on any device by forcing it on with a made-up peak.
    trainer = _trainer(toy_model_path, small_train_dataset, make_args(max_steps=1))
    callback = MFUCallback(trainer, peak_flops=1e9)
    callback.enabled = True
    trainer.add_callback(callback)
    trainer.train()
    record = next(r for r in trainer.state.log_history if "throughput/mfu" in r)
    assert record["throughput/mfu"] > 0
    assert record["throughput/mfu"] == pytest.approx(record["throughput/model_tflops_per_s"] * 1e12 / 1e9, rel=1e-6)
    # Trained tokens: the non-padding prompt + completion tokens of the loss forward, i.e. what TRL counts
    # as num_tokens for this single on-policy step.
    assert float(callback._trained_tokens) == record["num_tokens"]
    assert callback._hook is None  # removed at train end


# ---- no extra forward passes compared with TRL ------------------------------------------------------
@pytest.mark.parametrize("variant", ["grpo", "bnpo", "dr_grpo", "dapo", "gspo"])
def test_no_extra_forward_pass_vs_trl(variant, toy_model_path, small_train_dataset, tmp_path):
    overhead = _overhead_module()
    counts = {}
    rewards = {}
    for kind in ("ours", "trl"):
        trainer = overhead.build_trainer(kind, variant, toy_model_path, small_train_dataset, str(tmp_path / kind),
                                         max_steps=2, **TINY)
        counter = overhead.ForwardCounter(trainer)
        trainer.train()
        counter.remove()
        counts[kind] = counter.counts
        rewards[kind] = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    ours, trl = counts["ours"], counts["trl"]
    assert ours["grad"] > 0 and ours["generate_calls"] > 0
    for key in ("grad", "ref", "generate_calls"):
        assert ours[key] == trl[key], (variant, key, ours, trl)
    if variant == "grpo":
        assert ours["ref"] > 0  # beta = 0.04: the reference model runs, once per rollout, in both
    if variant == "gspo":
        # steps_per_generation = 2: TRL runs a forward pass for the old log-probs; ours records them in generate
        assert trl["scoring"] > 0 and ours["scoring"] == 0, (ours, trl)
    else:
        assert ours["scoring"] == trl["scoring"], (variant, ours, trl)
    assert rewards["ours"] == rewards["trl"]  # same seed, same samples


# ---- benchmark runner ---------------------------------------------------------------------------------
def test_run_all_orders_scripts_and_builds_the_readme_section(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run_all", REPO / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    names = [p.name for p in run_all.scripts()]
    assert "run_all.py" not in names and names.index("overhead.py") < names.index("variants.py")
    # results section from a results folder with one table (headings demoted, image linked) and placeholders
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "variants.md").write_text("# All variants\n\n| a |\n|---|\n\n![variants](variants.png)\n")
    (tmp_path / "results" / "variants.png").write_bytes(b"png")
    (tmp_path / "README.md").write_text("intro\n<!-- results:start -->\nSTALE-TABLE\n<!-- results:end -->\nfooter\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    run_all.update_readme()
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("intro\n") and text.endswith("footer\n") and "STALE-TABLE" not in text
    assert "### All variants" in text and "](results/variants.png)" in text
    assert "_Not run yet (placeholder): `python benchmarks/overhead.py`" in text
