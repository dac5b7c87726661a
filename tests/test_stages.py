"""Stage rollouts (grpo_variants.rollout.stages) as a component: plain GRPO with a stage, by construction.

µ-GRPO composes the same component (tests/test_mu_grpo.py covers it there); here the base trainer with
``stage_prompts`` / ``updates_per_stage`` and nothing of µ-GRPO's loss (TRL's clip 0.2, no veto).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig

# 8 prompts x 4 completions = 32 rows = 2 mini-batches of 16; µ = 4 -> 2 passes over the stage.
STAGE = dict(stage_prompts=8, updates_per_stage=4)


class _RowIds(GRPOVariantTrainer):
    """Tags every row of a stage with a unique id, so that the loss can tell which stored rows it trains on."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            rows = out["advantages"].size(0)
            out["row_id"] = torch.arange(rows) + 1000 * len(self.stage_log)
        return out


def test_stage_fields_derive_trl_batching_for_any_variant(make_args):
    args = make_args(GRPOVariantConfig, gradient_accumulation_steps=2, per_device_train_batch_size=8,
                     stage_prompts=16, updates_per_stage=8, num_stages=3, max_steps=-1)
    # 16 completions per update, 64 per stage -> 4 mini-batches per pass; µ = 8 -> 2 passes
    assert (args.mini_batches_per_pass, args.num_iterations, args.steps_per_generation) == (4, 2, 8)
    assert (args.generation_batch_size, args.max_steps) == (64, 24)
    assert (args.epsilon, args.epsilon_high, args.veto_scope) == (0.2, 0.2, None)  # GRPO's loss, untouched
    mu = make_args(MuGRPOConfig, gradient_accumulation_steps=2, per_device_train_batch_size=8,
                   stage_prompts=16, updates_per_stage=8, num_stages=3, max_steps=-1)
    for name in ("mini_batches_per_pass", "num_iterations", "steps_per_generation", "generation_batch_size",
                 "max_steps"):
        assert getattr(mu, name) == getattr(args, name), name  # µ-GRPO's stage is this component
    plain = make_args(GRPOVariantConfig)
    assert plain.stage_prompts is None and not hasattr(plain, "mini_batches_per_pass")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(updates_per_stage=4), r"updates_per_stage size a stage rollout, but stage_prompts is not set"),
        (dict(generation_chunk_prompts=2), r"generation_chunk_prompts size a stage rollout"),
        (dict(stage_prompts=8), r"stage_prompts=8 turns on stage rollouts and needs updates_per_stage"),
        (dict(mini_batches_per_rollout=2, **STAGE), r"mini_batches_per_rollout and stage_prompts"),
        (dict(steps_per_generation=3, **STAGE), r"the stage derives steps_per_generation"),
        (dict(stage_prompts=6, updates_per_stage=4), r"not a multiple of the 16 completions per update"),
    ],
)
def test_stage_config_errors(make_args, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_args(GRPOVariantConfig, **overrides)


def test_grpo_with_a_stage_trains_each_stored_row_once_per_pass(toy_model_path, small_train_dataset, make_args):
    args = make_args(GRPOVariantConfig, generation_chunk_prompts=2, max_steps=8, **STAGE)
    trainer = _RowIds(model=toy_model_path, reward_funcs="toy_accuracy", args=args, train_dataset=small_train_dataset)
    generate_calls, batches = [], []
    original_generate, original_loss = trainer._generate, trainer._compute_loss

    def counting_generate(prompts):
        generate_calls.append(len(prompts))
        return original_generate(prompts)

    def recording_loss(model, inputs):
        batches.append({k: inputs[k].clone() for k in ("row_id", "policy_version")})
        return original_loss(model, inputs)

    trainer._generate, trainer._compute_loss = counting_generate, recording_loss
    trainer.train()

    # 2 stages, each generated once in 4 chunks of 2 prompts x 4 completions, nothing regenerated in between.
    assert generate_calls == [8] * 8
    assert [s["chunks"] for s in trainer.stage_log] == [4, 4] and trainer._generation_rounds_total == 2
    assert len(batches) == 8  # µ = 4 updates per stage (one micro-batch each)
    for stage in range(2):
        seen = torch.cat([b["row_id"] for b in batches[4 * stage : 4 * stage + 4]]).tolist()
        # every one of the stage's 32 stored rows is trained exactly num_iterations = 2 times ...
        assert Counter(seen) == {1000 * (stage + 1) + r: 2 for r in range(32)}
        # ... in two passes over the same 2 mini-batches, visited in the same order
        first, second = batches[4 * stage : 4 * stage + 2], batches[4 * stage + 2 : 4 * stage + 4]
        assert all(torch.equal(a["row_id"], b["row_id"]) for a, b in zip(first, second, strict=True))
        assert all(int(v) == 4 * stage for b in first + second for v in b["policy_version"])
    staleness = [r["stages/staleness"] for r in trainer.state.log_history if "stages/staleness" in r]
    assert staleness == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    assert any("stages/stage_generation_s" in r for r in trainer.state.log_history)
    assert trainer.variant_state_dict()["stages"]["stage_index"] == 2


def test_dynamic_sampling_refuses_a_stage(toy_model_path, small_train_dataset, make_args):
    args = make_args(GRPOVariantConfig, dynamic_sampling=True, **STAGE)
    with pytest.raises(ConfigError, match="dynamic_sampling=True composes with .*stage_prompts=8"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                           train_dataset=small_train_dataset)
