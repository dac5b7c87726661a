"""GRPO — Group Relative Policy Optimization (DeepSeekMath, Shao et al., 2024, arXiv:2402.03300).

What it computes (``docs/algorithms.md``, "GRPO"):

* advantage: group-std, A_i = (R_i - mean_g R) / (std_g R + 1e-4);
* ratio: per token, r = pi_theta / pi_old, symmetric clip eps = 0.2;
* aggregation: seq-mean-token-mean, mean_i [ sum_t M l / sum_t M ];
* KL to a reference model, k3 estimator, beta = 0.04, added per token to the loss, without
  TRL's importance-ratio correction of the KL term (``use_bias_correction_kl=False``)
  (``kl_in_reward=True`` subtracts beta * sum_t KL_t from the reward instead);
* lr 1e-6, one policy update per exploration stage.

Nothing is overridden: the paper's GRPO is a configuration of the base trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer


@dataclass
class GRPOPaperConfig(GRPOVariantConfig):
    """The DeepSeekMath GRPO defaults."""

    variant: str | None = field(default="grpo")
    loss_type: str = field(default="grpo")
    scale_rewards: str = field(default="group")
    epsilon: float = field(default=0.2)
    beta: float = field(default=0.04)
    kl_estimator: str = field(default="k3")
    use_bias_correction_kl: bool = field(default=False)  # the paper's plain k3 term (TRL defaults to True)
    learning_rate: float = field(default=1e-6)


@register_variant(
    "grpo",
    description="DeepSeekMath GRPO: group-std advantage, clip 0.2, seq-mean-token-mean, k3 KL (beta 0.04)",
    paper="arXiv:2402.03300",
)
class GRPOPaperTrainer(GRPOVariantTrainer):
    """GRPO exactly as in DeepSeekMath; see the module docstring."""

    config_class = GRPOPaperConfig
