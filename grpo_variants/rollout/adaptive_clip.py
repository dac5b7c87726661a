"""An adaptive trust region for off-policy updates: clip bounds that follow the measured staleness.

Beyond any paper here (off by default); first written for µ-GRPO's stages, usable by every variant with
token-level ratios: ``adaptive_clip_target`` on :class:`~grpo_variants.GRPOVariantConfig`. At every
update (every micro-batch of the loss), the bounds are chosen from the current policy's token ratios
against the rollout's behaviour log-probs (:func:`grpo_variants.losses.adaptive_clip_bounds`) so that a
target fraction of the negative- (positive-) advantage tokens is low- (high-) clipped, clamped between
``[adaptive_clip_lower_min, adaptive_clip_lower_max]`` and ``[adaptive_clip_upper_min,
adaptive_clip_upper_max]`` (by default between PPO's [0.8, 1.2] and µ-GRPO's relaxed [0, 5]); logged as
``adaptive_clip/low`` and ``adaptive_clip/high``. With several processes each sets its bounds from its
own micro-batch.

Per update, not per rollout: at a rollout's first update the policy *is* the behaviour policy (every
ratio is 1), so bounds set once per rollout would see no staleness; the ratios drift with every update,
and the loss's own forward pass already has them (no extra forward). The base trainer's loss calls
:func:`adapted_loss_spec` right after that forward and composes the loss with the returned copy of its
:class:`~grpo_variants.losses.LossSpec` (the trainer's own spec keeps the fixed bounds).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from grpo_variants.errors import ConfigError
from grpo_variants.losses import AdaptiveClipBounds, LossSpec, adaptive_clip_bounds

__all__ = ["adapted_loss_spec", "check_adaptive_clip_fields", "check_adaptive_clip_composition"]

logger = logging.getLogger(__name__)


def check_adaptive_clip_fields(config) -> None:
    """The target and the ranges (before TRL's ``__post_init__``)."""
    target = config.adaptive_clip_target
    if target is None:
        return
    if not (isinstance(target, (int, float)) and 0.0 < target < 0.5):
        raise ConfigError(
            f"adaptive_clip_target must be None (off) or a clipped-token fraction in (0, 0.5), e.g. 0.02; "
            f"got {target!r}."
        )
    (lo_min, lo_max), (up_min, up_max) = config.adaptive_clip_ranges
    if not 0.0 <= lo_min <= lo_max < 1.0:
        raise ConfigError(
            f"adaptive clip lower range must satisfy 0 <= adaptive_clip_lower_min <= adaptive_clip_lower_max < 1; "
            f"got [{lo_min}, {lo_max}] (e.g. [0, 0.8])."
        )
    if not 1.0 < up_min <= up_max:
        raise ConfigError(
            f"adaptive clip upper range must satisfy 1 < adaptive_clip_upper_min <= adaptive_clip_upper_max; "
            f"got [{up_min}, {up_max}] (e.g. [1.2, 5])."
        )


def check_adaptive_clip_composition(config) -> None:
    """Token ratios and a ratio cap above the widest bound (after TRL's ``__post_init__``); announce the override."""
    if config.adaptive_clip_target is None:
        return
    if config.resolved_ratio_level != "token":
        raise ConfigError(
            f"adaptive_clip_target sets token clip bounds from token ratios, but the ratio level is "
            f"{config.resolved_ratio_level!r} (importance_sampling_level). Use importance_sampling_level='token' "
            "or adaptive_clip_target=None."
        )
    if config.delta is not None and not config.delta > config.adaptive_clip_upper_max:
        raise ConfigError(
            f"delta ({config.delta}) must exceed adaptive_clip_upper_max ({config.adaptive_clip_upper_max}), the "
            "widest upper clip bound the adaptive trust region may choose. Raise delta or lower the maximum."
        )
    (lo_min, lo_max), (up_min, up_max) = config.adaptive_clip_ranges
    logger.warning(
        "%s: adaptive_clip_target=%g replaces the fixed clip bounds: lower in [%g, %g], upper in [%g, %g], "
        "re-chosen at every update from the current ratios.",
        config.variant or "grpo-variants", config.adaptive_clip_target, lo_min, lo_max, up_min, up_max,
    )


def adapted_loss_spec(
    spec: LossSpec, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config,
) -> tuple[LossSpec, AdaptiveClipBounds]:
    """A copy of ``spec`` whose clip widths are the bounds chosen for this update's ratios, and the bounds."""
    ratio = torch.exp(logps.detach() - old_logps)
    lower_range, upper_range = config.adaptive_clip_ranges
    bounds = adaptive_clip_bounds(ratio, advantages, mask, config.adaptive_clip_target, lower_range, upper_range)
    return dataclasses.replace(spec, eps_low=1.0 - bounds.lower, eps_high=bounds.upper - 1.0), bounds
