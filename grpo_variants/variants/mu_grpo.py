"""µ-GRPO — stage-based off-policy GRPO (Tian, Xie and Wei, "How Off-Policy Can GRPO Be? µ-GRPO for
Efficient LLM Reinforcement Learning", arXiv:2605.17570, May 2026; no public code).

µ = optimizer updates per rollout refresh. Training is a few large *stages* (the paper: 4 stages x
µ = 1,024 updates instead of 1,024 refreshes). A stage (``docs/algorithms.md``, "µ-GRPO"):

1. freeze the policy as the behaviour policy pi_behav;
2. sample G completions for each of ``stage_prompts`` prompts (in ``generation_chunk_prompts``
   chunks sized for memory), and store every response with its group-normalised advantage, its
   token-level behaviour log-probs and the policy version (global step) that produced it;
3. release the rollout engine's memory (gc, CUDA cache, colocated vLLM to sleep);
4. run µ optimizer updates on mini-batches of the stage buffer with r = pi_theta / pi_behav
   taken from the stored log-probs, using

   * relaxed clipping: ratio bounds [mu_clip_lower, mu_clip_upper] = [0, 5] (eps_low = 1,
     eps_high = 4); ``relaxed_clip=False`` keeps ``epsilon`` / ``epsilon_high`` ([0.8, 1.2]);
   * the negative-advantage veto (``veto_scope``, default H_kappa, threshold 1e-4), recomputed at
     every update from the current policy (the base trainer's loss applies it).

µ = 1 is exactly on-policy GRPO (ratio 1: no clipping, no veto trigger).

Steps 1-3 are the stage rollout component, :mod:`grpo_variants.rollout.stages` (any variant can set
``stage_prompts`` / ``updates_per_stage``): it maps the stage onto TRL's buffering, concatenates the
chunks, records the policy versions, resumes mid-stage and logs the stage timings and staleness (here
under ``mu_grpo/``). The behaviour log-probs are recorded while HF generate samples
(:mod:`grpo_variants.rollout.logprobs`; no second forward pass over the stage in float32). What this
file adds is the paper's: its defaults (1,024 prompts x µ = 1,024, lr 1e-6, no KL), the relaxed clip,
the veto, and two per-update diagnostics (``mu_grpo/neg_adv_ratio_mean``; with the veto off,
``veto/would_trigger_fraction``).

Beyond the paper (off by default), any variant with token ratios: ``adaptive_clip_target``, a trust
region whose bounds follow the measured staleness, re-chosen at every update
(:mod:`grpo_variants.rollout.adaptive_clip`).

Choices where the paper is silent (``docs/algorithms.md``): veto threshold 1e-4; loss aggregation GRPO's
seq-mean-token-mean; no KL term (beta = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.losses import relaxed_clip_eps
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer

__all__ = ["MuGRPOConfig", "MuGRPOTrainer"]


@dataclass
class MuGRPOConfig(GRPOVariantConfig):
    """µ-GRPO: the paper's stage size and µ, relaxed clipping and the negative-advantage veto.

    ``steps_per_generation``, ``generation_batch_size`` and ``num_iterations`` are derived from the
    stage (leave them unset; :func:`grpo_variants.rollout.stages.derive_stage`).
    """

    variant: str | None = field(default="mu_grpo")
    loss_type: str = field(default="grpo")
    scale_rewards: str = field(default="group")
    beta: float = field(default=0.0)
    learning_rate: float = field(default=1e-6)
    epsilon: float | None = field(
        default=None,
        metadata={"help": "Lower clip width. With relaxed_clip=True it is derived from mu_clip_lower (leave unset); "
                  "otherwise defaults to 0.2."},
    )
    veto_scope: str | None = field(
        default="H_kappa",
        metadata={"help": "Negative-advantage veto scope: T | S_kappa | H_kappa (paper) | S_seq | None (off)."},
    )
    # ---- stages (grpo_variants.rollout.stages): the paper's 1,024 prompts x µ = 1,024 updates -----------------
    updates_per_stage: int | None = field(
        default=1024, metadata={"help": "µ: optimizer updates per stage (per rollout refresh). 1 = on-policy GRPO."}
    )
    stage_prompts: int | None = field(
        default=1024,
        metadata={"help": "Prompts sampled per stage (all processes together); each gets num_generations completions."},
    )
    # ---- relaxed clipping -------------------------------------------------------------------------
    relaxed_clip: bool = field(
        default=True,
        metadata={
            "help": "Clip the ratio to [mu_clip_lower, mu_clip_upper] (paper: [0, 5]); False: epsilon/epsilon_high."
        },
    )
    mu_clip_lower: float = field(default=0.0, metadata={"help": "Relaxed clipping lower ratio bound (0 <= . < 1)."})
    mu_clip_upper: float = field(default=5.0, metadata={"help": "Relaxed clipping upper ratio bound (> 1)."})

    def __post_init__(self):
        if isinstance(self.veto_scope, str) and self.veto_scope.strip().lower() in ("none", "null", "off", ""):
            self.veto_scope = None  # command lines spell "no veto" as a string
        self._set_clip_widths()
        super().__post_init__()  # derives the stage (grpo_variants.rollout.stages)

    def _set_clip_widths(self) -> None:
        if self.relaxed_clip:
            eps_low, eps_high = relaxed_clip_eps(self.mu_clip_lower, self.mu_clip_upper)
            given = (("epsilon", self.epsilon, eps_low), ("epsilon_high", self.epsilon_high, eps_high))
            for name, value, derived in given:
                if value is not None and not math.isclose(value, derived):
                    raise ConfigError(
                        f"relaxed_clip=True derives {name}={derived} from the ratio bounds [mu_clip_lower, "
                        f"mu_clip_upper] = [{self.mu_clip_lower}, {self.mu_clip_upper}], but {name}={value} was "
                        "given. Set the bounds instead, or relaxed_clip=False to use epsilon/epsilon_high."
                    )
            self.epsilon, self.epsilon_high = eps_low, eps_high
        elif self.epsilon is None:
            self.epsilon = 0.2

    def defaults_differing_from_trl(self) -> dict:
        """Also the clip widths that relaxed clipping derives from [mu_clip_lower, mu_clip_upper] (announced)."""
        out = super().defaults_differing_from_trl()
        if self.relaxed_clip:
            out["epsilon"], out["epsilon_high"] = self.epsilon, self.epsilon_high
        return out

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """The ratio interval [1 - epsilon, 1 + epsilon_high] in force."""
        return 1.0 - self.epsilon, 1.0 + self.epsilon_high


@register_variant(
    "mu_grpo",
    description="µ-GRPO: few large off-policy stages (µ updates each), relaxed clip [0,5], negative-advantage veto",
    paper="arXiv:2605.17570",
)
class MuGRPOTrainer(GRPOVariantTrainer):
    """µ-GRPO; see the module docstring. The stage rollout is the base trainer's (grpo_variants.rollout.stages)."""

    config_class = MuGRPOConfig
    stage_metric_prefix = "mu_grpo"  # the stage's metrics and checkpoint entry (grpo_variants.rollout.stages)

    # ---- per-update metrics -----------------------------------------------------------------------
    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        super()._log_loss_metrics(mode, stats, entropies, mask, inputs)
        if mode != "train" or "policy_version" not in inputs:
            return
        metrics = self._metrics[mode]
        advantages = inputs["advantages"]
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        negative = mask.float() * (adv < 0).float()
        ratio = stats["ratio"].float().expand_as(negative)
        totals = torch.stack([(ratio * negative).sum(), negative.sum()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[1].item() > 0:
            metrics["mu_grpo/neg_adv_ratio_mean"].append((totals[0] / totals[1]).item())
        if self.loss_spec is not None and self.loss_spec.veto_scope is None and ratio.shape == negative.shape:
            # With the veto off: the share of trained tokens that WOULD be triggers (A < 0, r < veto_threshold).
            would = negative * (ratio < self.args.veto_threshold).float()
            counts = self.accelerator.reduce(torch.stack([would.sum(), mask.float().sum()]), reduction="sum")
            metrics["veto/would_trigger_fraction"].append((counts[0] / counts[1].clamp(min=1.0)).item())
