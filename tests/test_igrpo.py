"""iGRPO: best-draft selection, prompt rewriting, N + G generation budget, stage-2-only training,
single-shot evaluation, and a 2-process run where a group straddles ranks."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import position_reward
from grpo_variants import ConfigError, DatasetError, get_variant, toy
from grpo_variants.variants.igrpo import (
    DEFAULT_DRAFT_TEMPLATE,
    TOY_DRAFT_TEMPLATE,
    IGRPOConfig,
    IGRPOTrainer,
    draft_plan,
    draft_text,
    render_draft_prompt,
    select_best_drafts,
    validate_draft_template,
)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------
def test_select_best_drafts_highest_first_tie_and_nan():
    nan = float("nan")
    rewards = torch.tensor(
        [
            [0.0, 2.0, 1.0],  # clear winner: 1
            [1.0, 1.0, 1.0],  # all tied: first
            [0.5, 3.0, 3.0],  # tie at the top: first of the tied
            [nan, -5.0, nan],  # NaN ranks below any number, even negative
            [nan, nan, nan],  # nothing scored: draft 0
        ]
    )
    assert select_best_drafts(rewards.flatten(), 3).tolist() == [1, 0, 1, 1, 0]
    assert select_best_drafts(torch.tensor([1.0, 9.0]), 1).tolist() == [0, 0]


def test_render_draft_prompt_string_and_conversation():
    assert render_draft_prompt("37+45=", "82", TOY_DRAFT_TEMPLATE) == "37+45=(82)37+45="
    text = render_draft_prompt("Solve x.", "x = 2", DEFAULT_DRAFT_TEMPLATE)
    assert text.startswith("Solve x.") and "x = 2" in text
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
    ]
    original = json.loads(json.dumps(conversation))
    out = render_draft_prompt(conversation, "4", TOY_DRAFT_TEMPLATE)
    assert out[-1] == {"role": "user", "content": "2+2=(4)2+2="}  # last user message rewritten
    assert out[:3] == original[:3]
    assert conversation == original  # input untouched
    with pytest.raises(DatasetError, match="user message"):
        render_draft_prompt([{"role": "system", "content": "x"}], "d", TOY_DRAFT_TEMPLATE)
    assert draft_text([{"role": "assistant", "content": "82"}]) == "82"
    assert draft_text("82") == "82"


def test_template_validation():
    validate_draft_template("{prompt} / {draft} {{literal}}")
    for bad in ("{prompt}", "{draft}", "{prompt}{draft}{other}", "{prompt}{draft", "{0}{prompt}{draft}"):
        with pytest.raises(ConfigError, match="draft_template"):
            validate_draft_template(bad)
    with pytest.raises(ConfigError, match="draft_template"):
        IGRPOConfig(output_dir="x", report_to="none", draft_template="{prompt} only")


def test_draft_plan_splits_evenly_and_rejects_uneven_budgets():
    # 3 prompts x 4 drafts over 2 processes: 6 requests each, prompt-major and consecutive.
    assert draft_plan(3, 4, 2, 0) == [0, 0, 0, 0, 1, 1]
    assert draft_plan(3, 4, 2, 1) == [1, 1, 2, 2, 2, 2]
    assert draft_plan(1, 4, 2, 1) == [0, 0]  # one group, its drafts straddle the ranks
    with pytest.raises(ConfigError, match="N \\+ G budget inconsistent"):
        draft_plan(3, 3, 2, 0)


def test_config_defaults_and_registry():
    args = IGRPOConfig(output_dir="x", report_to="none")
    assert (args.num_drafts, args.num_generations, args.completions_per_prompt) == (4, 4, 8)
    assert args.beta == 0.0 and args.learning_rate == 1e-6 and args.lr_scheduler_type == "cosine"
    assert args.temperature == 0.7 and args.epsilon == args.epsilon_high == 0.2
    assert args.resolved_aggregation == "seq_mean_token_mean" and args.scale_rewards == "group"
    assert args.draft_template == DEFAULT_DRAFT_TEMPLATE
    spec = get_variant("igrpo")
    assert spec.trainer_cls is IGRPOTrainer and spec.config_cls is IGRPOConfig
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="N \\+ G budget inconsistent"):
            IGRPOConfig(output_dir="x", report_to="none", num_drafts=bad)


# ------------------------------------------------------------------------------------------------
# The trainer on the toy kit
# ------------------------------------------------------------------------------------------------
class LengthReward:
    """A deterministic reward we control: the completion's length in characters. Records every call."""

    __name__ = "length_reward"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **kwargs):
        scores = [float(len(draft_text(c))) for c in completions]
        self.calls.append((list(prompts), [draft_text(c) for c in completions], scores))
        return scores


def _prompt_key(prompt):
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _user_text(prompt):
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _igrpo_args(make_args, **overrides):
    values = dict(
        num_drafts=3,
        num_generations=4,
        per_device_train_batch_size=16,  # 4 prompts x 4 refinements per step, 12 drafts
        draft_template=TOY_DRAFT_TEMPLATE,
        temperature=1.0,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        reward_cache=False,  # the recording reward must see every completion
        max_steps=2,
    )
    values.update(overrides)
    return make_args(IGRPOConfig, **values)


@pytest.mark.parametrize("conversational", [False, True], ids=["string", "conversational"])
def test_refinement_prompts_hold_best_draft_and_only_stage2_is_trained(toy_model_path, make_args, conversational):
    dataset = toy.make_dataset(split="train", n=64, conversational=conversational)
    reward = LengthReward()
    trainer = IGRPOTrainer(
        model=toy_model_path, reward_funcs=reward, args=_igrpo_args(make_args), train_dataset=dataset
    )
    tokenizer = trainer.processing_class
    N, G = trainer.args.num_drafts, trainer.num_generations

    generate_calls = []  # (mode, prompts) for every call of TRL's _generate
    original_generate = trainer._generate

    def counting_generate(prompts):
        generate_calls.append(("train" if trainer.model.training else "eval", list(prompts)))
        return original_generate(prompts)

    loss_batches = []  # what reaches the loss: prompt texts and completion rows
    original_compute_loss = trainer._compute_loss

    def recording_compute_loss(model, inputs):
        prompts = tokenizer.batch_decode(inputs["prompt_ids"], skip_special_tokens=False)
        prompts = [p.replace(tokenizer.pad_token, "") for p in prompts]
        loss_batches.append((prompts, inputs["completion_ids"].size(0), inputs["advantages"].detach().clone()))
        return original_compute_loss(model, inputs)

    trainer._generate = counting_generate
    trainer._compute_loss = recording_compute_loss
    trainer.train()

    # Two reward calls per rollout: the drafts (U*N, original prompts), then the refinements (U*G, q').
    rollouts = trainer.state.global_step
    assert len(reward.calls) == 2 * rollouts
    for r in range(rollouts):
        draft_prompts, draft_texts, draft_scores = reward.calls[2 * r]
        refine_prompts, _, _ = reward.calls[2 * r + 1]
        unique = [draft_prompts[k] for k in range(0, len(draft_prompts), N)]
        assert len(unique) == 4 and len(draft_prompts) == 4 * N and len(refine_prompts) == 4 * G
        expected = {}
        for u, prompt in enumerate(unique):
            assert draft_prompts[u * N : (u + 1) * N] == [prompt] * N  # N drafts of the same original prompt
            scores = draft_scores[u * N : (u + 1) * N]
            best = scores.index(max(scores))  # highest reward, first on ties
            q_prime = render_draft_prompt(prompt, draft_texts[u * N + best], TOY_DRAFT_TEMPLATE)
            expected[_prompt_key(q_prime)] = G
        assert Counter(_prompt_key(p) for p in refine_prompts) == expected
        # The best draft really is in q' (not just an equal string by construction).
        for prompt in unique:
            q_prime = next(p for p in refine_prompts if _user_text(p).startswith(_user_text(prompt)))
            scores = draft_scores[unique.index(prompt) * N : (unique.index(prompt) + 1) * N]
            inserted = _user_text(q_prime)[len(_user_text(prompt)) + 1 : -len(_user_text(prompt)) - 1]
            candidates = draft_texts[unique.index(prompt) * N : (unique.index(prompt) + 1) * N]
            assert inserted in candidates and scores[candidates.index(inserted)] == max(scores)

    # N + G completions per prompt, counted through TRL's _generate: drafts first, then refinements.
    train_calls = [prompts for mode, prompts in generate_calls if mode == "train"]
    assert len(train_calls) == 2 * rollouts
    for r in range(rollouts):
        drafts, refinements = train_calls[2 * r], train_calls[2 * r + 1]
        per_original = Counter(_prompt_key(p) for p in drafts)
        assert set(per_original.values()) == {N} and len(per_original) == 4
        for prompt in per_original:
            n_refined = sum(_user_text(q).startswith(_user_text(json.loads(prompt) if conversational else prompt))
                            for q in refinements)
            assert per_original[prompt] + n_refined == N + G

    # Only stage-2 completions reach the loss: G rows per prompt, every prompt a rewritten q'.
    assert len(loss_batches) == rollouts  # steps_per_generation = 1
    for r, (prompts, rows, advantages) in enumerate(loss_batches):
        assert rows == 4 * G
        q_primes = {
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if conversational else p
            for p in reward.calls[2 * r + 1][0]
        }
        assert set(prompts) == q_primes and Counter(prompts) == Counter({q: G for q in q_primes})
        assert torch.isfinite(advantages).all()

    logged = {k for record in trainer.state.log_history for k in record}
    for key in ("igrpo/draft_reward_mean", "igrpo/best_draft_reward_mean", "igrpo/refined_reward_mean",
                "igrpo/refinement_gain", "igrpo/draft_token_fraction", "igrpo/draft_completions/mean_length"):
        assert key in logged, key


def test_toy_training_run_logs_metrics_and_charges_draft_tokens(toy_model_path, small_train_dataset, make_args):
    trainer = IGRPOTrainer(
        model=toy_model_path,
        # The toy policy rarely answers q' correctly (2-4%): position_reward gives every group distinct
        # rewards, so there is a policy gradient at every step by construction.
        reward_funcs=["toy_accuracy", position_reward],
        # Two micro-steps per rollout: the generation batch (8 prompts) is sliced after the rollout.
        args=_igrpo_args(make_args, num_drafts=4, max_steps=4, steps_per_generation=2, reward_cache=False,
                         reward_weights=[1.0, 0.1]),
        train_dataset=small_train_dataset,
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 4 and math.isfinite(result.training_loss)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters()), "no parameter changed"
    records = [r for r in trainer.state.log_history if "igrpo/draft_reward_mean" in r]
    assert len(records) == 2  # one per rollout
    # N = G = 4 completions per prompt, each 1 to L tokens long: the draft share of the generated tokens is
    # between N / (N + G L) (1-token drafts, L-token refinements) and N L / (N L + G), whatever was sampled.
    N, G, L = trainer.args.num_drafts, trainer.num_generations, trainer.args.max_completion_length
    for r in records:
        assert r["igrpo/draft_reward_mean"] <= r["igrpo/best_draft_reward_mean"]
        assert r["igrpo/refinement_gain"] == pytest.approx(
            r["igrpo/refined_reward_mean"] - r["igrpo/best_draft_reward_mean"], abs=1e-6
        )
        assert r["igrpo/refined_reward_mean"] == pytest.approx(r["reward"], abs=1e-6)  # TRL's reward = stage 2
        # Draft tokens are generated but never trained: the kept fraction is exactly the stage-2 share,
        # and the useful-token fraction (over every generated token) can be no larger.
        assert N / (N + G * L) - 1e-9 <= r["igrpo/draft_token_fraction"] <= N * L / (N * L + G) + 1e-9
        assert r["tokens/kept_fraction"] == pytest.approx(1.0 - r["igrpo/draft_token_fraction"], abs=1e-6)
        assert 0.0 <= r["useful_token_fraction"] <= r["tokens/kept_fraction"] + 1e-9


def test_evaluation_is_single_shot_from_the_original_prompt(toy_model_path, small_train_dataset, make_args):
    eval_dataset = toy.make_dataset(split="eval", n=4)
    trainer = IGRPOTrainer(
        model=toy_model_path,
        reward_funcs="toy_accuracy",
        args=_igrpo_args(make_args, per_device_eval_batch_size=8, max_steps=1),
        train_dataset=small_train_dataset,
        eval_dataset=eval_dataset,
    )
    calls = []
    original_generate = trainer._generate
    trainer._generate = lambda prompts: (calls.append(list(prompts)), original_generate(prompts))[1]
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and not any(k.startswith("eval_igrpo") for k in metrics)
    originals = set(eval_dataset["prompt"])
    assert calls and all(set(prompts) <= originals for prompts in calls)  # no drafts, no q'
    assert sum(len(p) for p in calls) == len(eval_dataset) * trainer.num_generations_eval


def test_rejects_custom_rollouts(toy_model_path, small_train_dataset, make_args):
    def rollout_func(prompts, trainer):  # pragma: no cover - never called
        raise AssertionError

    with pytest.raises(ConfigError, match="rollout_func"):
        IGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=_igrpo_args(make_args),
                     train_dataset=small_train_dataset, rollout_func=rollout_func)


# ------------------------------------------------------------------------------------------------
# Two CPU processes: one group of G = 4 rows straddles the ranks (2 rows each), its N = 4 drafts too
# ------------------------------------------------------------------------------------------------
_WORKER = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
import grpo_variants  # noqa: F401  (CPU distributed shim)
from grpo_variants.tasks import toy
from grpo_variants.variants.igrpo import IGRPOConfig, IGRPOTrainer, TOY_DRAFT_TEMPLATE

out_dir, model_path = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])


class FixedDraftsTrainer(IGRPOTrainer):
    """Real generation in lock-step on both ranks; samples then replaced by "<rank><index>" so that the
    best draft (reward = its integer value) lives on rank 1."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        tok = self.processing_class
        fixed = [tok(f"{rank}{i}")["input_ids"] + [tok.eos_token_id] for i in range(len(completion_ids))]
        return fixed, logprobs


calls = []


def value_reward(prompts, completions, **kwargs):
    calls.append((list(prompts), list(completions)))
    return [float(c) for c in completions]


args = IGRPOConfig(
    output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=2, num_generations=4, num_drafts=4,
    max_completion_length=4, max_steps=1, learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1,
    save_strategy="no", report_to="none", seed=0, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
    draft_template=TOY_DRAFT_TEMPLATE, reward_cache=False,
)
trainer = FixedDraftsTrainer(model=model_path, reward_funcs=value_reward, args=args,
                             train_dataset=toy.make_dataset(split="train", n=16))
result = trainer.train()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
  json.dump({
    "rank": rank,
    "world": trainer.accelerator.num_processes,
    "calls": calls,
    "selection": {k: v for k, v in trainer._last_draft_selection.items() if k != "rewards_per_func"},
    "loss": result.training_loss,
    "metrics": [r for r in trainer.state.log_history if "igrpo/best_draft_reward_mean" in r],
  }, handle)
sys.path.insert(0, os.environ["GRPO_TEST_DIR"])
from conftest import exit_without_teardown
exit_without_teardown()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_group_straddles_ranks(toy_model_path, tmp_path):
    worker = tmp_path / "igrpo_worker.py"
    worker.write_text(textwrap.dedent(_WORKER))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "GRPO_TEST_DIR": str(REPO / "tests")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(worker), str(tmp_path), toy_model_path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    # Stage 1: each rank drafted 2 of the group's 4 drafts; the best ("11", reward 11) is on rank 1.
    for r in ranks:
        draft_prompts, drafts = r["calls"][0]
        assert drafts == [f"{r['rank']}0", f"{r['rank']}1"] and len(set(draft_prompts)) == 1
    assert ranks[0]["calls"][0][0] == ranks[1]["calls"][0][0]  # the same (straddling) prompt on both ranks
    q = ranks[0]["calls"][0][0][0]
    for r in ranks:
        assert r["selection"]["drafts"] == ["00", "01", "10", "11"]  # gathered in global order
        assert r["selection"]["best_index"] == [3] and r["selection"]["best_draft"] == ["11"]
        # Stage 2: both local rows of each rank are refinements of q' = template(q, "11").
        refine_prompts, _ = r["calls"][1]
        assert refine_prompts == [TOY_DRAFT_TEMPLATE.format(prompt=q, draft="11")] * 2
        assert math.isfinite(r["loss"])
        assert r["metrics"][0]["igrpo/best_draft_reward_mean"] == pytest.approx(11.0)
        assert r["metrics"][0]["igrpo/draft_reward_mean"] == pytest.approx((0 + 1 + 10 + 11) / 4)
