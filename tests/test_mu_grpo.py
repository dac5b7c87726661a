"""µ-GRPO: stage mapping, on-policy reduction at µ = 1, one rollout per stage, the veto inside a real
trainer step, and mid-stage resume."""

from __future__ import annotations

import os

import pytest
import torch

import grpo_variants.trainer as base_trainer
from conftest import force_completions, tiny_args
from grpo_variants import (
    ConfigError,
    DatasetError,
    GRPOVariantConfig,
    GRPOVariantTrainer,
    MuGRPOConfig,
    MuGRPOTrainer,
    get_variant,
)

# A stage of 8 prompts x 4 completions = 32 = 2 mini-batches of 16; µ = 4 -> 2 passes per stage.
STAGE = dict(stage_prompts=8, updates_per_stage=4)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _losses(trainer):
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _metric(trainer, name):
    return [r[name] for r in trainer.state.log_history if name in r]


# ---- config ---------------------------------------------------------------------------------------
def test_config_maps_stage_onto_trl_buffer(make_args):
    args = make_args(MuGRPOConfig, gradient_accumulation_steps=2, per_device_train_batch_size=8, stage_prompts=16,
                     updates_per_stage=8, num_stages=3, max_steps=-1)
    # 16 completions per update; 64 per stage -> 4 mini-batches per pass; µ = 8 -> 2 passes
    assert args.mini_batches_per_pass == 4
    assert args.num_iterations == 2
    assert args.steps_per_generation == 8  # mini-batches x gradient accumulation
    assert args.generation_batch_size == 64
    assert args.max_steps == 24
    assert (args.epsilon, args.epsilon_high) == (1.0, 4.0) and args.clip_bounds == (0.0, 5.0)
    assert args.veto_scope == "H_kappa" and args.veto_threshold == 1e-4
    assert get_variant("µ-GRPO").trainer_cls is MuGRPOTrainer

    standard = make_args(MuGRPOConfig, relaxed_clip=False, veto_scope=None, **STAGE)
    assert (standard.epsilon, standard.epsilon_high) == (0.2, 0.2) and standard.veto_scope is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(stage_prompts=2), r"stage smaller than one mini-batch.*stage_prompts in \[4, 8, 12\]"),
        (dict(stage_prompts=6), r"not a multiple of the 16 completions per update.*\[4, 8, 12\]"),
        (dict(updates_per_stage=3), r"multiple of the 2 mini-batches.*updates_per_stage in \[2, 4, 6\]"),
        (dict(generation_chunk_prompts=3), r"generation_chunk_prompts \(3\) must divide.*Valid values: \[1, 2, 4, 8\]"),
        (dict(epsilon=0.2), r"relaxed_clip=True derives epsilon=1.0"),
        (dict(num_iterations=3), r"derives num_iterations"),
        (dict(mu_clip_lower=1.0), r"mu_clip_lower"),
        (dict(num_stages=2, max_steps=5), r"num_stages \(2\) x updates_per_stage \(4\) = 8"),
    ],
)
def test_config_errors(make_args, overrides, message):
    values = {**STAGE, **overrides}
    with pytest.raises(ConfigError, match=message):
        make_args(MuGRPOConfig, **values)


def test_dataset_smaller_than_a_stage(toy_model_path, small_train_dataset, make_args):
    with pytest.raises(DatasetError, match=r"train_dataset has 16 prompts, fewer than stage_prompts \(32\)"):
        MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                      args=make_args(MuGRPOConfig, stage_prompts=32, updates_per_stage=8),
                      train_dataset=small_train_dataset.select(range(16)))


# ---- µ = 1 is on-policy GRPO ----------------------------------------------------------------------
def test_mu_1_equals_on_policy_grpo(toy_model_path, small_train_dataset, make_args, tmp_path):
    common = dict(max_steps=3, loss_type="grpo", beta=0.0, learning_rate=1e-4)
    # Each trainer seeds the global RNG when it is built: build and train one after the other.
    grpo = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                              args=make_args(GRPOVariantConfig, output_dir=str(tmp_path / "g"), **common),
                              train_dataset=small_train_dataset)
    grpo.train()
    # µ-GRPO defaults (relaxed clip, H_kappa veto) at µ = 1: one stage = one update of 4 prompts x 4.
    mu = MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                       args=make_args(MuGRPOConfig, output_dir=str(tmp_path / "m"), stage_prompts=4,
                                      updates_per_stage=1, **common),
                       train_dataset=small_train_dataset)
    assert mu.args.num_iterations == 1 and mu.args.steps_per_generation == grpo.args.steps_per_generation
    mu.train()
    assert _losses(mu) == _losses(grpo) and len(_losses(mu)) == 3
    assert all(mu_v == g_v for mu_v, g_v in zip(_metric(mu, "grad_norm"), _metric(grpo, "grad_norm"), strict=True))
    p_mu, p_grpo = _params(mu.model), _params(grpo.model)
    assert all(torch.equal(p_mu[k], p_grpo[k]) for k in p_grpo)
    assert "old_per_token_logps" not in mu._buffered_inputs[0]  # aligned: on-policy, ratio = 1
    assert _metric(mu, "mu_grpo/staleness") == [0.0, 0.0, 0.0]
    assert len(mu.stage_log) == 3


# ---- one rollout per stage --------------------------------------------------------------------------
def test_buffer_generated_once_per_stage(toy_model_path, small_train_dataset, make_args, monkeypatch):
    args = make_args(MuGRPOConfig, generation_chunk_prompts=2, max_steps=8, **STAGE)
    trainer = MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                            train_dataset=small_train_dataset)
    generate_calls, batches = [], []
    original_generate = trainer._generate

    def counting_generate(prompts):
        generate_calls.append(len(prompts))
        return original_generate(prompts)

    trainer._generate = counting_generate
    original_loss = trainer._compute_loss

    def recording_loss(model, inputs):
        batches.append({k: inputs[k].clone() for k in ("prompt_ids", "completion_ids", "policy_version",
                                                        "old_per_token_logps")})
        return original_loss(model, inputs)

    trainer._compute_loss = recording_loss
    trainer.train()

    # 2 stages x 4 chunks of 2 prompts x 4 completions; nothing regenerated in between.
    assert generate_calls == [8] * 8
    assert [s["chunks"] for s in trainer.stage_log] == [4, 4]
    assert [s["global_step"] for s in trainer.stage_log] == [0, 4]
    assert trainer._generation_rounds_total == 2
    assert _metric(trainer, "mu_grpo/staleness") == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    assert [int(b["policy_version"][0]) for b in batches] == [0, 0, 0, 0, 4, 4, 4, 4]
    # µ = 4 over 2 mini-batches: each stored mini-batch is revisited once, in the same order.
    assert torch.equal(batches[0]["completion_ids"], batches[2]["completion_ids"])
    assert torch.equal(batches[1]["completion_ids"], batches[3]["completion_ids"])
    assert not torch.equal(batches[0]["prompt_ids"], batches[1]["prompt_ids"])  # two different mini-batches
    # Stored behaviour log-probs are the frozen policy's: unchanged while the policy moves.
    assert torch.equal(batches[0]["old_per_token_logps"], batches[2]["old_per_token_logps"])
    ratio_first = _metric(trainer, "mu_grpo/neg_adv_ratio_mean")[0]
    assert ratio_first == pytest.approx(1.0, abs=1e-5)  # first update of a stage: pi_theta = pi_behav
    for key in ("mu_grpo/stage_generation_s", "mu_grpo/stage_update_s", "mu_grpo/stage_tokens",
                "mu_grpo/stage_sequences_per_s", "veto/fraction", "clip_ratio/region_mean"):
        assert _metric(trainer, key), key
    assert _metric(trainer, "mu_grpo/stage_update_s")[0] > 0


# ---- the veto inside a real trainer step ------------------------------------------------------------
class _CraftedMuGRPO(MuGRPOTrainer):
    """Hand-crafts the stage: fixed advantages and behaviour log-probs that make chosen tokens trigger."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        rows = out["advantages"].shape[0]
        out["advantages"] = torch.tensor([-1.0, 1.0, 0.0, -0.5] * (rows // 4))
        old = out["old_per_token_logps"].clone()
        lengths = out["completion_mask"].sum(1)
        for i in range(rows):
            if lengths[i] >= 3:
                old[i, int(lengths[i]) // 2] += 30.0  # ratio = pi_theta / pi_behav ~ e^-30 < 1e-4 there
                if i % 8 == 0:
                    old[i, int(lengths[i]) - 1] += 30.0  # a second trigger further right
        out["old_per_token_logps"] = old
        return out


def _reference_veto(triggers: torch.Tensor, mask: torch.Tensor, scope: str) -> torch.Tensor:
    """Vetoed tokens written out by hand from the paper's definitions."""
    vetoed = torch.zeros_like(mask, dtype=torch.bool)
    for i in range(mask.shape[0]):
        hits = [t for t in range(mask.shape[1]) if triggers[i, t]]
        if not hits:
            continue
        kappa = hits[0]
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            if scope == "T":
                vetoed[i, t] = bool(triggers[i, t])
            elif scope == "S_kappa":
                vetoed[i, t] = t > kappa  # after the trigger boundary, kappa excluded
            elif scope == "H_kappa":
                vetoed[i, t] = t > kappa and not triggers[i, t]
            elif scope == "S_seq":
                vetoed[i, t] = True
    return vetoed


@pytest.mark.parametrize("scope", ["T", "S_kappa", "H_kappa", "S_seq"])
def test_veto_scopes_in_a_trainer_step(toy_model_path, small_train_dataset, make_args, monkeypatch, scope):
    captured = []
    original = base_trainer.compute_policy_loss

    def capture(spec, logp, old_logp, advantages, mask, **kwargs):
        out = original(spec, logp, old_logp, advantages, mask, **kwargs)
        captured.append((logp.detach(), old_logp, advantages, mask, out))
        return out

    monkeypatch.setattr(base_trainer, "compute_policy_loss", capture)
    # One mini-batch of 4 prompts x 4, µ = 2 -> behaviour log-probs are stored and used.
    args = make_args(MuGRPOConfig, stage_prompts=4, updates_per_stage=2, max_steps=1, veto_scope=scope)
    trainer = _CraftedMuGRPO(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                             train_dataset=small_train_dataset)
    # 3 to 6 tokens per completion by construction: every row has tokens before and after its trigger
    force_completions(trainer, lambda prompt, k: ["12</s>", "123</s>", "1234</s>", "12345</s>"][k])
    trainer.train()
    (logp, old, adv, mask, out), = captured
    adv = adv.view(-1, 1)
    ratio = torch.exp(logp - old)
    low = (mask > 0) & (ratio < 1e-4)
    triggers = low & (adv < 0)
    assert triggers.any() and (low & (adv >= 0)).any(), "the crafted batch must trigger for A<0 and A>=0 rows"
    assert torch.equal(out.stats["veto_triggers"], triggers)
    expected = _reference_veto(triggers, mask, scope)
    assert torch.equal(out.stats["vetoed"], expected)
    assert expected.any()
    assert not out.stats["vetoed"][(adv >= 0).expand_as(mask)].any()  # A >= 0 rows are never vetoed
    assert torch.all(out.per_token_loss[expected] == 0)  # no gradient through vetoed tokens
    kept_signal = (mask > 0) & ~expected & (adv != 0) & (ratio > 1e-4)
    assert torch.all(out.per_token_loss[kept_signal] != 0)
    logged = _metric(trainer, "veto/fraction")
    assert logged and logged[0] == pytest.approx(expected.sum().item() / mask.sum().item(), rel=1e-6)


# ---- mid-stage resume -------------------------------------------------------------------------------
def _resume_setup(toy_model_path, train_dataset, output_dir):
    args = tiny_args(MuGRPOConfig, output_dir=str(output_dir), max_steps=8, save_strategy="steps", save_steps=2,
                     generation_chunk_prompts=4, **STAGE)
    trainer = MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args, train_dataset=train_dataset)
    calls = []
    original = trainer._generate

    def counting(prompts):
        calls.append(trainer.state.global_step)
        return original(prompts)

    trainer._generate = counting
    return trainer, calls


@pytest.mark.slow
def test_mid_stage_resume_continues_the_stage(toy_model_path, small_train_dataset, tmp_path):
    """8 updates = 2 stages of µ = 4; resume from checkpoint-2 (2 of the stage's 4 updates done)."""
    full, full_calls = _resume_setup(toy_model_path, small_train_dataset, tmp_path / "full")
    full.train()
    assert full_calls == [0, 0, 4, 4]  # 2 stages x 2 chunks

    resumed, resumed_calls = _resume_setup(toy_model_path, small_train_dataset, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed_calls == [4, 4], "resuming mid-stage regenerated the stage instead of continuing its buffer"
    assert [s["stage"] for s in resumed.stage_log] == [1, 2]
    assert _metric(resumed, "mu_grpo/staleness")[2:] == [2.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    # The resumed log history starts with the checkpoint's (steps 1-2); steps 3-8 are new.
    assert len(_losses(resumed)) == 8
    assert _losses(resumed)[2:] == _losses(full)[2:]
    p_full, p_resumed = _params(full.model), _params(resumed.model)
    assert all(torch.equal(p_full[k], p_resumed[k]) for k in p_full)


# ---- the recipe --------------------------------------------------------------------------------------
RECIPES_DIR = __import__("pathlib").Path(__file__).resolve().parents[1] / "recipes"


def _load_recipe(name):
    import importlib
    import sys

    if str(RECIPES_DIR) not in sys.path:
        sys.path.insert(0, str(RECIPES_DIR))
    return importlib.import_module(name)


def test_recipe_paper_scale_and_toy_configs():
    import copy

    common, module = _load_recipe("_common"), _load_recipe("mu_grpo_qwen")
    config, options = common.build_config(copy.deepcopy(module.RECIPE), [], num_processes=8)
    assert not options.toy and config.variant == "mu_grpo"
    assert config.gradient_accumulation_steps == 8  # 256 completions per update on 8 processes
    assert (config.updates_per_stage, config.stage_prompts, config.max_steps) == (1024, 4096, 4 * 1024)
    assert config.num_iterations * config.mini_batches_per_pass == 1024
    assert (config.epsilon, config.epsilon_high, config.veto_scope) == (1.0, 4.0, "H_kappa")
    ablation, _ = common.build_config(copy.deepcopy(module.RECIPE), ["--relaxed_clip", "false", "--veto_scope", "None"],
                                      num_processes=8)
    assert (ablation.epsilon, ablation.epsilon_high, ablation.veto_scope) == (0.2, 0.2, None)

    config, options = common.build_config(copy.deepcopy(module.RECIPE), ["--toy"])
    assert options.toy and config.use_vllm is False
    assert (config.updates_per_stage, config.mini_batches_per_pass, config.max_steps) == (4, 4, 12)
    recipe = copy.deepcopy(module.RECIPE)
    module._apply_max_steps_override(recipe, ["--toy", "--max_steps", "4"])
    config, _ = common.build_config(recipe, ["--toy", "--max_steps", "4"])
    assert config.max_steps == 4 and config.num_stages is None


@pytest.mark.slow
def test_recipe_toy_run(toy_model_path, tmp_path):
    """The recipe script as a user launches it, on the toy kit: one stage of µ = 4 in two generation chunks."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(RECIPES_DIR / "mu_grpo_qwen.py"), "--toy", "--max_steps", "4",
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "updates/rollout=4" in result.stdout and "held-out accuracy after" in result.stdout
    # the console shows a progress bar, not a dict per step: the stage metrics are in the run's record
    import json

    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    assert any("mu_grpo/stage_generation_s" in r for r in records)
    assert (tmp_path / "out" / "config.json").exists()
