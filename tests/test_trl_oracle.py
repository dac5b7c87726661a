"""TRL 1.16 as the oracle: our composed loss equals ``trl.GRPOTrainer._compute_loss`` exactly.

For identical inputs (same weights, same batch, same old/ref log-probs and advantages) the loss
and every parameter gradient of GRPO (seq-mean-token-mean), BNPO, Dr.GRPO, DAPO (token-mean over
the optimisation batch) and GSPO (sequence ratio) must match TRL to 1e-6, including with gradient
accumulation > 1 and steps_per_generation > 1, with and without the KL term. A full short training
run must also follow the same trajectory as TRL's trainer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, toy

CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
}
COMMON = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=6,
    learning_rate=1e-4,
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
    seed=0,
    save_strategy="no",
    logging_steps=1,
)


def _reward(prompts, completions, **kwargs):
    # deterministic and varied: advantages are non-zero
    return [float(len(c) % 3) for c in completions]


def _pair(tmp_path, model_path, dataset, case, behaviour_logprobs="recompute", padding_free=False, **extra):
    """Our trainer and stock TRL on the same config. Ours recomputes the behaviour log-probs with TRL's
    forward pass and runs TRL's padded forward unless told otherwise (recording the log-probs in generate, and
    the packed forward that padding_free="auto" picks for the toy model, agree with TRL only to rounding)."""
    values = {**COMMON, **CASES[case], **extra}
    ours = GRPOVariantTrainer(
        model=model_path,
        reward_funcs=_reward,
        args=GRPOVariantConfig(output_dir=str(tmp_path / "ours"), behaviour_logprobs=behaviour_logprobs,
                               padding_free=padding_free, **values),
        train_dataset=dataset,
    )
    stock = GRPOTrainer(
        model=model_path,
        reward_funcs=_reward,
        args=GRPOConfig(output_dir=str(tmp_path / "trl"), **values),
        train_dataset=dataset,
    )
    for trainer in (ours, stock):  # set by Trainer.train(); the loss reads it
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return ours, stock


def _perturbed_inputs(trainer, dataset, seed=0):
    """A real rollout from our trainer, made off-policy (old log-probs != current) so clipping matters."""
    trainer.model.train()
    batch = [dataset[i] for i in range(trainer.args.per_device_train_batch_size)]
    torch.manual_seed(seed)
    inputs = trainer._generate_and_score_completions(batch)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logits = trainer.model(input_ids=ids, attention_mask=att).logits[:, :-1]
        logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        logps = logps[:, -inputs["completion_ids"].size(1) :]
    noise = 0.3 * torch.randn(logps.shape, generator=gen)
    inputs["old_per_token_logps"] = logps + noise
    inputs["ref_per_token_logps"] = logps - 0.2 * torch.randn(logps.shape, generator=gen)
    inputs["advantages"] = torch.randn(logps.size(0), generator=gen)
    inputs.pop("generated_mask", None)
    return inputs


def _loss_and_grads(trainer, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"gradient_accumulation_steps": 2, "steps_per_generation": 4},
        {"beta": 0.04},
        {"beta": 0.04, "use_bias_correction_kl": False, "gradient_accumulation_steps": 3},
    ],
    ids=["plain", "ga2_spg4", "kl", "kl_nocorr_ga3"],
)
def test_loss_and_gradients_equal_trl(tmp_path, toy_model_path, small_train_dataset, case, extra):
    ours, stock = _pair(tmp_path, toy_model_path, small_train_dataset, case, **extra)
    assert ours.loss_spec is not None  # we compose this loss ourselves
    inputs = _perturbed_inputs(ours, small_train_dataset)
    stock.model.load_state_dict(ours.model.state_dict())
    stock.model.train()
    ours_loss, ours_grads = _loss_and_grads(ours, ours.model, inputs)
    trl_loss, trl_grads = _loss_and_grads(stock, stock.model, copy.copy(inputs))
    torch.testing.assert_close(ours_loss, trl_loss, atol=1e-6, rtol=1e-6)
    assert ours_grads.keys() == trl_grads.keys()
    for name in ours_grads:
        torch.testing.assert_close(ours_grads[name], trl_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # the metric names TRL logs for the clipped losses are logged by us too
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert ours._metrics["train"][key], key
    if extra.get("beta"):
        torch.testing.assert_close(
            torch.tensor(ours._metrics["train"]["kl"][-1]), torch.tensor(stock._metrics["train"]["kl"][-1])
        )


# loss_type="dapo" normalises by each update's tokens (docs/algorithms.md); TRL by the rollout's. They are the
# same normaliser when one rollout feeds one update (steps_per_generation == gradient_accumulation_steps); with
# 4 micro-batches per rollout and 2 per update ours differs on purpose and says so at start
# (tests/test_trl_contract.py checks the per-update value and the announcement).
TRAJECTORY_STEPS_PER_GENERATION = {"grpo": 4, "dapo": 2}


@pytest.mark.parametrize("case", ["grpo", "dapo"])
def test_training_trajectory_equals_trl(tmp_path, toy_model_path, small_train_dataset, case):
    """Three real optimizer steps (sampling, rewards, loss, AdamW) give the same losses and weights as TRL."""
    ours, stock = _pair(tmp_path, toy_model_path, small_train_dataset, case, max_steps=3,
                        gradient_accumulation_steps=2, steps_per_generation=TRAJECTORY_STEPS_PER_GENERATION[case])
    from transformers import set_seed

    set_seed(0)  # the sampling RNG stream must start from the same state for both trainers
    ours.train()
    set_seed(0)
    stock.train()
    ours_losses = [r["loss"] for r in ours.state.log_history if "loss" in r]
    trl_losses = [r["loss"] for r in stock.state.log_history if "loss" in r]
    assert len(ours_losses) == 3
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(trl_losses), atol=1e-6, rtol=1e-5)
    for (name, a), (_, b) in zip(ours.model.named_parameters(), stock.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_default_padding_free_tracks_trl(tmp_path, toy_model_path, small_train_dataset):
    """With our defaults (padding_free="auto" packs the toy model) three real optimizer steps stay within
    rounding of stock TRL's padded trajectory; padding_free=False above is TRL's to 1e-6."""
    ours, stock = _pair(tmp_path, toy_model_path, small_train_dataset, "grpo", padding_free="auto", max_steps=3,
                        gradient_accumulation_steps=2, steps_per_generation=4)
    assert ours.args.padding_free is True
    from transformers import set_seed

    set_seed(0)
    ours.train()
    set_seed(0)
    stock.train()
    assert any("padding_free/slot_ratio" in r for r in ours.state.log_history)
    ours_losses = [r["loss"] for r in ours.state.log_history if "loss" in r]
    trl_losses = [r["loss"] for r in stock.state.log_history if "loss" in r]
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(trl_losses), atol=1e-5, rtol=1e-4)
    worst = max((a - b).abs().max().item() for a, b in zip(ours.model.parameters(), stock.model.parameters()))
    assert worst < 1e-4, worst


def test_recorded_behaviour_logprobs_track_trl(tmp_path, toy_model_path, small_train_dataset):
    """With the behaviour log-probs recorded in generate (the default in float32), TRL's forward pass is
    skipped; the trajectory stays within rounding of stock TRL's (ratios differ by ~1e-6)."""
    ours, stock = _pair(tmp_path, toy_model_path, small_train_dataset, "grpo", behaviour_logprobs="auto",
                        max_steps=3, gradient_accumulation_steps=2, steps_per_generation=4)
    from transformers import set_seed

    set_seed(0)
    ours.train()
    set_seed(0)
    stock.train()
    assert [r.get("rollout_logprobs/recorded") for r in ours.state.log_history if "loss" in r][:1] == [1.0]
    ours_losses = [r["loss"] for r in ours.state.log_history if "loss" in r]
    trl_losses = [r["loss"] for r in stock.state.log_history if "loss" in r]
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(trl_losses), atol=1e-5, rtol=1e-4)
    worst = max((a - b).abs().max().item() for a, b in zip(ours.model.parameters(), stock.model.parameters()))
    assert worst < 1e-4, worst
