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

Steps 1-3 are the stage rollout component, :mod:`grpo_variants.stages` (any variant can set
``stage_prompts`` / ``updates_per_stage``): it maps the stage onto TRL's buffering, concatenates the
chunks, records the policy versions, resumes mid-stage and logs the stage timings and staleness (here
under ``mu_grpo/``). The behaviour log-probs are recorded while HF generate samples
(:mod:`grpo_variants.rollout_logprobs`; no second forward pass over the stage in float32). What this
file adds is the paper's: its defaults (1,024 prompts x µ = 1,024, lr 1e-6, no KL), the relaxed clip,
the veto, and two per-update diagnostics (``mu_grpo/neg_adv_ratio_mean``; with the veto off,
``veto/would_trigger_fraction``).

Beyond the paper (off by default): ``adaptive_clip_target`` replaces the fixed bounds by a trust region
that follows the measured staleness (:func:`grpo_variants.losses.adaptive_clip_bounds`): at every update
the bounds are chosen from the current policy's token ratios against the stage's behaviour log-probs so
that a target fraction of the negative- (positive-) advantage tokens is low- (high-) clipped, clamped
between PPO's [0.8, 1.2] and µ-GRPO's [0, 5] by default; logged as ``adaptive_clip/low`` and
``adaptive_clip/high``. With several processes each sets its bounds from its own micro-batch.

Choices where the paper is silent (``docs/algorithms.md``): veto threshold 1e-4; loss aggregation GRPO's
seq-mean-token-mean; no KL term (beta = 0).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.losses import adaptive_clip_bounds, relaxed_clip_eps
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer

__all__ = ["MuGRPOConfig", "MuGRPOTrainer"]

logger = logging.getLogger(__name__)


@dataclass
class MuGRPOConfig(GRPOVariantConfig):
    """µ-GRPO: the paper's stage size and µ, relaxed clipping and the negative-advantage veto.

    ``steps_per_generation``, ``generation_batch_size`` and ``num_iterations`` are derived from the
    stage (leave them unset; :func:`grpo_variants.stages.derive_stage`).
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
    # ---- stages (grpo_variants.stages): the paper's 1,024 prompts x µ = 1,024 updates -----------------
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
    # ---- adaptive trust region (beyond the paper; off by default) -----------------------------------
    adaptive_clip_target: float | None = field(
        default=None,
        metadata={
            "help": "If set (in (0, 0.5)), the clip bounds are re-chosen at every update from the current policy's "
            "ratios so that this fraction of the A<0 tokens is low-clipped and of the A>0 tokens high-clipped "
            "(losses.adaptive_clip_bounds), within the ranges below; None = the fixed bounds."
        },
    )
    adaptive_clip_lower_min: float = field(default=0.0, metadata={"help": "Widest adaptive lower ratio bound."})
    adaptive_clip_lower_max: float = field(default=0.8, metadata={"help": "Tightest adaptive lower ratio bound."})
    adaptive_clip_upper_min: float = field(default=1.2, metadata={"help": "Tightest adaptive upper ratio bound."})
    adaptive_clip_upper_max: float = field(default=5.0, metadata={"help": "Widest adaptive upper ratio bound."})

    def __post_init__(self):
        if isinstance(self.veto_scope, str) and self.veto_scope.strip().lower() in ("none", "null", "off", ""):
            self.veto_scope = None  # command lines spell "no veto" as a string
        self._set_clip_widths()
        self._check_adaptive_clip()
        super().__post_init__()  # derives the stage (grpo_variants.stages)
        if self.adaptive_clip_target is not None:
            if self.resolved_ratio_level != "token":
                raise ConfigError(
                    f"adaptive_clip_target sets token clip bounds from token ratios, but the ratio level is "
                    f"{self.resolved_ratio_level!r} (importance_sampling_level). Use importance_sampling_level='token' "
                    "or adaptive_clip_target=None."
                )
            if self.delta is not None and not self.delta > self.adaptive_clip_upper_max:
                raise ConfigError(
                    f"delta ({self.delta}) must exceed adaptive_clip_upper_max ({self.adaptive_clip_upper_max}), the "
                    "widest upper clip bound the adaptive trust region may choose. Raise delta or lower the maximum."
                )
            logger.warning(
                "µ-GRPO: adaptive_clip_target=%g replaces the fixed clip bounds: lower in [%g, %g], upper in [%g, %g], "
                "re-chosen at every update from the current ratios.",
                self.adaptive_clip_target, self.adaptive_clip_lower_min, self.adaptive_clip_lower_max,
                self.adaptive_clip_upper_min, self.adaptive_clip_upper_max,
            )

    @property
    def adaptive_clip_ranges(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(lower_range, upper_range) for :func:`grpo_variants.losses.adaptive_clip_bounds`."""
        return ((self.adaptive_clip_lower_min, self.adaptive_clip_lower_max),
                (self.adaptive_clip_upper_min, self.adaptive_clip_upper_max))

    def _check_adaptive_clip(self) -> None:
        target = self.adaptive_clip_target
        if target is None:
            return
        if not (isinstance(target, (int, float)) and 0.0 < target < 0.5):
            raise ConfigError(
                f"adaptive_clip_target must be None (off) or a clipped-token fraction in (0, 0.5), e.g. 0.02; "
                f"got {target!r}."
            )
        lo_min, lo_max = self.adaptive_clip_lower_min, self.adaptive_clip_lower_max
        up_min, up_max = self.adaptive_clip_upper_min, self.adaptive_clip_upper_max
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
    """µ-GRPO; see the module docstring. The stage rollout is the base trainer's (grpo_variants.stages)."""

    config_class = MuGRPOConfig
    stage_metric_prefix = "mu_grpo"  # the stage's metrics and checkpoint entry (grpo_variants.stages)

    # ---- adaptive trust region ----------------------------------------------------------------------
    # Per update (per micro-batch), not per stage: at a stage's first update the policy IS the behaviour
    # policy (every ratio is 1), so bounds set once per stage would see no staleness; the ratios drift with
    # every update of the stage, and the current forward pass already has them (no extra forward). The base
    # loss reads ``self.loss_spec`` before its forward pass; the bounds are set on that same spec object right
    # after the forward (in _get_per_token_logps_and_entropies) and restored once the loss is computed.
    def _compute_loss(self, model, inputs):
        if self.args.adaptive_clip_target is None or self.loss_spec is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        spec = self.loss_spec
        saved = (spec.eps_low, spec.eps_high)
        self._adaptive_clip_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._adaptive_clip_inputs = None
            spec.eps_low, spec.eps_high = saved

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        inputs = getattr(self, "_adaptive_clip_inputs", None)
        if inputs is None:
            return out
        self._adaptive_clip_inputs = None  # the loss's own forward pass only
        logps = out[0].detach()
        old = inputs.get("old_per_token_logps")
        ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        lower_range, upper_range = self.args.adaptive_clip_ranges
        bounds = adaptive_clip_bounds(ratio, inputs["advantages"], mask, self.args.adaptive_clip_target,
                                      lower_range, upper_range)
        self.loss_spec.eps_low, self.loss_spec.eps_high = 1.0 - bounds.lower, bounds.upper - 1.0
        metrics = self._metrics["train"]
        metrics["adaptive_clip/low"].append(bounds.lower)
        metrics["adaptive_clip/high"].append(bounds.upper)
        return out

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
