"""TRL's semantics by default: reward functions see exactly TRL's batch, and nothing times out.

The wrapper every reward goes through (``RobustReward``) must not change what a reward function
receives: the same completions in the same order, duplicates included, the same per-sample
columns, one call per batch, as ``trl.GRPOTrainer`` makes it. A group-level reward (one that looks
at the other completions of the batch) must therefore return the same values under our trainer as
under TRL's.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer
from grpo_variants.errors import RewardFunctionError
from grpo_variants.rewards.robust import RobustReward

COMMON = dict(
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=4,
    learning_rate=1e-4,
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
    seed=0,
    save_strategy="no",
    logging_steps=1,
    max_steps=2,
    steps_per_generation=1,
)


def _recorder():
    calls = []

    def diversity(prompts, completions, completion_ids=None, answer=None, **kwargs):
        """Group-level: the fraction of distinct completions in the whole call (depends on the batch)."""
        calls.append({"prompts": list(prompts), "completions": list(completions), "answer": list(answer)})
        return [len(set(completions)) / len(completions)] * len(completions)

    return diversity, calls


def test_default_wrapper_passes_the_batch_untouched():
    seen = []

    def reward(prompts, completions, completion_ids=None, **kwargs):
        seen.append((list(prompts), list(completions), [list(c) for c in completion_ids], kwargs["answer"]))
        return [float(len(set(completions)))] * len(completions)

    r = RobustReward(reward)
    comps = ["a", "a", "b", "a"]  # duplicates, by construction
    out = r(prompts=["p", "p", "q", "p"], completions=comps, completion_ids=[[1], [1], [2], [1]], answer=list("wxyz"))
    assert seen == [(["p", "p", "q", "p"], comps, [[1], [1], [2], [1]], list("wxyz"))]
    assert out == [2.0] * 4  # the group-level value is computed on the whole batch
    assert r.pop_metrics()["cache_hit_rate"] == 0.0
    assert r.timeout is None and r.cache_duplicates is False  # TRL: no time limit, no deduplication

    def short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="returned 1 rewards for 4 completions"):
        RobustReward(short)(prompts=["p"] * 4, completions=comps)


def test_default_config_has_trl_reward_semantics():
    args = GRPOVariantConfig(output_dir="unused", report_to="none")
    assert args.reward_timeout is None and args.reward_cache is False


def test_slow_call_warns_while_it_runs_and_is_not_stopped(caplog):
    def slow(prompts, completions, **kwargs):
        time.sleep(0.6)
        return [1.0] * len(completions)

    r = RobustReward(slow, warn_after=0.2)
    with caplog.at_level(logging.WARNING, logger="grpo_variants.rewards.robust"):
        assert r(prompts=["p"] * 3, completions=["a", "b", "c"]) == [1.0, 1.0, 1.0]
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("slow" in m and "still running" in m and "batch of 3" in m for m in messages), messages


def test_reward_sees_trl_batch_and_group_reward_equals_trl(tmp_path, toy_model_path, small_train_dataset):
    ours_fn, ours_calls = _recorder()
    trl_fn, trl_calls = _recorder()
    ours = GRPOVariantTrainer(
        model=toy_model_path, reward_funcs=ours_fn, train_dataset=small_train_dataset,
        # TRL's padded forward and recomputed log-probs: the second rollout then samples from bit-identical weights
        args=GRPOVariantConfig(output_dir=str(tmp_path / "ours"), behaviour_logprobs="recompute", padding_free=False,
                               **COMMON),
    )
    stock = GRPOTrainer(
        model=toy_model_path, reward_funcs=trl_fn, train_dataset=small_train_dataset,
        args=GRPOConfig(output_dir=str(tmp_path / "trl"), **COMMON),
    )
    set_seed(0)
    ours.train()
    set_seed(0)
    stock.train()
    assert len(trl_calls) == 2 and all(len(c["completions"]) == 16 for c in trl_calls)
    assert ours_calls == trl_calls  # same batches, same order, duplicates and columns included
    ours_logged = [r["rewards/diversity/mean"] for r in ours.state.log_history if "rewards/diversity/mean" in r]
    trl_logged = [r["rewards/diversity/mean"] for r in stock.state.log_history if "rewards/diversity/mean" in r]
    assert len(ours_logged) == 2
    torch.testing.assert_close(torch.tensor(ours_logged), torch.tensor(trl_logged))


def test_mu_grpo_smoke_run_sizes_its_stage(caplog):
    """max_steps below one default stage: the stage is sized to the run (announced); explicit fields stay."""
    from grpo_variants.variants.mu_grpo import MuGRPOConfig

    with caplog.at_level(logging.WARNING, logger="grpo_variants.variants.mu_grpo"):
        c = MuGRPOConfig(output_dir="unused", report_to="none", max_steps=2, per_device_train_batch_size=64)
    assert c.updates_per_stage == 2 and c.stage_prompts * c.num_generations == 64  # one mini-batch, reused twice
    assert c.num_iterations == 2 and c.generation_batch_size == 64
    assert any("sizing the stage to the run" in r.getMessage() for r in caplog.records)
    explicit = MuGRPOConfig(output_dir="unused", report_to="none", max_steps=2, per_device_train_batch_size=64,
                            stage_prompts=16, updates_per_stage=4)
    assert (explicit.stage_prompts, explicit.updates_per_stage) == (16, 4)
    full = MuGRPOConfig(output_dir="unused", report_to="none", max_steps=4096)
    assert (full.stage_prompts, full.updates_per_stage) == (1024, 1024)


def test_toy_conversational_kit_is_warm_started_in_the_chat_template():
    """prepare(conversational=True): chat-format prompts and a policy warm-started on them (own cache entry)."""
    from grpo_variants.tasks import toy

    plain = toy.prepare(verbose=False)
    chat = toy.prepare(conversational=True, verbose=False)
    assert chat.model_path != plain.model_path and chat.warmstart["config"]["conversational"] is True
    assert chat.eval_dataset[0]["prompt"] == [{"role": "user", "content": chat.eval_dataset[0]["prompt"][0]["content"]}]
    # the band (20-45% on held-back probe problems, measured in the chat format) puts it well above the
    # near-zero accuracy a plain-format policy has on chat prompts
    assert toy.evaluate(chat.model_path, chat.eval_dataset.select(range(200))) >= 0.10
