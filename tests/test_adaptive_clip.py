"""The adaptive trust region of µ-GRPO (``adaptive_clip_target``): the pure bound rule on hand-built
ratios, its config checks, and the bounds in force inside real trainer steps."""

from __future__ import annotations

import pytest
import torch

import grpo_variants.trainer as base_trainer
from grpo_variants import ConfigError, MuGRPOConfig, MuGRPOTrainer
from grpo_variants.losses import adaptive_clip_bounds, clipped_surrogate

STAGE = dict(stage_prompts=8, updates_per_stage=4)


def _distinct(n: int, low: float, high: float, seed: int) -> torch.Tensor:
    """n distinct values spread evenly over [low, high], in a shuffled order."""
    values = torch.linspace(low, high, n)
    return values[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


# ---- the pure rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [0.01, 0.05, 0.1, 0.25, 0.49])
@pytest.mark.parametrize("n_neg,n_pos", [(200, 160), (37, 91)])
def test_clipped_fraction_equals_target_within_one_token(target, n_neg, n_pos):
    ratio = torch.cat([_distinct(n_neg, 0.01, 0.79, 0), _distinct(n_pos, 1.21, 4.99, 1)]).view(1, -1)
    adv = torch.cat([torch.full((n_neg,), -1.0), torch.full((n_pos,), 2.0)]).view(1, -1)
    mask = torch.ones_like(ratio)
    b = adaptive_clip_bounds(ratio, adv, mask, target)
    assert (b.negative_tokens, b.positive_tokens) == (n_neg, n_pos)
    # The bounds are inside the default ranges here (every ratio is), so nothing was clamped.
    assert 0.0 <= b.lower <= 0.8 and 1.2 <= b.upper <= 5.0
    neg, pos = ratio[adv < 0], ratio[adv > 0]
    assert abs(int((neg < b.lower).sum()) - target * n_neg) <= 1
    assert abs(int((pos > b.upper).sum()) - target * n_pos) <= 1
    # ... and the PPO surrogate with these bounds clips exactly those tokens (bounds excluded).
    sur = clipped_surrogate(ratio, adv, 1.0 - b.lower, b.upper - 1.0)
    assert abs(int(sur.is_low_clipped.sum()) - target * n_neg) <= 1
    assert abs(int(sur.is_high_clipped.sum()) - target * n_pos) <= 1


def test_bounds_respect_floors_and_ceilings():
    adv = torch.tensor([[-1.0] * 50 + [1.0] * 50])
    mask = torch.ones(1, 100)
    # Fresh stage: every ratio is 1 -> the tightest bounds of the ranges.
    fresh = adaptive_clip_bounds(torch.ones(1, 100), adv, mask, 0.05)
    assert (fresh.lower, fresh.upper) == (0.8, 1.2)
    fresh = adaptive_clip_bounds(torch.ones(1, 100), adv, mask, 0.05, (0.1, 0.7), (1.5, 3.0))
    assert (fresh.lower, fresh.upper) == (0.7, 1.5)
    # Very stale: tiny A<0 ratios, huge A>0 ratios -> the widest bounds allowed.
    stale = torch.cat([_distinct(50, 1e-6, 1e-3, 2), _distinct(50, 100.0, 200.0, 3)]).view(1, -1)
    wide = adaptive_clip_bounds(stale, adv, mask, 0.05, (0.1, 0.7), (1.5, 3.0))
    assert (wide.lower, wide.upper) == (0.1, 3.0)
    # Unclamped in the default ranges on the low side (0 is the floor), clamped to 5 on the high side.
    default = adaptive_clip_bounds(stale, adv, mask, 0.05)
    assert 1e-6 <= default.lower <= 1e-3 and default.upper == 5.0


def test_masked_and_zero_advantage_tokens_are_ignored():
    ratio = torch.cat([_distinct(40, 0.05, 0.75, 4), _distinct(40, 1.3, 4.0, 5)]).view(2, 40)
    adv = torch.tensor([[-1.0], [1.0]])
    mask = torch.ones(2, 40)
    reference = adaptive_clip_bounds(ratio, adv, mask, 0.1)
    # Append padded positions with extreme ratios (mask 0) and a zero-advantage row: same bounds.
    padded = torch.cat([ratio, torch.tensor([[1e-9] * 10, [1e9] * 10])], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(2, 10)], dim=1)
    extra_row = torch.cat([torch.full((1, 40), 1e-9), torch.full((1, 10), 1e9)], dim=1)
    padded = torch.cat([padded, extra_row])
    padded_mask = torch.cat([padded_mask, torch.ones(1, 50)])
    padded_adv = torch.tensor([[-1.0], [1.0], [0.0]])
    assert adaptive_clip_bounds(padded, padded_adv, padded_mask, 0.1) == reference
    # A side without tokens gets its tightest bound.
    only_neg = adaptive_clip_bounds(ratio[:1], adv[:1], mask[:1], 0.1)
    assert only_neg.upper == 1.2 and only_neg.positive_tokens == 0 and only_neg.lower == reference.lower


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(target=0.0), r"target must lie in \(0, 0.5\)"),
        (dict(target=0.5), r"target must lie in \(0, 0.5\)"),
        (dict(target=0.1, lower_range=(0.5, 0.2)), r"lower range"),
        (dict(target=0.1, upper_range=(1.0, 2.0)), r"upper range"),
    ],
)
def test_rule_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        adaptive_clip_bounds(torch.ones(1, 4), torch.ones(1), torch.ones(1, 4), **kwargs)


# ---- config ---------------------------------------------------------------------------------------
def test_off_by_default(make_args):
    args = make_args(MuGRPOConfig, **STAGE)
    assert args.adaptive_clip_target is None
    assert args.adaptive_clip_ranges == ((0.0, 0.8), (1.2, 5.0))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(adaptive_clip_target=0.0), r"adaptive_clip_target must be None \(off\) or a clipped-token fraction"),
        (dict(adaptive_clip_target=0.7), r"adaptive_clip_target must be None \(off\) or a clipped-token fraction"),
        (dict(adaptive_clip_target=0.05, adaptive_clip_lower_max=1.0), r"adaptive_clip_lower_max < 1"),
        (dict(adaptive_clip_target=0.05, adaptive_clip_lower_min=0.9), r"adaptive_clip_lower_min <= adaptive_clip"),
        (dict(adaptive_clip_target=0.05, adaptive_clip_upper_min=1.0), r"1 < adaptive_clip_upper_min"),
        (dict(adaptive_clip_target=0.05, adaptive_clip_upper_max=1.1), r"adaptive_clip_upper_min <= adaptive_clip"),
        (dict(adaptive_clip_target=0.05, importance_sampling_level="sequence"), r"ratio level is 'sequence'"),
        (dict(adaptive_clip_target=0.05, delta=4.0), r"delta \(4.0\) must exceed adaptive_clip_upper_max \(5.0\)"),
    ],
)
def test_config_errors(make_args, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_args(MuGRPOConfig, **STAGE, **overrides)


# ---- in real trainer steps ------------------------------------------------------------------------
class _SpreadRatios(MuGRPOTrainer):
    """Shifts the stored behaviour log-probs by distinct offsets in [-1.5, 1.5]: a known spread of ratios."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        old = out["old_per_token_logps"]
        offsets = torch.linspace(-1.5, 1.5, old.numel())
        offsets = offsets[torch.randperm(old.numel(), generator=torch.Generator().manual_seed(0))]
        out["old_per_token_logps"] = old + offsets.view_as(old)
        return out


def _capture(monkeypatch):
    captured = []
    original = base_trainer.compute_policy_loss

    def capture(spec, logp, old_logp, advantages, mask, **kwargs):
        captured.append(dict(eps=(spec.eps_low, spec.eps_high), logp=logp.detach(), old=old_logp,
                             adv=advantages, mask=mask, out=original(spec, logp, old_logp, advantages, mask, **kwargs)))
        return captured[-1]["out"]

    monkeypatch.setattr(base_trainer, "compute_policy_loss", capture)
    return captured


def test_bounds_in_force_in_trainer_steps(toy_model_path, small_train_dataset, make_args, monkeypatch):
    captured = _capture(monkeypatch)
    target = 0.1
    args = make_args(MuGRPOConfig, max_steps=4, adaptive_clip_target=target, **STAGE)
    trainer = _SpreadRatios(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                            train_dataset=small_train_dataset)
    trainer.train()
    low = [r["adaptive_clip/low"] for r in trainer.state.log_history if "adaptive_clip/low" in r]
    high = [r["adaptive_clip/high"] for r in trainer.state.log_history if "adaptive_clip/high" in r]
    assert len(captured) == len(low) == len(high) == 4  # one bound pair per update, logged
    for call, lo, hi in zip(captured, low, high, strict=True):
        ratio = torch.exp(call["logp"] - call["old"])
        expected = adaptive_clip_bounds(ratio, call["adv"], call["mask"], target)
        # The loss ran with exactly the bounds the rule gives for this update's own ratios, and logged them.
        assert call["eps"] == (1.0 - expected.lower, expected.upper - 1.0)
        assert (lo, hi) == pytest.approx((expected.lower, expected.upper))
        assert 0.0 <= lo <= 0.8 and 1.2 <= hi <= 5.0
        # Where a bound is inside its range, the surrogate low-/high-clipped target of that side's tokens.
        stats, mask, adv = call["out"].stats, call["mask"] > 0, call["adv"].view(-1, 1).expand_as(call["mask"])
        if 0.0 < expected.lower < 0.8:
            n = int((mask & (adv < 0)).sum())
            assert abs(int((stats["is_low_clipped"] & mask).sum()) - target * n) <= 1
        if 1.2 < expected.upper < 5.0:
            n = int((mask & (adv > 0)).sum())
            assert abs(int((stats["is_high_clipped"] & mask).sum()) - target * n) <= 1
    # The fixed bounds are back once each loss is computed.
    assert (trainer.loss_spec.eps_low, trainer.loss_spec.eps_high) == (1.0, 4.0)


def test_short_toy_run_logs_bounds(toy_model_path, small_train_dataset, make_args):
    args = make_args(MuGRPOConfig, max_steps=4, adaptive_clip_target=0.05, **STAGE)
    trainer = MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                            train_dataset=small_train_dataset)
    trainer.train()
    low = [r["adaptive_clip/low"] for r in trainer.state.log_history if "adaptive_clip/low" in r]
    high = [r["adaptive_clip/high"] for r in trainer.state.log_history if "adaptive_clip/high" in r]
    assert len(low) == len(high) == 4
    assert all(0.0 <= x <= 0.8 for x in low) and all(1.2 <= x <= 5.0 for x in high)
    # The stage's first update: the policy is the behaviour policy (ratios 1 up to float noise) -> tightest.
    assert (low[0], high[0]) == pytest.approx((0.8, 1.2))


# ---- a component of every variant with token ratios -------------------------------------------------
def test_plain_grpo_composes_the_adaptive_trust_region(toy_model_path, small_train_dataset, make_args, monkeypatch):
    """GRPO (clip 0.2, no stage) with two updates per rollout: the bounds in force are the rule's, per update."""
    from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer

    captured = _capture(monkeypatch)
    args = make_args(GRPOVariantConfig, max_steps=2, num_iterations=2, adaptive_clip_target=0.1)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=small_train_dataset)
    trainer.train()
    assert len(captured) == 2
    for call in captured:
        expected = adaptive_clip_bounds(torch.exp(call["logp"] - call["old"]), call["adv"], call["mask"], 0.1)
        assert call["eps"] == (1.0 - expected.lower, expected.upper - 1.0)
    assert captured[0]["eps"] == pytest.approx((0.2, 0.2))  # first update: ratios 1 -> PPO's bounds
    assert (trainer.loss_spec.eps_low, trainer.loss_spec.eps_high) == (0.2, 0.2)  # the fixed bounds stay
    with pytest.raises(ConfigError, match="ratio level is 'sequence'"):
        make_args(GRPOVariantConfig, adaptive_clip_target=0.1, importance_sampling_level="sequence")
