"""Dr.GRPO — "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al., 2025, arXiv:2503.20783).

What it changes relative to GRPO (``docs/algorithms.md``, "Dr.GRPO"): it removes GRPO's two
optimisation biases.

* advantage: group mean only, A_i = R_i - mean_g R (no division by the group std, which up-weights
  too-easy and too-hard questions); TRL's ``scale_rewards="none"``;
* aggregation: a constant normaliser, sum_{i,t} M l / (num_sequences * L) with L =
  ``max_completion_length`` (no 1/|o_i|, which favours long wrong answers and short right ones);
  TRL's ``loss_type="dr_grpo"``;
* otherwise plain GRPO: token ratio, clip 0.2, beta = 0 (no KL), lr 1e-6 constant, 8 samples per question.

Both defining choices are enforced: a Dr.GRPO config with another advantage estimator or
aggregation raises :class:`~grpo_variants.errors.ConfigError` (compose such ablations with
:class:`~grpo_variants.GRPOVariantConfig` instead). Nothing is overridden in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer


@dataclass
class DrGRPOConfig(GRPOVariantConfig):
    """The Dr.GRPO defaults (group-mean advantage, constant normaliser L = max_completion_length)."""

    variant: str | None = field(default="dr_grpo")
    loss_type: str = field(default="dr_grpo")
    aggregation: str | None = field(default="constant")
    scale_rewards: str = field(default="none")
    advantage_estimator: str | None = field(default="group_mean")
    epsilon: float = field(default=0.2)
    beta: float = field(default=0.0)
    learning_rate: float = field(default=1e-6)
    lr_scheduler_type: str = field(default="constant")  # the paper's constant learning rate
    num_generations: int | None = field(default=8)

    def _validate_variant_fields(self) -> None:
        if self.advantage_estimator not in (None, "group_mean") or self.scale_rewards != "none":
            raise ConfigError(
                f"Dr.GRPO uses the group-mean advantage (advantage_estimator='group_mean', scale_rewards='none'); "
                f"got advantage_estimator={self.advantage_estimator!r}, scale_rewards={self.scale_rewards!r}. "
                "Leave both at their defaults, or use GRPOVariantConfig to compose another estimator."
            )
        super()._validate_variant_fields()
        if self.resolved_aggregation != "constant":
            raise ConfigError(
                f"Dr.GRPO normalises by the constant num_sequences * max_completion_length (aggregation='constant'); "
                f"got aggregation={self.aggregation!r} (loss_type={self.loss_type!r}). Leave aggregation at "
                "'constant', or use GRPOVariantConfig to compose another aggregation."
            )


@register_variant(
    "dr_grpo",
    description="Dr.GRPO: group-mean advantage (no std), constant normaliser L = max_completion_length, no KL",
    paper="arXiv:2503.20783",
)
class DrGRPOTrainer(GRPOVariantTrainer):
    """Dr.GRPO; see the module docstring."""

    config_class = DrGRPOConfig
