"""DAPO: the group filter, dynamic sampling (single and two processes), overlong shaping and filtering.

Run as a script (``torchrun --nproc_per_node 2 tests/test_dapo.py --ddp-worker OUT MODEL``) it is the
worker of the two-process test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import force_completions
from grpo_variants import ConfigError, DynamicSamplingError, get_variant, toy
from grpo_variants.rewards.builtin import overlong_penalty_value
from grpo_variants.variants.dapo import DAPOConfig, DAPOTrainer, select_groups

NAN = float("nan")
ONE_UPDATE = dict(mini_batches_per_rollout=None)  # one optimizer update per rollout (DAPO's default is 16)


# ------------------------------------------------------------------------------------------------
# The pure group filter
# ------------------------------------------------------------------------------------------------
def test_select_groups_nonzero_std():
    values = torch.tensor([
        1.0, 1.0, 1.0, 1.0,  # all correct: dropped
        -1.0, -1.0, -1.0, -1.0,  # all wrong: dropped
        1.0, -1.0, -1.0, -1.0,  # kept
        0.5, 0.5, 0.5, 0.50001,  # not all equal: kept
        NAN, 1.0, NAN, NAN,  # one scorable value: dropped
        NAN, 1.0, NAN, 0.0,  # two different scorable values: kept
        NAN, NAN, NAN, NAN,  # nothing scorable: dropped
        2.0, 2.0, NAN, 2.0,  # scorable values equal: dropped
    ])
    keep = select_groups(values, 4)
    assert keep.tolist() == [False, False, True, True, False, True, False, False]


def test_select_groups_band_pass():
    # group accuracies with the +1/-1 reward and threshold 0: 0, 1/4, 2/4, 3/4, 1, 1/3 (NaN ignored), none
    values = torch.tensor([
        -1.0, -1.0, -1.0, -1.0,
        1.0, -1.0, -1.0, -1.0,
        1.0, 1.0, -1.0, -1.0,
        1.0, 1.0, 1.0, -1.0,
        1.0, 1.0, 1.0, 1.0,
        1.0, -1.0, NAN, -1.0,
        NAN, NAN, NAN, NAN,
    ])
    keep = select_groups(values, 4, mode="band", band=(0.25, 0.5))
    assert keep.tolist() == [False, True, True, False, False, True, False]
    keep = select_groups(values, 4, mode="band", band=(0.5, 1.0))
    assert keep.tolist() == [False, False, True, True, True, False, False]
    # band edges are inclusive; a 0/1 reward with threshold 0.5 gives the same accuracies
    zero_one = torch.where(values > 0, 1.0, torch.where(torch.isnan(values), NAN, 0.0))
    keep = select_groups(zero_one, 4, mode="band", band=(0.75, 0.75), correct_threshold=0.5)
    assert keep.tolist() == [False, False, False, True, False, False, False]
    with pytest.raises(ValueError, match="multiple of group_size"):
        select_groups(torch.zeros(6), 4)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    spec = get_variant("dapo")
    assert spec.trainer_cls is DAPOTrainer and spec.config_cls is DAPOConfig
    args = DAPOConfig(output_dir=str(tmp_path), report_to="none", max_completion_length=20480)
    assert (args.epsilon, args.epsilon_high, args.beta, args.clip_ratio_c) == (0.2, 0.28, 0.0, 10.0)
    assert args.loss_type == "dapo" and args.resolved_aggregation == "token_mean"
    assert args.mask_truncated_completions and args.dynamic_sampling and args.max_num_gen_batches == 10
    assert args.overlong_penalty and args.resolved_overlong_buffer_len == 4096  # the paper's L_cache
    with pytest.raises(ConfigError, match="max_num_gen_batches"):
        DAPOConfig(output_dir=str(tmp_path), report_to="none", max_num_gen_batches=-1)
    with pytest.raises(ConfigError, match="keeps every group"):
        DAPOConfig(output_dir=str(tmp_path), report_to="none", dynamic_sampling_filter="band")
    with pytest.raises(ConfigError, match="dynamic_sampling_filter"):
        DAPOConfig(output_dir=str(tmp_path), report_to="none", dynamic_sampling_filter="bandpass")
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        DAPOConfig(output_dir=str(tmp_path), report_to="none", max_completion_length=64, overlong_buffer_len=65)


def test_construction_errors(toy_model_path, small_train_dataset, make_args):
    with pytest.raises(ConfigError, match="dynamic_sampling_metric='acc'"):
        DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1",
                    args=make_args(DAPOConfig, **ONE_UPDATE, dynamic_sampling_metric="acc"),
                    train_dataset=small_train_dataset)
    with pytest.raises(ConfigError, match="map-style"):
        DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1", args=make_args(DAPOConfig, **ONE_UPDATE),
                    train_dataset=small_train_dataset.to_iterable_dataset())
    with pytest.raises(ConfigError, match="a second time"):
        DAPOTrainer(model=toy_model_path, reward_funcs=["toy_accuracy_pm1", "dapo_overlong"],
                    args=make_args(DAPOConfig, **ONE_UPDATE), train_dataset=small_train_dataset)


# ------------------------------------------------------------------------------------------------
# Dynamic sampling, one process
# ------------------------------------------------------------------------------------------------
class _Recorder:
    """Wraps a trainer's methods to record what reaches the loss and how often it generates."""

    def __init__(self, trainer):
        self.loss_inputs, self.generate_calls, self.rollouts, self.generated_tokens = [], 0, [], 0
        compute_loss, generate, rollout = trainer._compute_loss, trainer._generate, trainer._dynamic_sampling_rollout

        def _compute_loss(model, inputs):
            self.loss_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return compute_loss(model, inputs)

        def _generate(prompts):
            self.generate_calls += 1
            result = generate(prompts)
            self.generated_tokens += sum(len(ids) for ids in result[1])
            return result

        def _rollout(inputs):
            out = rollout(inputs)
            self.rollouts.append((out, trainer.last_dynamic_sampling))
            return out

        trainer._compute_loss, trainer._generate, trainer._dynamic_sampling_rollout = _compute_loss, _generate, _rollout


def odd_operand_reward(prompts, completions, **kwargs):
    """Constant for an even first operand (the group is dropped); otherwise 0, 1, 0, 1 by position in the call
    (the group is kept). Which groups qualify depends on the seeded prompt stream only, not on what was sampled."""
    return [0.0 if _first_operand(p) % 2 == 0 else float(i % 2) for i, p in enumerate(prompts)]


def test_dynamic_sampling_filters_and_fills_the_batch(toy_model_path, small_train_dataset, make_args):
    # 8 completions per micro-batch, 2 micro-batches per generation: 16 completions = 4 groups of 4 per rollout
    args = make_args(DAPOConfig, **ONE_UPDATE, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                     max_steps=2, overlong_penalty=False, max_num_gen_batches=0)
    trainer = DAPOTrainer(model=toy_model_path, reward_funcs=odd_operand_reward, args=args,
                          train_dataset=small_train_dataset)
    rec = _Recorder(trainer)
    trainer.train()

    assert len(rec.rollouts) == 2 and len(rec.loss_inputs) == 4
    for out, info in rec.rollouts:
        # exactly the requested batch: 4 groups, 16 rows, every group with non-equal rewards
        assert out["completion_ids"].size(0) == args.generation_batch_size == 16
        assert info.groups_needed == 4 and len(info.group_ids) == 4 and info.values.shape == (4, 4)
        assert bool((info.values.amax(dim=1) > info.values.amin(dim=1)).all())
        # the first round: the loader's 4 groups plus the top-up predicted from the running pass rate (none before
        # any history); later rounds: top-ups sized to the deficit
        assert info.groups_kept <= info.groups_generated == sum(info.round_groups)
        assert len(info.round_groups) == info.rounds
        assert info.round_groups[0] >= 4 and info.topup_groups == info.groups_generated - 4
        assert len(set(info.group_ids)) == 4
        # num_items_in_batch is the loss-mask token count of the final batch
        assert int(out["num_items_in_batch"]) == int(out["completion_mask"].sum())
    for inputs in rec.loss_inputs:
        assert inputs["completion_ids"].size(0) == 8 == inputs["advantages"].size(0)
        # binary reward: a group with non-equal rewards gives every member a non-zero advantage
        assert bool((inputs["advantages"].abs() > 1e-6).all()), "a zero-variance group reached the loss"
    # ... while the rollouts did generate zero-variance groups (every prompt with an even first operand)
    dropped = sum(info.groups_generated - info.groups_kept for _, info in rec.rollouts)
    assert dropped > 0, "no group was ever dropped: the test would not see a broken filter"
    assert rec.generate_calls == sum(info.rounds for _, info in rec.rollouts)
    logged = [r for r in trainer.state.log_history if "dynamic_sampling/pass_rate" in r]
    assert logged
    for record in logged:
        for name in ("groups_generated", "groups_kept", "generation_rounds", "pass_rate"):
            assert f"dynamic_sampling/{name}" in record
        assert record["dynamic_sampling/pass_rate"] == pytest.approx(
            record["dynamic_sampling/groups_kept"] / record["dynamic_sampling/groups_generated"])
        assert 0.0 < record["useful_token_fraction"] <= 1.0 and 0.0 < record["tokens/kept_fraction"] <= 1.0
    # dropped groups' tokens are charged: every generated token counts, not only those of the final batches
    kept_tokens = sum(int(inputs["generated_mask"].sum()) for inputs in rec.loss_inputs)
    assert trainer._tokens_generated_total == rec.generated_tokens > kept_tokens
    state = trainer.variant_state_dict()
    assert state["dynamic_sampling_rounds_total"] == rec.generate_calls
    stream = (state["dynamic_sampling_stream_epoch"], state["dynamic_sampling_stream_chunk"])
    assert stream == (0, sum(i.rounds - 1 + (i.round_groups[0] > 4) for _, i in rec.rollouts))


def test_retry_cap_raises_clear_error(toy_model_path, small_train_dataset, make_args):
    def constant_reward(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    trainer = DAPOTrainer(model=toy_model_path, reward_funcs=constant_reward,
                          args=make_args(DAPOConfig, **ONE_UPDATE, max_num_gen_batches=3),
                          train_dataset=small_train_dataset)
    rec = _Recorder(trainer)
    with pytest.raises(DynamicSamplingError) as err:
        trainer.train()
    message = str(err.value)
    assert "found only 0 qualifying groups of the 4" in message
    assert "max_num_gen_batches=3" in message and "12 groups generated" in message
    assert "raise max_num_gen_batches" in message and "band-pass" in message
    assert rec.generate_calls == 3


def test_surplus_groups_are_cut_keeping_the_first(toy_model_path, small_train_dataset, make_args):
    def always_varies(prompts, completions, **kwargs):  # every group qualifies: round 1 fills the batch
        return [float(i % 2) for i in range(len(completions))]

    args = make_args(DAPOConfig, **ONE_UPDATE, max_steps=1, dynamic_sampling_surplus="discard")
    trainer = DAPOTrainer(model=toy_model_path, reward_funcs=always_varies, args=args,
                          train_dataset=small_train_dataset)
    rec = _Recorder(trainer)
    trainer.train()
    (_, info), = rec.rollouts
    assert info.rounds == 1 and rec.generate_calls == 1
    assert info.group_ids == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_prompt_stream_resumes_exactly(toy_model_path, make_args):
    # 13 prompts, 4 groups per round: 3 rounds per epoch (one prompt left over), so 7 draws cross two epochs
    data = toy.make_dataset(n=13)
    make = lambda: DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1",  # noqa: E731
                               args=make_args(DAPOConfig, **ONE_UPDATE),
                               train_dataset=data)

    def draw(trainer, n):
        out = []
        for _ in range(n):
            batch = trainer._draw_prompts()
            assert len(batch) == 16
            prompts = [row["prompt"] for row in batch]
            assert all(prompts[i] == prompts[i - i % 4] for i in range(16))  # groups of 4 identical prompts
            out.append(prompts[::4])
        return out

    first = make()
    head = draw(first, 4)
    state = first.variant_state_dict()
    tail = draw(first, 3)
    assert (state["dynamic_sampling_stream_epoch"], state["dynamic_sampling_stream_chunk"]) == (1, 1)
    assert len(set(sum(head[:3], []))) == 12  # one epoch: 12 distinct prompts
    assert head[3] != head[0]  # a new permutation in the new epoch
    resumed = make()
    resumed.load_variant_state_dict(state)
    assert draw(resumed, 3) == tail
    assert draw(make(), 7) == head + tail  # deterministic from the seed


# ------------------------------------------------------------------------------------------------
# The paper's defaults make the clip act; surplus groups are carried; any variant can sample dynamically
# ------------------------------------------------------------------------------------------------
def test_default_dapo_clips_at_the_upper_bound(toy_model_path, small_train_dataset, tmp_path):
    """DAPOConfig() as shipped: 16 samples per prompt, 16 updates per rollout, clip-higher 0.28.

    Only toy-scale fields are set (6 new tokens, lr 1e-3: the 1M-parameter toy policy needs a larger lr than the
    paper's 1e-6 for 32B to move in 16 updates). By construction: the first update of a rollout is on-policy
    (ratio 1, nothing clipped) and every later one is off-policy because the rollout feeds 16 updates.
    """
    args = DAPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_completion_length=6,
                      learning_rate=1e-3, max_steps=16, logging_steps=1, save_strategy="no", disable_tqdm=True,
                      seed=0)
    assert (args.num_generations, args.mini_batches_per_rollout) == (16, 16)
    assert args.steps_per_generation == 16 * args.gradient_accumulation_steps
    trainer = DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1", args=args,
                          train_dataset=small_train_dataset)
    rec = _Recorder(trainer)
    trainer.train()
    assert len(rec.rollouts) == 1  # one rollout, 16 updates on it
    records = [r for r in trainer.state.log_history if "clip_ratio/high_mean" in r]
    assert len(records) == 16
    assert records[0]["clip_ratio/region_mean"] == 0.0  # on-policy first update
    assert max(r["clip_ratio/high_mean"] for r in records[1:]) > 0.0


def _three_of_four_groups_vary(prompts, completions, **kwargs):
    """Groups 0-2 of every 16-row call alternate 0/1 (qualify); group 3 is constant (dropped)."""
    return [0.0 if i % 16 >= 12 else float(i % 2) for i in range(len(completions))]


def test_surplus_groups_are_carried_with_their_behaviour_logprobs(toy_model_path, small_train_dataset, make_args):
    # grpo (not DAPO) with dynamic sampling on, on-policy (one update per rollout): 3 of 4 groups qualify per round
    spec = get_variant("grpo")
    # whole-batch top-ups (verl's rounds), so that a round's surplus is large enough to carry several groups
    args = make_args(spec.config_cls, max_steps=3, dynamic_sampling=True, reward_cache=False,
                     dynamic_sampling_topup="full")
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=_three_of_four_groups_vary, args=args,
                               train_dataset=small_train_dataset)
    batches, carried = [], []

    def on_batch(batch, info):
        batches.append((batch, info))
        carried.append(None if trainer._ds_carried is None else {k: v.clone() for k, v in trainer._ds_carried.items()})

    trainer._on_dynamic_sampling_batch = on_batch
    at_loss, compute_loss = [], trainer._compute_loss

    def _compute_loss(model, inputs):
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            width = inputs["completion_ids"].size(1)
            logps = trainer._get_per_token_logps_and_entropies(model, ids, attention, width)[0]
        at_loss.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}, logps))
        return compute_loss(model, inputs)

    trainer._compute_loss = _compute_loss
    done, on_done = [], trainer._on_rollout_done

    def _on_rollout_done():
        generated = trainer._tokens_generated_round
        on_done()
        done.append((generated, trainer._kept_fraction))

    trainer._on_rollout_done = _on_rollout_done
    trainer.train()
    infos = [info for _, info in batches]
    # tokens/kept_fraction credits kept tokens to the rollout that generated them: its own rows of the batch plus
    # the surplus it carries out, not the rows carried in from the previous rollout
    assert len(done) == len(batches) == 3
    for (batch, info), out, (generated, kept) in zip(batches, carried, done, strict=True):
        own = int(batch["generated_mask"][4 * info.groups_carried_in:].sum())
        carried_out = 0 if out is None else int(out["generated_mask"].sum())
        assert kept == pytest.approx((own + carried_out) / generated)
    # needed 4: 3 + 3 -> carry 2; 2 + 3 -> carry 1; 1 + 3 -> carry 0
    assert [i.rounds for i in infos] == [2, 1, 1]
    assert [i.groups_carried_in for i in infos] == [0, 2, 1]
    assert [i.groups_carried_out for i in infos] == [2, 1, 0]
    for info in infos:  # nothing that qualified is thrown away
        assert info.groups_kept == info.groups_needed - info.groups_carried_in + info.groups_carried_out
        assert info.group_ids[: info.groups_carried_in] == [(-1, g) for g in range(info.groups_carried_in)]
    for k in (1, 2):  # batch k starts with exactly the rows carried out of batch k-1, behaviour log-probs included
        batch, info = batches[k]
        rows = 4 * info.groups_carried_in
        previous = carried[k - 1]
        for key in ("completion_ids", "advantages", "old_per_token_logps", "ref_per_token_logps"):
            width = previous[key].size(1) if previous[key].dim() > 1 else None
            got = batch[key][:rows] if width is None else batch[key][:rows, :width]
            assert torch.equal(got, previous[key]), key
    # at the loss (step 2): carried rows keep the older policy's log-probs (the ratio corrects for one update of
    # staleness); fresh rows of an on-policy step carry the current policy's
    inputs, current = at_loss[1]
    old, mask = inputs["old_per_token_logps"], inputs["completion_mask"].bool()
    previous = carried[0]["old_per_token_logps"]
    width = min(previous.size(1), old.size(1))
    is_carried = torch.tensor([any(torch.equal(row[:width], p[:width]) for p in previous) for row in old])
    assert int(is_carried.sum()) == 8  # 2 carried groups of 4 (TRL shuffles the rows before the micro-batches)
    fresh = ~is_carried
    torch.testing.assert_close(old[fresh][mask[fresh]], current[fresh][mask[fresh]], atol=2e-5, rtol=0)
    assert (old[is_carried][mask[is_carried]] - current[is_carried][mask[is_carried]]).abs().max() > 1e-4


def test_grpo_with_dynamic_sampling_resumes_exactly(toy_kit, tmp_path):
    """A checkpoint taken while groups are carried resumes with them: logs and weights equal the uninterrupted run."""
    from grpo_variants.lab import TOY_CONFIG

    spec = get_variant("grpo")
    data = toy_kit.train_dataset.select(range(64))

    def args(out):
        return spec.config_cls(**{**TOY_CONFIG, "output_dir": str(out), "per_device_train_batch_size": 16,
                                  "num_generations": 4, "max_steps": 4, "seed": 0, "save_strategy": "steps",
                                  "save_steps": 2, "dynamic_sampling": True, "reward_cache": False})

    first = spec.trainer_cls(model=toy_kit.model_path, reward_funcs=_three_of_four_groups_vary,
                             args=args(tmp_path / "a"), train_dataset=data)
    first.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    from grpo_variants.reliability import STATE_FILE

    saved = torch.load(ckpt / STATE_FILE.format(rank=0), weights_only=True)
    assert saved["variant"]["dynamic_sampling_carried"] is not None  # 1 group carried after step 2
    qualified, generated = saved["variant"]["dynamic_sampling_pass_counts"]  # the running pass rate the top-ups use
    assert 0 < qualified < generated
    assert saved["variant"]["token_ledger"]["dropped_by_filter"] > 0
    second = spec.trainer_cls(model=toy_kit.model_path, reward_funcs=_three_of_four_groups_vary,
                              args=args(tmp_path / "b"), train_dataset=data)
    second.train(resume_from_checkpoint=str(ckpt))
    def keep(record):  # logged values that do not measure time
        return {k: v for k, v in record.items() if "time" not in k and "per_s" not in k and not k.endswith("_s")}

    ref = [keep(r) for r in first.state.log_history if "loss" in r and r["step"] > 2]
    res = [keep(r) for r in second.state.log_history if "loss" in r and r["step"] > 2]
    assert res == ref and len(res) == 2
    assert all("dynamic_sampling/running_pass_rate" in r and "token_fate/useful" in r for r in res)
    assert second.token_ledger() == first.token_ledger()
    for (name, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------------------------------------
# Overlong shaping (eq. 13) and overlong filtering
# ------------------------------------------------------------------------------------------------
def test_overlong_penalty_is_added_and_applied(toy_model_path, small_train_dataset, make_args):
    args = make_args(DAPOConfig, **ONE_UPDATE, max_steps=1, dynamic_sampling=False, overlong_buffer_len=3,
                     reward_weights=[2.0])
    trainer = DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1", args=args,
                          train_dataset=small_train_dataset)
    # the k-th sample of each group is 2, 3, 5 or 6 tokens long (the last one truncated): both regions of eq. 13
    force_completions(trainer, lambda prompt, k: ["9</s>", "99</s>", "9999</s>", "999999"][k])
    assert trainer.reward_func_names == ["toy_accuracy_pm1", "overlong_penalty"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0] and args.reward_weights == [2.0]  # caller's config intact
    seen = {}
    calculate = trainer._calculate_rewards

    def _calculate_rewards(inputs, prompts, completions, completion_ids_list):
        seen["lengths"] = [len(ids) for ids in completion_ids_list]
        seen["rewards"] = calculate(inputs, prompts, completions, completion_ids_list)
        seen["weighted"] = trainer.weighted_rewards()
        return seen["rewards"]

    trainer._calculate_rewards = _calculate_rewards
    trainer.train()
    rewards = seen["rewards"]
    expected = [overlong_penalty_value(n, 6, 3) for n in seen["lengths"]]  # L_max = max_completion_length = 6
    assert rewards[:, 1].tolist() == pytest.approx(expected)
    assert any(v < 0 for v in expected) and any(v == 0 for v in expected), "one region of eq. 13 is untested"
    assert seen["weighted"].tolist() == pytest.approx((2.0 * rewards[:, 0] + rewards[:, 1]).tolist())
    # the three regions and both boundaries of eq. 13 at L_max=6, L_cache=3
    assert [overlong_penalty_value(n, 6, 3) for n in (2, 3, 4, 5, 6, 7)] == pytest.approx(
        [0.0, 0.0, -1 / 3, -2 / 3, -1.0, -1.0])


def test_truncated_completions_get_no_gradient(toy_model_path, small_train_dataset, make_args):
    # 3 new tokens: "82</s>" fits, "123</s>" is truncated
    args = make_args(DAPOConfig, **ONE_UPDATE, max_steps=1, max_completion_length=3, dynamic_sampling=False)
    trainer = DAPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy_pm1", args=args,
                          train_dataset=small_train_dataset)
    force_completions(trainer, lambda prompt, k: "12</s>" if k % 2 == 0 else "123")  # fits / cut off by construction
    rec = _Recorder(trainer)
    trainer.train()
    inputs = rec.loss_inputs[0]
    eos = trainer.processing_class.eos_token_id
    truncated = ~(inputs["completion_ids"] == eos).any(dim=1)
    assert truncated.any() and (~truncated).any()
    assert int(inputs["completion_mask"][truncated].sum()) == 0
    assert bool((inputs["completion_mask"][~truncated].sum(dim=1) > 0).all())

    def loss_and_grads(batch):
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    base_loss, base_grads = loss_and_grads(inputs)
    changed = dict(inputs)
    changed["advantages"] = torch.where(truncated, torch.full_like(inputs["advantages"], 100.0), inputs["advantages"])
    loss, grads = loss_and_grads(changed)
    assert torch.allclose(loss, base_loss) and all(torch.allclose(a, b) for a, b in zip(grads, base_grads))
    # control: the same change on a kept row does move the loss
    kept = dict(inputs)
    kept["advantages"] = torch.where(~truncated, inputs["advantages"] + 1.0, inputs["advantages"])
    assert not torch.allclose(loss_and_grads(kept)[0], base_loss)


# ------------------------------------------------------------------------------------------------
# Two processes: groups straddle ranks
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_operand(prompt: str) -> int:
    return int(prompt.split("+")[0].split("-")[0])


def parity_reward(prompts, completions, **kwargs):
    """Constant (dropped) for an even first operand; otherwise alternating 0 / 1 over the local rows, so that every
    such group varies even when it straddles the two ranks (groups of 4, 6 rows per rank): which groups qualify
    depends on the prompts only (the seeded data order), not on what the policy samples."""
    return [0.0 if _first_operand(p) % 2 == 0 else float(i % 2) for i, p in enumerate(prompts)]


@pytest.mark.slow
@pytest.mark.parametrize("topup", ["full", "pass_rate"])
def test_two_processes_keep_identical_groups(toy_model_path, tmp_path, topup):
    """``grpo`` with dynamic sampling on (the shared component), 2 processes over gloo, surplus groups carried;
    top-ups of a whole generation batch (verl) or sized from the running pass rate (groups straddling ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), __file__, "--ddp-worker", str(tmp_path), toy_model_path, topup]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rollouts"] and len(ranks[0]["rollouts"]) == len(ranks[1]["rollouts"]) == 4
    assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"]  # lock-step
    for r0, r1 in zip(ranks[0]["rollouts"], ranks[1]["rollouts"], strict=True):
        assert r0["global_prompts"] == r1["global_prompts"] and r0["group_ids"] == r1["group_ids"]
        assert len(r0["local_prompts"]) == len(r1["local_prompts"]) == 6  # equal local batch sizes
        assert r0["local_prompts"] + r1["local_prompts"] == r0["global_prompts"]  # contiguous re-slicing
        prompts = r0["global_prompts"]
        assert len(prompts) == 12
        for g in range(3):  # each group's 4 rows share their prompt, even when they came from both ranks
            assert len(set(prompts[4 * g : 4 * g + 4])) == 1
            assert _first_operand(prompts[4 * g]) % 2 == 1, "a constant-reward group was kept"
        assert all(len(set(v)) > 1 for v in r0["values"])
        assert r0["num_items"] == r1["num_items"] == r0["mask_tokens_0"] + r1["mask_tokens_0"]
    for r0, r1 in zip(ranks[0]["rollouts"], ranks[1]["rollouts"], strict=True):  # the carry is identical on both ranks
        assert (r0["carried_in"], r0["carried_out"]) == (r1["carried_in"], r1["carried_out"])
        assert r0["round_groups"] == r1["round_groups"]  # every round the same size on both ranks
        assert r0["kept"] == 3 - r0["carried_in"] + r0["carried_out"]  # nothing that qualified was thrown away
    for previous, current in zip(ranks[0]["rollouts"], ranks[0]["rollouts"][1:]):
        assert current["carried_in"] == previous["carried_out"]
    assert all(n == 6 for n in ranks[0]["loss_batch_sizes"] + ranks[1]["loss_batch_sizes"])
    # every generate call: the same number of prompts on both ranks, the round's groups split evenly
    sizes = [n for r in ranks[0]["rollouts"] for n in r["round_groups"]]
    assert ranks[0]["generate_sizes"] == ranks[1]["generate_sizes"] == [4 * n // 2 for n in sizes]
    if topup == "full":
        assert any(r["rounds"] > 1 for r in ranks[0]["rollouts"]), "never re-sampled: extra-prompt path untested"
        assert all(n == 3 for n in sizes)
        assert any(r["carried_in"] > 0 for r in ranks[0]["rollouts"]), "no group was carried: the carry is untested"
    else:
        from grpo_variants.rollout.sampling import topup_groups

        # each size is the rule's for the running rate the ranks agreed on (G = 4 on 2 ranks: any group count)
        assert ranks[0]["topups"] == ranks[1]["topups"]
        for call in ranks[0]["topups"]:
            rate = call["running"] if call["batch_rate"] is None else min(call["running"], call["batch_rate"])
            assert call["n"] == topup_groups(call["deficit"], rate, margin=1.0, min_groups=1, max_groups=3,
                                             already=call["already"])
        # some top-up was smaller than a generation batch: 4 * n rows, n < 3, split 2 * n per rank (a group of 4
        # straddles the ranks when n is odd)
        assert any(n < 3 for r in ranks[0]["rollouts"] for n in r["round_groups"][1:]) or \
            any(r["round_groups"][0] > 3 for r in ranks[0]["rollouts"]), "no sized top-up: the path is untested"


def _ddp_worker(out_dir: str, model_path: str, topup: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_args

    rank = int(os.environ["RANK"])
    spec = get_variant("grpo")
    args = tiny_args(spec.config_cls, output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=6,
                     num_generations=4, max_steps=4, max_num_gen_batches=0, dynamic_sampling=True,
                     reward_cache=False, dynamic_sampling_topup=topup)
    data = toy.make_dataset(n=240)

    class Worker(spec.trainer_cls):
        def _on_dynamic_sampling_batch(self, batch, info):
            texts = self.processing_class.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
            record = {"global_prompts": texts, "group_ids": info.group_ids, "rounds": info.rounds,
                      "values": info.values.tolist(), "carried_in": info.groups_carried_in,
                      "carried_out": info.groups_carried_out, "kept": info.groups_kept,
                      "round_groups": info.round_groups}
            log["rollouts"].append(record)

        def _local_slice(self, full, local):
            out = super()._local_slice(full, local)
            record = log["rollouts"][-1]
            record["local_prompts"] = self.processing_class.batch_decode(out["prompt_ids"], skip_special_tokens=True)
            record["num_items"] = int(out["num_items_in_batch"])
            record["mask_tokens_0"] = int(out["completion_mask"].sum())
            return out

        def _generate(self, prompts):
            log["generate_calls"] += 1
            log["generate_sizes"].append(len(prompts))
            return super()._generate(prompts)

        def _topup_size(self, deficit, already=0, batch_rate=None):
            n = super()._topup_size(deficit, already=already, batch_rate=batch_rate)
            log["topups"].append({"deficit": deficit, "already": already, "batch_rate": batch_rate,
                                  "running": self.running_pass_rate, "n": n})
            return n

        def _compute_loss(self, model, inputs):
            log["loss_batch_sizes"].append(int(inputs["completion_ids"].size(0)))
            return super()._compute_loss(model, inputs)

    log = {"rollouts": [], "generate_calls": 0, "loss_batch_sizes": [], "generate_sizes": [], "topups": []}
    trainer = Worker(model=model_path, reward_funcs=parity_reward, args=args, train_dataset=data)
    assert trainer.accelerator.num_processes == 2
    trainer.train()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(log))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--ddp-worker":
    _ddp_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    from conftest import exit_without_teardown

    exit_without_teardown()
