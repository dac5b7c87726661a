"""The worked example of docs/architecture.md (examples/leave_one_out.py) is short, registers, and trains.

Its defining change is checked by construction: with a reward that gives the completions of every
group the values 0, 1, ..., G-1, the trained advantages must be the leave-one-out ones,
G / (G - 1) times GRPO's group-mean advantages, at every rollout.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from grpo_variants import ConfigError, get_variant, registry

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "leave_one_out.py"
G = 4


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("leave_one_out_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    registry._VARIANTS.pop("loo_grpo", None)
    sys.modules.pop(spec.name, None)  # other tests see only the built-in variants


def test_the_example_is_under_100_lines():
    assert len(EXAMPLE.read_text(encoding="utf-8").splitlines()) < 100


def test_leave_one_out_advantages_by_hand(example):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(example.leave_one_out_advantages(rewards, 4), expected)
    with_nan = torch.tensor([1.0, float("nan"), 0.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(example.leave_one_out_advantages(with_nan, 3), torch.tensor([0.0] * 3 + [0.5, 0.5, -1.0]))
    with pytest.raises(ConfigError):
        example.leave_one_out_advantages(rewards, 1)


def _rank_in_group(prompts, completions, **kwargs):
    """0, 1, ..., G-1 within every group (TRL keeps a group's completions consecutive)."""
    return [float(i % G) for i in range(len(completions))]


def test_the_example_registers_and_trains_with_its_advantages(example, toy_model_path, small_train_dataset, make_args):
    spec = get_variant("loo_grpo")
    assert spec.trainer_cls is example.LeaveOneOutTrainer and spec.config_cls is example.LeaveOneOutConfig

    class Recording(example.LeaveOneOutTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self.seen.append((self.weighted_rewards().clone(), output["advantages"].clone()))
            return output

    args = make_args(example.LeaveOneOutConfig, per_device_train_batch_size=16, num_generations=G, max_steps=2,
                     reward_cache=False)  # the cache would give identical completions of a group one value
    trainer = Recording(model=toy_model_path, reward_funcs=[_rank_in_group], args=args,
                        train_dataset=small_train_dataset)
    trainer.seen = []
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    result = trainer.train()

    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters()), "nothing trained"
    assert len(trainer.seen) == 2
    ranks = torch.arange(G, dtype=torch.float32).repeat(16 // G)
    group_mean = ranks - (G - 1) / 2  # what GRPO without std division (TRL's scale_rewards="none") gives
    for rewards, advantages in trainer.seen:
        torch.testing.assert_close(rewards.cpu(), ranks)
        torch.testing.assert_close(advantages.cpu(), group_mean * G / (G - 1))
        assert not torch.allclose(advantages.cpu(), group_mean)  # the defining change took effect


def test_the_example_refuses_kl_in_reward(example, toy_model_path, small_train_dataset, make_args):
    args = make_args(example.LeaveOneOutConfig, beta=0.04, kl_in_reward=True)
    with pytest.raises(ConfigError, match="kl_in_reward"):
        example.LeaveOneOutTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                   train_dataset=small_train_dataset)
