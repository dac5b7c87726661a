"""DAPO — Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025, arXiv:2503.14476).

What it computes (``docs/algorithms.md``, "DAPO"):

* **Clip-Higher**: eps_low = 0.2, eps_high = 0.28, plus the dual clip of verl's DAPO reference
  recipe (``clip_ratio_c = 10``: for A < 0 the per-token loss is bounded by -c A; None disables it).
* **Token-level loss**: token-mean over each update's whole optimisation batch (all processes, every
  accumulation micro-step of that update: ``aggregation="token_mean"``).
* **Several updates per rollout**: 16 samples per prompt and 16 optimizer updates (mini-batches) per
  rollout (the paper: 512 prompts x 16 samples, mini-batches of 512); ``mini_batches_per_rollout=16``
  sets ``steps_per_generation = 16 x gradient_accumulation_steps``, so one update is
  ``per_device_train_batch_size x processes x gradient_accumulation_steps`` completions and the rollout
  16 of them. Only then does pi_old differ from pi_theta and do Clip-Higher and the dual clip act.
* AdamW, lr 1e-6 constant after 20 warm-up steps, weight decay 0.1 and gradient clipping 1.0 (verl).
* **Dynamic sampling** (:mod:`grpo_variants.rollout.sampling`, an option of every variant): drop every group
  whose accuracy is 0 or 1, re-sample until the batch is full, retry cap ``max_num_gen_batches = 10``
  (verl). Beyond the paper, surplus qualifying groups are carried to the next batch instead of cut
  (``dynamic_sampling_surplus="carry"``; ``"discard"`` is the paper's cut), and top-ups are sized from
  the running pass rate to the deficit (``dynamic_sampling_topup="pass_rate"``; ``"full"``: verl's whole
  generation batch per extra round).
* **Overlong reward shaping** (eq. 13), added to the correctness reward: with ``overlong_penalty``
  on, a reward named ``overlong_penalty`` is appended automatically with L_max =
  ``max_completion_length`` and L_cache = ``overlong_buffer_len`` (default 20% of L_max, the paper's
  4,096 of 20,480).
* **Overlong filtering**: truncated completions get no gradient (``mask_truncated_completions``).
* No KL term (beta = 0); rule reward +1 / -1 (pass e.g. ``math_accuracy_pm1``; the recipe does).

The trainer only appends the overlong penalty; everything else is the base trainer's composed loss and
the shared dynamic-sampling component.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.registry import register_variant
from grpo_variants.rollout.sampling import DynamicSamplingInfo, select_groups
from grpo_variants.trainer import GRPOVariantTrainer, resolve_reward_funcs

__all__ = ["DAPOConfig", "DAPOTrainer", "DynamicSamplingInfo", "select_groups", "OVERLONG_REWARD_NAME"]

OVERLONG_REWARD_NAME = "overlong_penalty"
# L_cache / L_max in the paper (4,096 / 20,480): the default buffer when overlong_buffer_len is None.
_PAPER_BUFFER_RATIO = 4096 / 20480


@dataclass
class DAPOConfig(GRPOVariantConfig):
    """The DAPO defaults (paper + verl's reference recipe)."""

    variant: str | None = field(default="dapo")
    # Clip-Higher, dual clip, token-level loss, no KL
    loss_type: str = field(default="dapo")
    aggregation: str | None = field(default="token_mean")  # per update, over every process and micro-step
    scale_rewards: str = field(default="group")
    epsilon: float = field(default=0.2)
    epsilon_high: float | None = field(default=0.28)
    clip_ratio_c: float | None = field(
        default=10.0,
        metadata={"help": "Dual-clip bound c of verl's DAPO recipe: for A<0 the loss is at most -c*A. None: off."},
    )
    beta: float = field(default=0.0)
    # rollout and optimisation: 16 samples per prompt, 16 updates per rollout, AdamW 1e-6 constant after 20
    # warm-up steps, weight decay 0.1 (verl), gradient clipping 1.0 (TRL's default too)
    num_generations: int | None = field(default=16)
    mini_batches_per_rollout: int | None = field(default=16)
    learning_rate: float = field(default=1e-6)
    lr_scheduler_type: str = field(default="constant_with_warmup")
    warmup_steps: float = field(default=20)
    weight_decay: float = field(default=0.1)
    max_grad_norm: float = field(default=1.0)
    # dynamic sampling (grpo_variants.rollout.sampling), overlong filtering
    dynamic_sampling: bool = field(default=True)
    max_num_gen_batches: int = field(default=10)
    mask_truncated_completions: bool = field(default=True)
    # ---- overlong reward shaping (eq. 13) ---------------------------------------------------
    overlong_penalty: bool = field(
        default=True,
        metadata={"help": "Append DAPO's soft overlong punishment (reward 'overlong_penalty', L_max = "
                  "max_completion_length)."},
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata={"help": "L_cache, the soft buffer in tokens. None: 20%% of max_completion_length (the paper's "
                  "4,096 of 20,480)."},
    )

    def _validate_variant_fields(self) -> None:
        super()._validate_variant_fields()
        if self.overlong_penalty:
            if self.max_completion_length is None:
                raise ConfigError("overlong_penalty=True needs max_completion_length (it is L_max of eq. 13).")
            buffer = self.resolved_overlong_buffer_len
            if not 0 < buffer <= self.max_completion_length:
                raise ConfigError(
                    f"overlong_buffer_len ({buffer}) must lie in [1, max_completion_length="
                    f"{self.max_completion_length}]; the paper uses 4,096 with max_completion_length 20,480."
                )

    @property
    def resolved_overlong_buffer_len(self) -> int:
        """L_cache in force: ``overlong_buffer_len`` or 20%% of ``max_completion_length`` (at least 1)."""
        if self.overlong_buffer_len is not None:
            return int(self.overlong_buffer_len)
        return max(1, round(_PAPER_BUFFER_RATIO * self.max_completion_length))


@register_variant(
    "dapo",
    description="DAPO: clip-higher 0.2/0.28, dual-clip 10, token-mean, 16 updates/rollout, dynamic sampling, "
    "overlong shaping/filtering",
    paper="arXiv:2503.14476",
)
class DAPOTrainer(GRPOVariantTrainer):
    """DAPO; see the module docstring. Appends the overlong penalty to the rewards."""

    config_class = DAPOConfig

    def __init__(self, model, reward_funcs=None, args: DAPOConfig | None = None, train_dataset=None, *posargs,
                 **kwargs):
        args = self._coerce_args(args, model)
        reward_funcs, args = self._with_overlong_penalty(reward_funcs, args)
        super().__init__(model, reward_funcs, args, train_dataset, *posargs, **kwargs)

    # ---- overlong reward shaping -------------------------------------------------------------
    @staticmethod
    def _with_overlong_penalty(reward_funcs, args):
        """Append eq. 13's penalty (L_max = max_completion_length) to the rewards when configured."""
        if not args.overlong_penalty:
            return reward_funcs, args
        from grpo_variants.rewards.builtin import OverlongPenalty, make_overlong_penalty

        funcs = resolve_reward_funcs(reward_funcs)
        if any(isinstance(getattr(f, "__wrapped__", f), OverlongPenalty) for f in funcs):
            raise ConfigError(
                "An overlong-penalty reward is already among reward_funcs and overlong_penalty=True would add it "
                "a second time: remove it from reward_funcs or set overlong_penalty=False."
            )
        if args.reward_weights is not None:
            if len(args.reward_weights) != len(funcs):
                raise ConfigError(
                    f"reward_weights has {len(args.reward_weights)} values but there are {len(funcs)} reward "
                    f"functions: give one weight per function (the overlong penalty, weight 1.0, is appended "
                    "automatically)."
                )
            args = copy.copy(args)  # do not mutate the caller's config
            args.reward_weights = [*args.reward_weights, 1.0]
        penalty = make_overlong_penalty(
            args.max_completion_length, args.resolved_overlong_buffer_len, name=OVERLONG_REWARD_NAME
        )
        return [*funcs, penalty], args
