"""GSPO — Group Sequence Policy Optimization (Zheng et al., Qwen team, 2025, arXiv:2507.18071).

What it changes relative to GRPO (``docs/algorithms.md``, "GSPO"):

* ratio: one importance ratio per sequence, the geometric mean of the token ratios,
  s_i = exp( sum_t M log r_{i,t} / sum_t M ), clipped at the sequence level;
* clip widths four orders smaller than GRPO's: eps_low = 3e-4, eps_high = 4e-4 (GSPO clips about
  100x more tokens than GRPO and still learns faster; aimed at MoE stability);
* aggregation: per-sequence loss averaged over the batch (seq-mean-token-mean), no KL (beta = 0);
* each rollout batch is split into 4 mini-batches, i.e. 4 optimizer updates per rollout
  (``mini_batches_per_rollout=4``, see below): with one update per rollout s_i = 1 and GSPO's
  clipping never acts.

GSPO-token (``gspo_token``) uses s_{i,t} = sg(s_i) * pi_theta(t) / sg(pi_theta(t)): the same value
as s_i, the gradient flowing per token, so that per-token advantages can be used; with one
advantage per sequence it equals GSPO exactly.

Pitfall enforced here: a sequence ratio combined with a token-sum aggregation (token_mean,
constant, ...) weights each sequence by its length; GSPO therefore rejects every aggregation other
than the per-sequence mean with :class:`~grpo_variants.errors.ConfigError`.

Mini-batches. TRL's ``steps_per_generation`` counts *micro*-steps per rollout; one optimizer update
consumes ``gradient_accumulation_steps`` of them. ``mini_batches_per_rollout=k`` therefore sets
``steps_per_generation = k * gradient_accumulation_steps`` (the rollout holds k optimizer batches)
unless ``steps_per_generation`` or ``generation_batch_size`` is given explicitly, which wins.
``mini_batches_per_rollout=None`` keeps TRL's default (one update per rollout).

Besides TRL's token-weighted clip fractions (``clip_ratio/*_mean``, the paper's "fraction of
clipped tokens"), the trainer logs the fraction of *sequences* clipped: ``clip_ratio/seq_low_mean``,
``clip_ratio/seq_high_mean`` and ``clip_ratio/seq_region_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer


@dataclass
class GSPOConfig(GRPOVariantConfig):
    """The GSPO defaults (sequence ratio, clip 3e-4 / 4e-4, per-sequence mean, 4 mini-batches per rollout)."""

    variant: str | None = field(default="gspo")
    importance_sampling_level: str = field(default="sequence")
    ratio_level: str | None = field(default="sequence")
    loss_type: str = field(default="grpo")
    aggregation: str | None = field(default="seq_mean_token_mean")
    scale_rewards: str = field(default="group")
    epsilon: float = field(default=3e-4)
    epsilon_high: float | None = field(default=4e-4)
    beta: float = field(default=0.0)
    mini_batches_per_rollout: int | None = field(default=4)  # updates per rollout (base config field)

    required_ratio_level = "sequence"  # class attribute, not a field

    def _validate_variant_fields(self) -> None:
        super()._validate_variant_fields()
        if self.resolved_aggregation != "seq_mean_token_mean":
            raise ConfigError(
                f"{self.variant or 'gspo'} needs the per-sequence mean (aggregation='seq_mean_token_mean'); got "
                f"aggregation={self.aggregation!r} (loss_type={self.loss_type!r}). A sequence ratio with a token-sum "
                "aggregation weights each sequence by its length (docs/algorithms.md, GSPO)."
            )
        if self.resolved_ratio_level != self.required_ratio_level:
            raise ConfigError(
                f"{self.variant or 'gspo'} uses ratio_level={self.required_ratio_level!r}; got "
                f"ratio_level={self.resolved_ratio_level!r}. Use the 'gspo' variant for the sequence ratio and "
                "'gspo_token' for the sequence-token ratio."
            )


@dataclass
class GSPOTokenConfig(GSPOConfig):
    """GSPO-token: the sequence-token ratio sg(s_i) * pi(t) / sg(pi(t)), otherwise GSPO."""

    variant: str | None = field(default="gspo_token")
    ratio_level: str | None = field(default="sequence_token")

    required_ratio_level = "sequence_token"


@register_variant(
    "gspo",
    description="GSPO: sequence-level (geometric-mean) ratio and clipping, eps 3e-4/4e-4, per-sequence mean, no KL",
    paper="arXiv:2507.18071",
)
class GSPOTrainer(GRPOVariantTrainer):
    """GSPO; see the module docstring. Adds sequence-level clip fractions to the logged metrics."""

    config_class = GSPOConfig

    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        super()._log_loss_metrics(mode, stats, entropies, mask, inputs)
        low, high = stats["is_low_clipped"], stats["is_high_clipped"]
        metrics = self._metrics[mode]
        metrics["clip_ratio/seq_low_mean"].append(self._global_sequence_fraction(low, mask))
        metrics["clip_ratio/seq_high_mean"].append(self._global_sequence_fraction(high, mask))
        metrics["clip_ratio/seq_region_mean"].append(self._global_sequence_fraction(low | high, mask))


@register_variant(
    "gspo_token",
    description="GSPO-token: GSPO with the sequence-token ratio sg(s_i)*pi(t)/sg(pi(t)) (per-token advantages)",
    paper="arXiv:2507.18071",
)
class GSPOTokenTrainer(GSPOTrainer):
    """GSPO-token; see the module docstring."""

    config_class = GSPOTokenConfig
