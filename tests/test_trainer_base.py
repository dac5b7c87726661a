"""The base trainer: a short real training run, TRL-compatible behaviour, and clear construction errors."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig

from conftest import position_reward
from grpo_variants import (
    ConfigError,
    DatasetError,
    GRPOVariantConfig,
    GRPOVariantTrainer,
    ModelPathError,
    UnknownRewardError,
    UnknownVariantError,
    get_variant,
    toy,
)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_three_step_training_run(toy_model_path, small_train_dataset, make_args):
    trainer = GRPOVariantTrainer(
        model=toy_model_path,
        reward_funcs=position_reward,  # distinct rewards in every group: a policy gradient at every step
        args=make_args(max_steps=3, reward_cache=False),
        train_dataset=small_train_dataset,
    )
    before = _params(trainer.model)
    result = trainer.train()
    assert trainer.state.global_step == 3
    assert math.isfinite(result.training_loss)
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    logged = {k for record in trainer.state.log_history for k in record}
    for key in ("reward", "entropy", "clip_ratio/region_mean", "useful_token_fraction", "time/generation_s",
                "throughput/generated_tokens_per_s", "tokens/generated"):
        assert key in logged, f"{key} not logged"
    fractions = [r["useful_token_fraction"] for r in trainer.state.log_history if "useful_token_fraction" in r]
    assert all(0.0 <= f <= 1.0 for f in fractions)


def test_accepts_plain_trl_config(toy_model_path, small_train_dataset, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to="none", bf16=False,
                      gradient_checkpointing=False, disable_tqdm=True)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=small_train_dataset)
    assert isinstance(trainer.args, GRPOVariantConfig)
    assert trainer.args.loss_type == "dapo" and trainer.args.per_device_train_batch_size == 8
    trainer.train()


def test_no_variant_keeps_trl_defaults():
    args = GRPOVariantConfig(output_dir="x", report_to="none")
    # stock TRL defaults to bf16=True, which a CUDA-less machine rejects; ours resolves it to False there
    trl_args = GRPOConfig(output_dir="x", report_to="none", bf16=torch.cuda.is_available())
    for name in ("loss_type", "beta", "epsilon", "scale_rewards", "importance_sampling_level", "num_generations",
                 "max_completion_length", "learning_rate"):
        assert getattr(args, name) == getattr(trl_args, name), name
    assert args.resolved_aggregation == "token_mean"  # TRL's default loss_type is "dapo"
    if not torch.cuda.is_available():
        assert args.bf16 is False and args.gradient_checkpointing is False


def test_missing_prompt_column(toy_model_path, make_args):
    bad = toy.make_dataset(n=8).rename_column("prompt", "question")
    with pytest.raises(DatasetError, match="'prompt' column") as err:
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=make_args(), train_dataset=bad)
    assert "question" in str(err.value)  # names what it found


def test_empty_dataset(toy_model_path, make_args):
    empty = toy.make_dataset(n=0)
    with pytest.raises(DatasetError, match="empty"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=make_args(), train_dataset=empty)


def test_unknown_variant():
    with pytest.raises(UnknownVariantError, match="Unknown variant 'ppo-max'. Registered variants: .*grpo"):
        get_variant("ppo-max")


def test_unknown_reward(toy_model_path, small_train_dataset, make_args):
    with pytest.raises(UnknownRewardError, match="Unknown reward 'acuracy'.*toy_accuracy"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=["acuracy"], args=make_args(),
                           train_dataset=small_train_dataset)


def test_model_path_does_not_exist(small_train_dataset, make_args, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelPathError, match="does not exist"):
        GRPOVariantTrainer(model=str(missing), reward_funcs="toy_accuracy", args=make_args(),
                           train_dataset=small_train_dataset)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="no config.json"):
        GRPOVariantTrainer(model=str(tmp_path / "empty"), reward_funcs="toy_accuracy", args=make_args(),
                           train_dataset=small_train_dataset)


def test_reward_weight_count_mismatch(toy_model_path, small_train_dataset, make_args):
    with pytest.raises(ConfigError, match=r"Number of reward weights \(3\) must match number of reward functions \(1\).*reward_weights"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                           args=make_args(reward_weights=[1.0, 1.0, 1.0]), train_dataset=small_train_dataset)
