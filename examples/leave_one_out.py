"""Leave-one-out GRPO: the worked example of adding a variant (``docs/architecture.md``, "Adding a variant").

The idea, from RLOO (Ahmadian et al. 2024, arXiv:2402.14740): compare each completion with the mean
reward of the *other* G - 1 completions of its group instead of the whole group's mean, which
includes the completion itself:

    A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean_g R)        (no std division)

Everything else is GRPO's loss (token ratio, clip 0.2, per-sequence mean). The file shows the three
parts of a variant: a pure tensor function (tested on hand-computed numbers), a config whose defaults
are the method's, and a trainer that overrides one hook by calling ``super()``. It is not registered
by default; importing this file registers it::

    import examples.leave_one_out                    # or importlib, from any path
    from grpo_variants import get_variant
    spec = get_variant("loo_grpo")                   # grpo-variants train --variant loo_grpo needs the import too
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer, register_variant


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = R_i - (sum_g R - R_i) / (G - 1) for flat ``rewards`` in consecutive groups of ``group_size``.

    A NaN reward (an unscorable completion) makes its whole group's advantages 0.
    """
    if group_size < 2:
        raise ConfigError(f"leave-one-out needs num_generations >= 2; got {group_size}.")
    grouped = rewards.view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = grouped - others
    advantages = torch.where(torch.isnan(grouped).any(dim=1, keepdim=True), 0.0, advantages)
    return advantages.reshape(-1)


@dataclass
class LeaveOneOutConfig(GRPOVariantConfig):
    """GRPO's loss with the leave-one-out baseline."""

    variant: str | None = field(default="loo_grpo")
    loss_type: str = field(default="grpo")  # seq-mean-token-mean, as GRPO
    scale_rewards: str = field(default="none")  # no std division (the advantage is replaced below anyway)
    epsilon: float = field(default=0.2)
    beta: float = field(default=0.0)


@register_variant(
    "loo_grpo",
    description="Leave-one-out GRPO: baseline = mean reward of the other G-1 completions (example variant)",
    paper="arXiv:2402.14740",
)
class LeaveOneOutTrainer(GRPOVariantTrainer):
    """Replaces the advantages of TRL's rollout with leave-one-out advantages; the loss is the base's."""

    config_class = LeaveOneOutConfig

    def _check_args(self, args) -> None:
        super()._check_args(args)
        if args.kl_in_reward:
            raise ConfigError("loo_grpo recomputes the advantages from the rewards; use kl_in_reward=False.")

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        group = self.num_generations if self.model.training else self.num_generations_eval
        advantages = leave_one_out_advantages(self.weighted_rewards(), group)  # global batch, every process
        local = output["advantages"].size(0)
        start = self.accelerator.process_index * local  # this process's rows, as TRL slices them
        output["advantages"] = advantages[start : start + local].to(output["advantages"])
        return output
