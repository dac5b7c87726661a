"""Pure helpers for the per-run mechanism metrics the trainers log (unit-tested on hand-built tensors).

* ``completions/mean_length_right`` / ``completions/mean_length_wrong``: mean completion length (tokens)
  of the completions whose total weighted reward is positive / not positive (for an accuracy reward of
  1 / 0 or +1 / -1: right and wrong answers). A length bias (wrong answers longer than right ones, or
  the reverse) is what Dr.GRPO's and DAPO's aggregations act on. ``completions/right_fraction`` is the
  share of right completions. Logged by every trainer from its rollout (TRL's ``completions/*``
  family; iGRPO files its drafts' under ``igrpo/draft_completions/*``).
* Truncation rate is TRL's ``completions/clipped_ratio``; clip fractions ``clip_ratio/low_mean``,
  ``clip_ratio/high_mean``, ``clip_ratio/dual_mean``; entropy ``entropy``; veto ``veto/fraction``;
  FIPO ``fipo/weight_mean``; dynamic sampling ``dynamic_sampling/pass_rate`` (its drop rate is one
  minus it); iGRPO ``igrpo/draft_reward_mean`` vs ``igrpo/refined_reward_mean``.
"""

from __future__ import annotations

import torch

__all__ = ["lengths_by_outcome"]


def lengths_by_outcome(lengths: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Mean length of right (reward > 0) and wrong (reward <= 0) completions, and the right fraction.

    ``lengths`` and ``rewards`` are (B,). Unscored completions (NaN reward) are left out. A side with no
    completion gets NaN (TRL's metric averaging skips nothing, so callers drop NaN before logging).
    """
    lengths = lengths.float().reshape(-1)
    rewards = rewards.float().reshape(-1).to(lengths.device)
    scored = ~torch.isnan(rewards)
    right = scored & (rewards > 0)
    wrong = scored & (rewards <= 0)

    def mean(sel):
        return (lengths[sel].sum() / sel.sum()).item() if sel.any() else float("nan")

    return {
        "mean_length_right": mean(right),
        "mean_length_wrong": mean(wrong),
        "right_fraction": (right.sum() / scored.sum()).item() if scored.any() else float("nan"),
    }
