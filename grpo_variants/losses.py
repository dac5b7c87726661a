"""Pure loss core of the GRPO family (advantages, ratios, clipping, aggregation, KL, veto, FIPO).

In the style of verl's ``core_algos.py``: small pure tensor functions, each with its formula in
the docstring, registered by name so configs select them. No trainer state, no accelerate, no
globals besides the registries. The math of every function, and of the variants built from them, is
explained in ``docs/algorithms.md``.

Shapes: ``B`` sequences, ``T`` completion tokens. ``mask`` is (B, T) with 0/1 values (float, long
or bool). Log-probs are (B, T). ``advantages`` may be (B,), (B, 1) or (B, T) (per-token
advantages, e.g. FIPO); every function normalises them with :func:`as_token_advantages`.

Scaling for gradient accumulation and for data parallelism is the **caller's** job: every loss
returned here is the loss of one micro-batch, normalised only as the aggregation mode says
(see :func:`aggregate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from grpo_variants.errors import ConfigError, UnknownLossError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "VETO_SCOPES",
    "LossOutput",
    "LossSpec",
    "SurrogateOutput",
    "aggregate",
    "aggregate_constant",
    "aggregate_seq_mean_token_mean",
    "aggregate_seq_mean_token_sum",
    "aggregate_token_mean",
    "PROCESS_CREDITS",
    "adaptive_kl_beta",
    "as_token_advantages",
    "has_token_signal",
    "normalize_step_rewards",
    "outcome_plus_process",
    "process_advantages",
    "step_credit",
    "batch_std_advantages",
    "clipped_surrogate",
    "compute_log_ratio",
    "compute_policy_loss",
    "discounted_future_sum",
    "entropy_bonus",
    "fipo_drop_mask",
    "fipo_weights",
    "get_advantage_estimator",
    "get_aggregation",
    "get_kl_estimator",
    "group_mean_advantages",
    "group_std_advantages",
    "zero_std_groups",
    "update_token_counts",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "relaxed_clip_eps",
    "AdaptiveClipBounds",
    "adaptive_clip_bounds",
    "sequence_log_ratio",
    "sequence_token_log_ratio",
    "token_log_ratio",
    "veto_keep_mask",
    "veto_triggers",
]


def _lookup(kind: str, name: str, registry: dict) -> Callable:
    try:
        return registry[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(k) for k in registry)
        raise UnknownLossError(f"Unknown {kind} {name!r}. Valid names: {valid}.") from None


def as_token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Return advantages shaped to broadcast against (B, T): (B,) -> (B, 1); (B, 1) and (B, T) unchanged."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(1)
    if advantages.dim() != 2:
        raise ValueError(f"advantages must be (B,), (B, 1) or (B, T); got shape {tuple(advantages.shape)}.")
    return advantages


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """0/1 mask (float, long or bool) as a float tensor of ``like``'s dtype."""
    return mask.to(like.dtype) if mask.is_floating_point() else (mask > 0).to(like.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer; got {group_size!r}.")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ConfigError(
            f"rewards must be a flat tensor whose length ({rewards.numel()}) is a multiple of group_size "
            f"({group_size}); got shape {tuple(rewards.shape)}."
        )
    return rewards.view(-1, group_size)


def _nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std ignoring NaNs (TRL 1.16 ``nanstd``): NaN where fewer than two values are non-NaN."""
    if dim is None:
        x = x.reshape(-1)
        dim = 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(x.dtype)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dim)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """One bool per group: its scorable rewards have zero std.

    True when TRL's own test behind ``frac_reward_zero_std`` says so (``torch.isclose(std, 0)`` on the
    unbiased NaN-aware std) or when every scorable reward of the group is exactly equal. The second
    test is needed because rewards such as 0.1, 0.7 or 1.2 are not exactly representable: their float
    mean differs from the value by an ulp, TRL's two-pass ``nanstd`` is then ~1e-8..1e-7 (0.7 x 8 is
    not "close" to 0) and (R - mean) / (std + 1e-4) is ~1e-4..1e-3 of one sign instead of 0. A group
    with no scorable reward is not flagged (its advantages are 0 anyway).
    """
    grouped = _grouped(rewards, group_size)
    std = _nanstd(grouped, dim=1)
    scorable = ~torch.isnan(grouped)
    high = torch.where(scorable, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)
    low = torch.where(scorable, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)
    return torch.isclose(std, torch.zeros_like(std)) | (scorable.any(dim=1) & (high == low))


def _zero_constant_groups(advantages: torch.Tensor, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    constant = zero_std_groups(rewards, group_size).repeat_interleave(group_size)
    return torch.where(constant, torch.zeros_like(advantages), advantages)


def group_std_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantage: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased.

    ``rewards`` is flat (N,), ordered in consecutive groups of ``group_size``. NaN rewards
    (unscorable completions) are ignored in the group mean and std (nanmean, nan-aware unbiased
    std) and get advantage 0, as in TRL 1.16. A group whose std is zero (:func:`zero_std_groups`)
    gets A = 0 exactly for every member; a group with fewer than two scorable rewards also gets 0
    (its std is undefined).
    """
    g = _grouped(rewards, group_size)
    mean = torch.nanmean(g, dim=1, keepdim=True)
    std = _nanstd(g, dim=1, keepdim=True)
    advantages = torch.nan_to_num((g - mean) / (std + eps), nan=0.0).reshape(-1)
    return _zero_constant_groups(advantages, rewards, group_size)


def group_mean_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO advantage: A_i = R_i - mean_g R (NaN rewards ignored in the mean, advantage 0).

    A zero-std group (:func:`zero_std_groups`) gets A = 0 exactly.
    """
    g = _grouped(rewards, group_size)
    advantages = torch.nan_to_num(g - torch.nanmean(g, dim=1, keepdim=True), nan=0.0).reshape(-1)
    return _zero_constant_groups(advantages, rewards, group_size)


def batch_std_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """TRL ``scale_rewards="batch"``: A_i = (R_i - mean_g R) / (std_batch R + eps).

    Group mean, unbiased nan-aware std over the whole batch; NaN rewards get 0. A batch with
    fewer than two scorable rewards gives A = 0 everywhere; a group whose own std is zero gets 0 exactly.
    """
    g = _grouped(rewards, group_size)
    std = _nanstd(rewards)
    advantages = torch.nan_to_num((g - torch.nanmean(g, dim=1, keepdim=True)) / (std + eps), nan=0.0).reshape(-1)
    return _zero_constant_groups(advantages, rewards, group_size)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "group_std": group_std_advantages,
    "group_mean": group_mean_advantages,
    "batch_std": batch_std_advantages,
}


def get_advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    """Return the advantage estimator registered under ``name`` (see ``ADVANTAGE_ESTIMATORS``)."""
    return _lookup("advantage estimator", name, ADVANTAGE_ESTIMATORS)


# ---------------------------------------------------------------------------------------------------------------
# Process supervision: step rewards -> token advantages (DeepSeekMath §4.1.3, PURE), adaptive KL coefficient
# ---------------------------------------------------------------------------------------------------------------
PROCESS_CREDITS = ("sum", "min")


def normalize_step_rewards(step_rewards: torch.Tensor, group_size: int, estimator: str = "group_std",
                           eps: float = 1e-4) -> torch.Tensor:
    """Normalise every step reward over all steps of its group (DeepSeekMath §4.1.3).

    ``step_rewards``: (B, K), row b holds the K_b step rewards of completion b then NaN padding; rows in
    consecutive groups of ``group_size``. With R = all step rewards of the G outputs of a prompt:

    * ``"group_std"`` (GRPO): r~ = (r - mean R) / (std R + eps), std unbiased;
    * ``"group_mean"`` (Dr.GRPO, ``scale_rewards="none"``): r~ = r - mean R;
    * ``"batch_std"`` (``scale_rewards="batch"``): r~ = (r - mean R) / (std of every step reward of the batch + eps).

    A group whose step rewards are all equal, or with fewer than two steps, gets r~ = 0. Returns (B, K)
    with NaN kept where there is no step.
    """
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must be (B, K); got shape {tuple(step_rewards.shape)}.")
    b, k = step_rewards.shape
    if k == 0:
        return step_rewards.clone()
    grouped = _grouped(step_rewards.reshape(-1), group_size * k)  # (groups, G * K): every step of a group
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    centred = grouped - mean
    if estimator == "group_std":
        centred = centred / (_nanstd(grouped, dim=1, keepdim=True) + eps)
    elif estimator == "batch_std":
        centred = centred / (_nanstd(step_rewards) + eps)
    elif estimator != "group_mean":
        raise ConfigError(f"unknown advantage estimator {estimator!r} for step rewards; choose one of "
                          f"{list(ADVANTAGE_ESTIMATORS)}.")
    constant = zero_std_groups(step_rewards.reshape(-1), group_size * k).unsqueeze(1)
    scorable = ~torch.isnan(grouped)
    centred = torch.where(constant | (scorable.sum(dim=1, keepdim=True) < 2), torch.zeros_like(centred), centred)
    centred = torch.where(scorable, torch.nan_to_num(centred, nan=0.0), torch.full_like(centred, float("nan")))
    return centred.reshape(b, k)


def step_credit(step_values: torch.Tensor, step_tokens: torch.Tensor, num_tokens: int,
                credit: str = "sum") -> torch.Tensor:
    """Token credit from per-step values: (B, K) values (NaN: no step), (B, K) token indices -> (B, T).

    * ``"sum"`` (DeepSeekMath): A_{b,t} = sum of the values of the steps j with index(j) >= t;
    * ``"min"`` (PURE): A_{b,t} = min of the values of the steps j with index(j) >= t.

    A token after the last step (no step ends at or after it) gets 0. Step indices must lie in [0, T).
    """
    if credit not in PROCESS_CREDITS:
        raise ConfigError(f"process credit must be one of {PROCESS_CREDITS}; got {credit!r}.")
    b = step_values.shape[0]
    valid = ~torch.isnan(step_values)
    tokens = step_tokens.long().clamp(min=0)
    if valid.any() and (int(tokens[valid].max()) >= num_tokens or int(step_tokens[valid].min()) < 0):
        raise ValueError(f"step token indices must lie in [0, {num_tokens}); got {step_tokens[valid].tolist()}.")
    values = torch.nan_to_num(step_values, nan=0.0).float()
    if credit == "sum":
        at = torch.zeros(b, num_tokens, dtype=values.dtype, device=values.device)
        at.scatter_add_(1, tokens, torch.where(valid, values, torch.zeros_like(values)))
        return at.flip(1).cumsum(1).flip(1)  # sum over steps ending at or after t
    at = torch.full((b, num_tokens), float("inf"), dtype=values.dtype, device=values.device)
    at.scatter_reduce_(1, tokens, torch.where(valid, values, torch.full_like(values, float("inf"))), reduce="amin")
    future_min = at.flip(1).cummin(1).values.flip(1)
    return torch.where(torch.isinf(future_min), torch.zeros_like(future_min), future_min)


def process_advantages(step_rewards: torch.Tensor, step_tokens: torch.Tensor, group_size: int, num_tokens: int, *,
                       credit: str = "sum", estimator: str = "group_std", eps: float = 1e-4) -> torch.Tensor:
    """Token advantages of process supervision, (B, T): :func:`step_credit` of :func:`normalize_step_rewards`.

    Sum-form (DeepSeekMath eq. in §4.1.3): A_{i,t} = sum_{j: index(j) >= t} r~_i^j. Min-form (PURE):
    A_{i,t} = min_{j: index(j) >= t} r~_i^j. r~ normalised over every step of the group.
    """
    normalised = normalize_step_rewards(step_rewards, group_size, estimator, eps)
    return step_credit(normalised, step_tokens, num_tokens, credit)


def outcome_plus_process(outcome: torch.Tensor, process: torch.Tensor) -> torch.Tensor:
    """Outcome and process together (PRIME's combination): A_{i,t} = A_i^outcome + A_{i,t}^process, (B, T)."""
    return as_token_advantages(outcome).to(process.dtype) + process


def has_token_signal(advantages: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """One bool per group: some trained token of the group has a non-zero advantage ((B,) or (B, T) advantages).

    The zero-signal test of dynamic sampling for token advantages: a group with equal outcomes but
    different step scores still carries a per-token signal.
    """
    adv = as_token_advantages(advantages).expand(mask.shape)
    row = ((adv != 0) & (mask > 0)).any(dim=1)
    return _grouped(row.float(), group_size).amax(dim=1) > 0


def adaptive_kl_beta(beta: float, kl: float, target: float, samples: int, horizon: float, *,
                     clip: float = 0.2, beta_min: float = 0.0, beta_max: float = float("inf")) -> float:
    """Adaptive KL coefficient (Ziegler et al. 2019; PPO's adaptive penalty), one step.

    e = clip(KL / KL_target - 1, -clip, clip); beta' = beta (1 + e n / H), then clamped to
    [beta_min, beta_max]. ``kl``: measured KL per token; ``samples``: n, sequences of the step; ``horizon``: H.
    """
    if not target > 0 or not horizon > 0:
        raise ConfigError(f"adaptive KL needs target > 0 and horizon > 0; got target={target}, horizon={horizon}.")
    error = max(-clip, min(clip, kl / target - 1.0))
    return float(min(beta_max, max(beta_min, beta * (1.0 + error * samples / horizon))))


# ---------------------------------------------------------------------------------------------------------------
# Importance ratios (log space)
# ---------------------------------------------------------------------------------------------------------------


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token level: log r_{i,t} = log pi_theta - log pi_old, (B, T). ``mask`` is ignored."""
    return logp - old_logp


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: log s_i = sum_t M (logp - old) / max(sum_t M, 1), shape (B, 1) (log of the geometric mean)."""
    m = _float_mask(mask, logp)
    return (((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def sequence_token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token: log s_{i,t} = sg(log s_i) + logp_t - sg(logp_t), shape (B, T).

    Same value as the sequence log-ratio broadcast over tokens; the gradient flows per token
    (d log s_{i,t} / d logp_t = 1, and 0 for every other token).
    """
    seq = sequence_log_ratio(logp, old_logp, mask).detach()
    return seq + logp - logp.detach()


RATIO_LEVELS: dict[str, Callable[..., torch.Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
    "sequence_token": sequence_token_log_ratio,
}


def compute_log_ratio(level: str, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dispatch to the log-ratio registered under ``level`` ("token", "sequence", "sequence_token")."""
    return _lookup("ratio level", level, RATIO_LEVELS)(logp, old_logp, mask)


# ---------------------------------------------------------------------------------------------------------------
# Clipped surrogate
# ---------------------------------------------------------------------------------------------------------------


class SurrogateOutput(NamedTuple):
    """Per-token PPO loss and where each clip was active (bool masks of ``per_token_loss``'s shape)."""

    per_token_loss: torch.Tensor
    is_low_clipped: torch.Tensor
    is_high_clipped: torch.Tensor
    is_dual_clipped: torch.Tensor


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None = None,
    ratio_cap: float | None = None,
) -> SurrogateOutput:
    """PPO clipped surrogate with optional two-sided cap and dual clip.

    l = -min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A), with r' = min(r, ratio_cap) (TRL's
    ``delta``, applied to the unclipped branch only) or r' = r when ``ratio_cap`` is None.
    Dual clip (verl ``clip_ratio_c`` = c > 1): for A < 0, l = min(l, -c A).

    Masks (TRL's definitions, bounds excluded): low-clipped = r < 1 - eps_low and A < 0;
    high-clipped = r > 1 + eps_high and A > 0; dual-clipped = A < 0 and -c A < l strictly.
    At exactly r = 1 - eps_low or 1 + eps_high nothing counts as clipped and, per torch.clamp's
    inclusive-bound gradient, the gradient is the unclipped -A.
    """
    adv = as_token_advantages(advantages)
    unclipped = ratio if ratio_cap is None else torch.clamp(ratio, max=ratio_cap)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.min(unclipped * adv, clipped * adv)
    shape = loss.shape
    is_low = ((ratio < 1.0 - eps_low) & (adv < 0)).expand(shape)
    is_high = ((ratio > 1.0 + eps_high) & (adv > 0)).expand(shape)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv
        is_dual = ((adv < 0) & (bound < loss)).expand(shape)
        loss = torch.where(adv < 0, torch.min(loss, bound), loss)
    else:
        is_dual = torch.zeros(shape, dtype=torch.bool, device=loss.device)
    return SurrogateOutput(loss, is_low, is_high, is_dual)


def relaxed_clip_eps(lower: float, upper: float) -> tuple[float, float]:
    """µ-GRPO relaxed ratio bounds [lower, upper] -> (eps_low, eps_high) = (1 - lower, upper - 1).

    Requires 0 <= lower < 1 < upper (the paper's ablation uses [0, 5] -> (1, 4)).
    """
    if not (0.0 <= lower < 1.0):
        raise ConfigError(f"mu_clip_lower must satisfy 0 <= mu_clip_lower < 1; got {lower!r}.")
    if not (upper > 1.0):
        raise ConfigError(f"mu_clip_upper must be > 1; got {upper!r}.")
    return 1.0 - lower, upper - 1.0


class AdaptiveClipBounds(NamedTuple):
    """Ratio bounds [lower, upper] chosen by :func:`adaptive_clip_bounds`, and the tokens each side saw."""

    lower: float
    upper: float
    negative_tokens: int
    positive_tokens: int


def adaptive_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    target: float,
    lower_range: tuple[float, float] = (0.0, 0.8),
    upper_range: tuple[float, float] = (1.2, 5.0),
) -> AdaptiveClipBounds:
    """Clip bounds that clip a ``target`` fraction of the trained tokens, from the ratios they have now.

    A trust region that follows staleness (beyond µ-GRPO's paper, whose bounds are fixed at [0, 5]).
    PPO's lower bound only clips tokens with A < 0 (r < lower) and the upper bound only tokens with
    A > 0 (r > upper), so each side is set from its own tokens: with the n_neg masked A < 0 ratios
    sorted ascending, lower = the k-th (0-based) of them, k = round(target x n_neg), so exactly k of
    them lie strictly below it (ties can only lower the count); likewise upper = the k-th largest of
    the n_pos masked A > 0 ratios. So the clipped fraction of each side is target within one token
    (before the clamp). Each bound is then clamped: lower to ``lower_range`` = (widest, tightest),
    upper to ``upper_range`` = (tightest, widest) -- by default never tighter than PPO's [0.8, 1.2]
    and never wider than µ-GRPO's [0, 5]; a side without tokens gets its tightest value.

    ``ratio``: pi_theta / pi_behav per token, (B, T) (detached here); ``advantages``: (B,), (B, 1) or
    (B, T); ``mask``: (B, T), 0 = not trained (ignored); ``target`` in (0, 0.5). Returns python floats.
    """
    if not 0.0 < target < 0.5:
        raise ConfigError(f"adaptive clip target must lie in (0, 0.5) (a clipped-token fraction); got {target!r}.")
    lo_min, lo_max = lower_range
    up_min, up_max = upper_range
    if not 0.0 <= lo_min <= lo_max < 1.0:
        raise ConfigError(f"adaptive lower range must satisfy 0 <= min <= max < 1; got {lower_range!r}.")
    if not 1.0 < up_min <= up_max:
        raise ConfigError(f"adaptive upper range must satisfy 1 < min <= max; got {upper_range!r}.")
    r = ratio.detach().float()
    adv = as_token_advantages(advantages).expand(r.shape)
    m = (mask > 0).expand(r.shape)

    def kth(values: torch.Tensor, descending: bool) -> float | None:
        n = values.numel()
        if n == 0:
            return None
        k = min(int(round(target * n)), n - 1)
        return values.sort(descending=descending).values[k].item()

    neg, pos = r[m & (adv < 0)], r[m & (adv > 0)]
    lower, upper = kth(neg, False), kth(pos, True)
    lower = lo_max if lower is None else min(max(lower, lo_min), lo_max)
    upper = up_min if upper is None else min(max(upper, up_min), up_max)
    return AdaptiveClipBounds(lower, upper, int(neg.numel()), int(pos.numel()))


# ---------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------


def _masked(per_token_loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = _float_mask(mask, per_token_loss)
    return per_token_loss * m, m  # broadcasts a (B, 1) sequence-level loss to (B, T)


def aggregate_seq_mean_token_mean(per_token_loss, mask, *, num_items=None, max_completion_length=None):
    """mean_i [ sum_t M l / max(sum_t M, 1) ] (GRPO, GSPO; TRL ``grpo``).

    Fully masked rows contribute 0 but still count in the mean over i. A (B, 1) sequence-level
    loss gives exactly mean_i l_i over rows with at least one token.
    """
    ml, m = _masked(per_token_loss, mask)
    return (ml.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def aggregate_token_mean(per_token_loss, mask, *, num_items=None, max_completion_length=None):
    """sum_{i,t} M l / N (DAPO token-level loss).

    N = ``num_items``, the caller's normaliser; for DAPO's global token mean it is the loss-mask
    token count of this update's optimisation batch (every process, every micro-batch of the
    accumulation window) divided by the number of processes (DDP averages the gradients), so that
    summing the micro-batches' losses gives sum_{i,t} M l / sum_{i,t} M over the update
    (:func:`update_token_counts`). TRL's ``dapo`` loss uses the rollout's average instead,
    num_items_in_batch / num_processes * grad_accum_steps / steps_per_generation, which differs
    when one rollout feeds several updates of unequal lengths. N is clamped at 1.
    With ``num_items=None`` N = max(sum M, 1) over this micro-batch (TRL ``bnpo``).
    """
    ml, m = _masked(per_token_loss, mask)
    if num_items is None:
        denom = m.sum().clamp(min=1.0)
    elif isinstance(num_items, torch.Tensor):
        denom = num_items.to(ml.dtype).clamp(min=1.0)
    else:
        denom = max(float(num_items), 1.0)
    return ml.sum() / denom


def update_token_counts(micro_batch_tokens: torch.Tensor, accumulation_steps: int) -> torch.Tensor:
    """Token count of each micro-batch's optimisation update, per micro-batch.

    ``micro_batch_tokens`` (S,) holds the loss-mask tokens of the S micro-batches of one rollout in
    the order they are trained, already summed over processes; consecutive windows of
    ``accumulation_steps`` micro-batches form one update (S must be a multiple). Returns (S,): entry k
    is the total of k's window.
    """
    S = micro_batch_tokens.numel()
    if accumulation_steps < 1 or S % accumulation_steps != 0:
        raise ConfigError(
            f"{S} micro-batches per rollout do not split into optimizer updates of {accumulation_steps} "
            "micro-batches: steps_per_generation must be a multiple of gradient_accumulation_steps."
        )
    windows = micro_batch_tokens.reshape(-1, accumulation_steps).sum(dim=1)
    return windows.repeat_interleave(accumulation_steps)


def aggregate_seq_mean_token_sum(per_token_loss, mask, *, num_items=None, max_completion_length=None):
    """mean_i sum_t M l (sequence sum, batch mean; TRL ``luspo``)."""
    ml, _ = _masked(per_token_loss, mask)
    return ml.sum(-1).mean()


def aggregate_constant(per_token_loss, mask, *, num_items=None, max_completion_length=None):
    """Dr.GRPO: sum_{i,t} M l / (B * L), L = ``max_completion_length`` (required)."""
    if max_completion_length is None or max_completion_length <= 0:
        raise ConfigError(
            f"aggregation 'constant' needs a positive max_completion_length; got {max_completion_length!r}."
        )
    ml, m = _masked(per_token_loss, mask)
    return ml.sum() / (m.shape[0] * max_completion_length)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "seq_mean_token_mean": aggregate_seq_mean_token_mean,
    "token_mean": aggregate_token_mean,
    "seq_mean_token_sum": aggregate_seq_mean_token_sum,
    "constant": aggregate_constant,
}


def get_aggregation(name: str) -> Callable[..., torch.Tensor]:
    """Return the aggregation registered under ``name`` (see ``AGGREGATIONS``)."""
    return _lookup("aggregation", name, AGGREGATIONS)


def aggregate(per_token_loss, mask, mode: str, *, num_items=None, max_completion_length=None) -> torch.Tensor:
    """Reduce a (B, T) or (B, 1) loss to a scalar with the aggregation ``mode``.

    Gradient-accumulation and multi-process scaling are NOT applied: the caller divides by the
    accumulation steps (except for ``token_mean`` with a window-global ``num_items``).
    """
    fn = get_aggregation(mode)
    return fn(per_token_loss, mask, num_items=num_items, max_completion_length=max_completion_length)


# ---------------------------------------------------------------------------------------------------------------
# KL to the reference policy (per token)
# ---------------------------------------------------------------------------------------------------------------


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 (DeepSeekMath eq. 4) = pi_ref/pi - log(pi_ref/pi) - 1 = exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return the KL estimator registered under ``name`` ("k1", "k2", "k3")."""
    return _lookup("KL estimator", name, KL_ESTIMATORS)


def kl_penalized_rewards(
    rewards: torch.Tensor, kl_per_token: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """KL in the reward: R'_i = R_i - beta * sum_t M_{i,t} kl_{i,t}, shape (B,).

    The KL is detached: rewards carry no gradient.
    """
    kl = kl_per_token.detach()
    return rewards - beta * (kl * _float_mask(mask, kl)).sum(-1).to(rewards.dtype)


# ---------------------------------------------------------------------------------------------------------------
# µ-GRPO negative-advantage veto
# ---------------------------------------------------------------------------------------------------------------


def veto_triggers(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, threshold: float = 1e-4
) -> torch.Tensor:
    """Trigger tokens, bool (B, T): M & (r < threshold) & (A < 0); ``r`` = pi_theta / pi_behav per token."""
    adv = as_token_advantages(advantages)
    return ((mask > 0) & (ratio.detach() < threshold) & (adv < 0)).expand(mask.shape)


def _first_trigger(triggers: torch.Tensor) -> torch.Tensor:
    """kappa_i = index of the first trigger of row i, T if the row has none; shape (B, 1)."""
    T = triggers.shape[-1]
    pos = torch.arange(T, device=triggers.device).expand_as(triggers)
    return torch.where(triggers, pos, torch.full_like(pos, T)).min(-1, keepdim=True).values


def _positions(triggers: torch.Tensor) -> torch.Tensor:
    return torch.arange(triggers.shape[-1], device=triggers.device).unsqueeze(0)


def _veto_trigger_only(triggers: torch.Tensor) -> torch.Tensor:
    """T: drop the trigger tokens only."""
    return ~triggers


def _veto_suffix(triggers: torch.Tensor) -> torch.Tensor:
    """S_kappa: drop every position t > kappa (the suffix after the first trigger, kappa itself kept; later
    triggers dropped)."""
    return _positions(triggers) <= _first_trigger(triggers)


def _veto_harmful(triggers: torch.Tensor) -> torch.Tensor:
    """H_kappa = S_kappa \\ T: drop positions t > kappa that are not triggers (triggers keep their gradient)."""
    return (_positions(triggers) < _first_trigger(triggers)) | triggers


def _veto_sequence(triggers: torch.Tensor) -> torch.Tensor:
    """S_seq: drop the whole row if it has any trigger."""
    return (~triggers.any(-1, keepdim=True)).expand_as(triggers)


VETO_SCOPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "T": _veto_trigger_only,
    "S_kappa": _veto_suffix,
    "H_kappa": _veto_harmful,
    "S_seq": _veto_sequence,
}


def veto_keep_mask(triggers: torch.Tensor, mask: torch.Tensor, scope: str = "H_kappa") -> torch.Tensor:
    """µ-GRPO keep mask, float (B, T): 1 = the token keeps its gradient, 0 = vetoed.

    kappa = first trigger position of the row. Scopes: "T" drops triggers only; "S_kappa" drops
    every position t > kappa (the paper's suffix after the trigger boundary: kappa itself keeps its
    gradient, later triggers do not); "H_kappa" (default, the paper's critical harmful set) =
    S_kappa \\ T drops positions > kappa that are not triggers; "S_seq" drops the whole row. Rows without a
    trigger keep everything; since triggers need A < 0, A >= 0 rows are never vetoed. Positions
    with M = 0 are reported as kept (1): the veto only removes trained tokens.
    """
    fn = _lookup("veto scope", scope, VETO_SCOPES)
    m = mask > 0
    keep = fn(triggers.bool() & m) | ~m
    return keep.to(torch.float32 if not mask.is_floating_point() else mask.dtype)


# ---------------------------------------------------------------------------------------------------------------
# FIPO future-KL weights
# ---------------------------------------------------------------------------------------------------------------


def discounted_future_sum(x: torch.Tensor, gamma: float, chunk_size: int = 256) -> torch.Tensor:
    """y_t = sum_{k >= t} gamma^(k - t) x_k along the last dim of a (B, T) tensor, vectorised.

    Two-level: a (C, C) upper-triangular gamma matrix within chunks of ``chunk_size`` tokens, and
    an (n_chunks, n_chunks) matrix of gamma^C powers to carry the sum across chunks (memory
    O(B T + C^2 + (T/C)^2), no Python loop over tokens, only powers gamma^n <= 1, so no overflow).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (B, T); got shape {tuple(x.shape)}.")
    B, T = x.shape
    if T == 0:
        return x.clone()
    C = max(1, min(int(chunk_size), T))
    n = -(-T // C)
    xp = torch.nn.functional.pad(x, (0, n * C - T))
    g = torch.tensor(gamma, dtype=torch.float64, device=x.device)
    idx = torch.arange(C, device=x.device)
    diff = idx.unsqueeze(0) - idx.unsqueeze(1)  # [t, k] = k - t
    W = torch.where(diff >= 0, g ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64, device=x.device))
    local = xp.view(B, n, C) @ W.T.to(x.dtype)  # local[b, j, t] = sum_{k in chunk j, k >= t} gamma^(k-t) x_k
    if n == 1:
        return local.view(B, -1)[:, :T]
    jdx = torch.arange(n, device=x.device)
    jd = jdx.unsqueeze(0) - jdx.unsqueeze(1)
    V = torch.where(jd >= 0, (g**C) ** jd.clamp(min=0), torch.zeros((), dtype=torch.float64, device=x.device))
    starts = local[..., 0] @ V.T.to(x.dtype)  # y at each chunk start
    nxt = torch.cat([starts[:, 1:], starts.new_zeros(B, 1)], dim=1)  # y at the next chunk's start
    tail = (g ** (C - idx)).to(x.dtype)  # gamma^(distance from t to the next chunk start)
    return (local + nxt.unsqueeze(-1) * tail).view(B, -1)[:, :T]


@torch.no_grad()
def fipo_weights(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    ratio: torch.Tensor | None = None,
    tau: float = 32.0,
    c: float = 10.0,
    clip_low: float = 1.0,
    clip_high: float = 1.2,
    safety_ratio: float = 10.0,
) -> torch.Tensor:
    """FIPO future-KL weights f_t (detached, (B, T)).

    delta_t = clamp(logp - old, -20, 20); M'_t = M_t * [delta_t <= log c]; gamma = 2^(-1/tau);
    FutureKL_t = sum_{k >= t} gamma^(k-t) M'_k delta_k (includes t);
    f_t = clip(exp(FutureKL_t), clip_low, clip_high) (clip_low = 1.0 upward-only, 0.8 symmetric);
    safety: where A < 0 and r > safety_ratio, f_t = clamp(f_t, 0.8, 1.0). ``r`` is the token
    ratio (``ratio`` if given, else exp(logp - old)). Positions with M = 0 get f = 1.
    """
    work = torch.promote_types(logp.dtype, torch.float32)
    delta = (logp.detach() - old_logp.detach()).to(work).clamp(-20.0, 20.0)
    m = mask > 0
    keep = m & (delta <= math.log(c))
    future = discounted_future_sum(torch.where(keep, delta, torch.zeros_like(delta)), 2.0 ** (-1.0 / tau))
    f = torch.exp(future).clamp(clip_low, clip_high)
    r = torch.exp(logp.detach().to(work) - old_logp.detach().to(work)) if ratio is None else ratio.detach()
    unsafe = (as_token_advantages(advantages) < 0) & (r > safety_ratio)
    f = torch.where(unsafe, f.clamp(0.8, 1.0), f)
    return torch.where(m, f, torch.ones_like(f)).to(logp.dtype)


def fipo_drop_mask(is_dual_clipped: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FIPO response drop, float keep mask (B, 1): 0 for a response with more than one
    negative-advantage trained token in the dual-clip regime, i.e. sum_t M [dual_t and A_t < 0] > 1."""
    adv = as_token_advantages(advantages)
    bad = (is_dual_clipped & (adv < 0)).expand(mask.shape) & (mask > 0)
    keep = bad.sum(-1, keepdim=True) <= 1
    return keep.to(torch.float32 if not mask.is_floating_point() else mask.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------------------------


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean entropy sum M H / max(sum M, 1); the loss subtracts ``entropy_coef`` times it."""
    m = _float_mask(mask, entropies)
    return (entropies * m).sum() / m.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LossSpec:
    """Which building blocks :func:`compute_policy_loss` composes. Defaults = TRL ``grpo`` with beta = 0."""

    ratio_level: str = "token"
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_ratio_c: float | None = None
    ratio_cap: float | None = None
    aggregation: str = "seq_mean_token_mean"
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_correction: bool = False  # TRL's use_bias_correction_kl: KL_t * r (unbiased reverse-KL gradient)
    veto_scope: str | None = None
    veto_threshold: float = 1e-4
    fipo: bool = False
    fipo_tau: float = 32.0
    fipo_c: float = 10.0
    fipo_clip_low: float = 1.0
    fipo_clip_high: float = 1.2
    fipo_safety_ratio: float = 10.0
    fipo_drop_multi_dual_clip: bool = True
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        _lookup("ratio level", self.ratio_level, RATIO_LEVELS)
        _lookup("aggregation", self.aggregation, AGGREGATIONS)
        _lookup("KL estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.veto_scope is not None:
            _lookup("veto scope", self.veto_scope, VETO_SCOPES)

        def bad(name: str, rule: str) -> None:
            raise ConfigError(f"{name} must be {rule}; got {getattr(self, name)!r}.")

        if not 0.0 <= self.eps_low <= 1.0:
            bad("eps_low", "in [0, 1] (the lower ratio bound 1 - eps_low must be >= 0)")
        if not self.eps_high >= 0.0:
            bad("eps_high", ">= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            bad("clip_ratio_c", "None or > 1")
        if self.ratio_cap is not None and not self.ratio_cap > 1.0 + self.eps_high:
            bad("ratio_cap", f"None or > 1 + eps_high = {1.0 + self.eps_high}")
        if not self.beta >= 0.0:
            bad("beta", ">= 0")
        if not self.veto_threshold > 0.0:
            bad("veto_threshold", "> 0")
        if not self.fipo_tau > 0.0:
            bad("fipo_tau", "> 0")
        if not self.fipo_c > 0.0:
            bad("fipo_c", "> 0")
        if not 0.0 <= self.fipo_clip_low <= self.fipo_clip_high:
            bad("fipo_clip_low", f"in [0, fipo_clip_high = {self.fipo_clip_high}]")
        if not self.fipo_safety_ratio > 0.0:
            bad("fipo_safety_ratio", "> 0")


@dataclass
class LossOutput:
    """``loss``: scalar, aggregated, before any grad-accumulation scaling; ``per_token_loss``: (B, T)
    final per-token loss that was aggregated; ``stats``: detached tensors for metrics."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def compute_policy_loss(
    spec: LossSpec,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    num_items=None,
    max_completion_length: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Policy loss of one micro-batch.

    Order: log-ratio at ``spec.ratio_level`` -> r = exp(.) -> (FIPO: A_t = A f_t) -> clipped
    surrogate with cap / dual clip -> (FIPO: drop responses with > 1 dual-clipped negative token)
    -> (veto: multiply by the µ-GRPO keep mask) -> + beta * kl_t -> aggregate -> - entropy_coef *
    entropy_bonus. ``token_weights`` ((B, T) or (B, 1), optional) multiplies the policy term after
    the veto and before the KL, in TRL's order (off-policy sequence mask, high-entropy token mask,
    vLLM importance-sampling ratio). ``old_logp=None`` means on-policy (old = sg(logp)), as in TRL.

    Veto triggers and FIPO's delta / safety ratio always use the TOKEN ratio pi_theta / pi_old,
    whatever ``ratio_level``. The veto and the FIPO drop only remove the policy-gradient term; the
    KL term (beta > 0) still acts on those tokens. The entropy bonus uses ``mask``.

    Stats (detached): ``ratio`` ((B, T) or (B, 1)), ``is_low_clipped``, ``is_high_clipped``,
    ``is_dual_clipped`` (bool, shape of the surrogate), ``is_capped`` (A < 0 and r > ratio_cap: zero
    gradient from the cap), ``veto_triggers`` / ``vetoed`` (bool (B, T); all False when the veto is
    off), ``fipo_weights`` and ``fipo_dropped`` ((B, 1) bool) if ``spec.fipo``, ``kl`` if beta > 0,
    and ``useful`` (bool (B, T)): trained tokens whose POLICY-GRADIENT term is non-zero, i.e.
    M & not low/high/dual-clipped & not capped & not vetoed & not FIPO-dropped & A != 0. With
    beta > 0 a token outside ``useful`` (e.g. A = 0) still gets the KL gradient.
    """
    if old_logp is None:
        old_logp = logp.detach()
    adv = as_token_advantages(advantages).to(logp.dtype)
    m = _float_mask(mask, logp)
    mb = mask > 0
    stats: dict[str, torch.Tensor] = {}

    log_ratio = compute_log_ratio(spec.ratio_level, logp, old_logp, mask)
    ratio = torch.exp(log_ratio)
    stats["ratio"] = ratio.detach()
    token_ratio = torch.exp((logp - old_logp).detach())

    if spec.fipo:
        f = fipo_weights(
            logp, old_logp, mask, adv, ratio=token_ratio, tau=spec.fipo_tau, c=spec.fipo_c,
            clip_low=spec.fipo_clip_low, clip_high=spec.fipo_clip_high, safety_ratio=spec.fipo_safety_ratio,
        )
        stats["fipo_weights"] = f
        adv = adv * f

    sur = clipped_surrogate(ratio, adv, spec.eps_low, spec.eps_high, spec.clip_ratio_c, spec.ratio_cap)
    per_token_loss = sur.per_token_loss
    stats["is_low_clipped"] = sur.is_low_clipped
    stats["is_high_clipped"] = sur.is_high_clipped
    stats["is_dual_clipped"] = sur.is_dual_clipped
    if spec.ratio_cap is not None:
        capped = ((ratio.detach() > spec.ratio_cap) & (adv < 0)).expand(per_token_loss.shape)
    else:
        capped = torch.zeros(per_token_loss.shape, dtype=torch.bool, device=logp.device)
    stats["is_capped"] = capped
    dead = sur.is_low_clipped | sur.is_high_clipped | sur.is_dual_clipped | capped | (adv == 0)

    keep = torch.ones_like(m)
    if spec.fipo:
        if spec.fipo_drop_multi_dual_clip:
            drop_keep = fipo_drop_mask(sur.is_dual_clipped, adv, mask).to(m.dtype)
        else:
            drop_keep = torch.ones(m.shape[0], 1, dtype=m.dtype, device=m.device)
        stats["fipo_dropped"] = drop_keep == 0
        per_token_loss = per_token_loss * drop_keep
        keep = keep * drop_keep

    if spec.veto_scope is not None:
        triggers = veto_triggers(token_ratio, as_token_advantages(advantages), mask, spec.veto_threshold)
        veto_keep = veto_keep_mask(triggers, mask, spec.veto_scope).to(m.dtype)
        per_token_loss = per_token_loss * veto_keep
        keep = keep * veto_keep
        stats["veto_triggers"] = triggers
        stats["vetoed"] = mb & (veto_keep == 0)
    else:
        stats["veto_triggers"] = torch.zeros(mask.shape, dtype=torch.bool, device=logp.device)
        stats["vetoed"] = torch.zeros(mask.shape, dtype=torch.bool, device=logp.device)

    if token_weights is not None:
        token_weights = token_weights.to(per_token_loss.dtype)
        per_token_loss = per_token_loss * token_weights
        keep = keep * (token_weights.detach() != 0).to(keep.dtype)
    per_token_loss = per_token_loss.expand(m.shape) if per_token_loss.shape != m.shape else per_token_loss
    if spec.beta != 0.0:
        if ref_logp is None:
            raise ConfigError("beta > 0 needs ref_logp (the reference model's per-token log-probs).")
        kl = get_kl_estimator(spec.kl_estimator)(logp, ref_logp)
        if spec.kl_ratio_correction:  # DeepSeek-V3.2 / TRL use_bias_correction_kl: weight by the (live) ratio
            kl = kl * ratio
        stats["kl"] = kl.detach()  # the KL term actually added (ratio-weighted when corrected), as TRL logs it
        per_token_loss = per_token_loss + spec.beta * kl

    loss = aggregate(
        per_token_loss, mask, spec.aggregation, num_items=num_items, max_completion_length=max_completion_length
    )
    if spec.entropy_coef != 0.0:
        if entropies is None:
            raise ConfigError("entropy_coef != 0 needs entropies (per-token entropies of the policy).")
        loss = loss - spec.entropy_coef * entropy_bonus(entropies, mask)

    stats["useful"] = (mb & ~dead.expand(m.shape) & (keep > 0).expand(m.shape)).detach()
    return LossOutput(loss=loss, per_token_loss=per_token_loss, stats=stats)
