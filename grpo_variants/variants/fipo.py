"""FIPO — Future-KL Influenced Policy Optimization (arXiv:2603.19835).

What it changes relative to DAPO (``docs/algorithms.md``, "FIPO"): each token's advantage is
re-weighted by how much the policy has already moved on the tokens that follow it.

* delta_t = clamp(log pi_theta - log pi_old, -20, 20); M'_t excludes tokens with delta_t > log c;
* FutureKL_t = sum_{k >= t} gamma^(k-t) M'_k delta_k with gamma = 2^(-1/tau), tau = 32;
* f_t = sg(clip(exp(FutureKL_t), 1.0, 1.2)) (upward only, as in the paper's launcher;
  ``fipo_clip_low=0.8`` gives the symmetric [0.8, 1.2] option); safety: where A < 0 and r > 10,
  f_t is clamped to [0.8, 1.0];
* A_t = A f_t feeds a dual-clip PPO surrogate (eps 0.2 / 0.28, c = 10) with token-mean
  aggregation; a response with more than one negative-advantage token in the dual-clip regime is
  dropped from the loss;
* otherwise DAPO (:class:`~grpo_variants.variants.dapo.DAPOConfig` is the parent, so its dynamic
  sampling, overlong reward shaping and overlong filtering come along), no KL (beta = 0), with the
  recipe's 16 samples per prompt, lr 1e-6 after 20 warm-up steps and weight decay 0.1.

FIPO is only active off-policy. On-policy pi_old = pi_theta, so delta = 0, f = 1 and FIPO reduces
to DAPO with dual clip. The weights become non-trivial when one rollout feeds several optimizer
updates, as in the paper's recipe (512 prompts per rollout, mini-batches of 32 prompts: 16 updates
per rollout). ``mini_batches_per_rollout=16`` (the default) sets ``steps_per_generation = 16 x
gradient_accumulation_steps``, so every update after the first of a rollout sees a moved policy;
an explicit ``steps_per_generation`` / ``generation_batch_size`` wins. A configuration that is
on-policy throughout (TRL then skips pi_old) triggers a warning.

Logged metrics: ``fipo/weight_mean``, ``fipo/weight_max`` (base trainer),
``clip_ratio/dual_mean`` and ``fipo/dropped_fraction`` (responses dropped by the dual-clip rule).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


from grpo_variants.errors import ConfigError
from grpo_variants.registry import register_variant
from grpo_variants.variants.dapo import DAPOConfig, DAPOTrainer


@dataclass
class FIPOConfig(DAPOConfig):
    """The FIPO defaults: DAPO (clip 0.2/0.28, token-mean, no KL, dynamic sampling, overlong shaping and
    filtering) plus future-KL weights, dual clip c = 10 with the response drop, 16 updates per rollout."""

    variant: str | None = field(default="fipo")
    # DAPO's loss settings, restated so that the paper's values read here whatever DAPOConfig's defaults
    loss_type: str = field(default="dapo")
    aggregation: str | None = field(default="token_mean")
    epsilon: float = field(default=0.2)
    epsilon_high: float | None = field(default=0.28)
    beta: float = field(default=0.0)
    mask_truncated_completions: bool = field(default=True)
    # the DAPO / FIPO recipe's optimisation settings
    num_generations: int | None = field(default=16)
    learning_rate: float = field(default=1e-6)
    lr_scheduler_type: str = field(default="constant_with_warmup")
    warmup_steps: float = field(default=20)
    weight_decay: float = field(default=0.1)
    # FIPO
    clip_ratio_c: float | None = field(default=10.0)
    fipo: bool = field(default=True)
    fipo_tau: float = field(default=32.0)
    fipo_c: float = field(default=10.0)
    fipo_clip_low: float = field(default=1.0)
    fipo_clip_high: float = field(default=1.2)
    fipo_safety_ratio: float = field(default=10.0)
    fipo_drop_multi_dual_clip: bool = field(default=True)
    mini_batches_per_rollout: int | None = field(default=16)  # updates per rollout (base config field)

    def _validate_variant_fields(self) -> None:
        super()._validate_variant_fields()
        if not self.fipo:
            raise ConfigError("The fipo variant needs fipo=True; without the future-KL weights use the 'dapo' variant.")
        if self.fipo_drop_multi_dual_clip and self.clip_ratio_c is None:
            raise ConfigError(
                "fipo_drop_multi_dual_clip=True drops responses by the dual-clip rule, which needs clip_ratio_c "
                "(FIPO uses 10). Set clip_ratio_c or fipo_drop_multi_dual_clip=False."
            )
        if self.resolved_ratio_level != "token":
            raise ConfigError(
                f"FIPO weights per-token advantages against the token ratio; got ratio_level="
                f"{self.resolved_ratio_level!r}. Use ratio_level='token'."
            )
        if self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) == 0:
            warnings.warn(
                f"FIPO is on-policy here (steps_per_generation={self.steps_per_generation}, num_iterations="
                f"{self.num_iterations}, gradient_accumulation_steps={self.gradient_accumulation_steps}): pi_old = "
                "pi_theta, so every future-KL weight is 1 and FIPO reduces to DAPO with dual clip. Use "
                "mini_batches_per_rollout > 1 (the paper: 16) or num_iterations > 1.",
                stacklevel=3,
            )


@register_variant(
    "fipo",
    description="FIPO: future-KL weighted advantages, dual clip c=10 with response drop, on DAPO's settings",
    paper="arXiv:2603.19835",
)
class FIPOTrainer(DAPOTrainer):
    """FIPO; see the module docstring. Adds ``fipo/dropped_fraction`` to the logged metrics."""

    config_class = FIPOConfig

    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        super()._log_loss_metrics(mode, stats, entropies, mask, inputs)
        if "fipo_dropped" not in stats:
            return
        self._metrics[mode]["fipo/dropped_fraction"].append(self._global_sequence_fraction(stats["fipo_dropped"], mask))
