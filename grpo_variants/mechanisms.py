"""Pure helpers for the per-run mechanism metrics the trainers log (unit-tested on hand-built tensors).

* ``completions/mean_length_right`` / ``completions/mean_length_wrong``: mean completion length (tokens)
  of the right / wrong completions. Right means the *accuracy reward* scored it above 0 (1 / 0 and +1 / -1
  rules alike; :func:`outcome_rewards`): a format or brevity bonus added to the reward sum never makes a
  wrong answer right. Without an accuracy reward, the single reward's sign decides; with several rewards and
  none an accuracy reward, right / wrong is not defined and nothing is logged. A length bias (wrong answers longer than right ones, or
  the reverse) is what Dr.GRPO's and DAPO's aggregations act on. ``completions/right_fraction`` is the
  share of right completions. Logged by every trainer from its rollout (TRL's ``completions/*``
  family; iGRPO files its drafts' under ``igrpo/draft_completions/*``).
* ``rewards/<name>/right_fraction``: the share of scored completions an accuracy reward called right (> 0):
  the training accuracy the console prints (the mean of a +1 / -1 reward is not an accuracy).
* Truncation rate is TRL's ``completions/clipped_ratio``; clip fractions ``clip_ratio/low_mean``,
  ``clip_ratio/high_mean``, ``clip_ratio/dual_mean``; entropy ``entropy``; veto ``veto/fraction``;
  FIPO ``fipo/weight_mean``; dynamic sampling ``dynamic_sampling/pass_rate`` (its drop rate is one
  minus it); iGRPO ``igrpo/draft_reward_mean`` vs ``igrpo/refined_reward_mean``.
"""

from __future__ import annotations

import torch

__all__ = ["accuracy_reward_indices", "lengths_by_outcome", "outcome_rewards", "right_fraction"]


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


def accuracy_reward_indices(names) -> list[int]:
    """Positions of the accuracy rewards among the reward function names: those with "acc" in the name
    (``toy_accuracy``, ``math_accuracy_pm1``, TRL's ``accuracy_reward``), the rule the console uses too."""
    return [i for i, name in enumerate(names) if "acc" in str(name).lower()]


def right_fraction(values: torch.Tensor) -> float:
    """Share of scored values (not NaN) above 0: an accuracy reward's fraction of right completions."""
    values = values.float().reshape(-1)
    scored = ~torch.isnan(values)
    return ((values > 0) & scored).sum().item() / scored.sum().item() if scored.any() else float("nan")


def outcome_rewards(rewards_per_func: torch.Tensor | None, names, weighted: torch.Tensor | None = None):
    """The (B,) values whose sign says right (> 0) or wrong, or None when nothing says it.

    ``rewards_per_func`` is (B, n_funcs) in the order of ``names``. The first accuracy reward's column
    (:func:`accuracy_reward_indices`) decides; with a single reward function, that reward (``weighted`` when
    given: the same sign); with several and no accuracy reward, None (a format or length bonus is not
    correctness, and their sum is not either).
    """
    if rewards_per_func is None or not names:
        return weighted
    acc = accuracy_reward_indices(names)
    if acc:
        return rewards_per_func[:, acc[0]]
    if len(names) == 1:
        return weighted if weighted is not None else rewards_per_func[:, 0]
    return None
