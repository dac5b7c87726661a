"""Unit tests of grpo_variants.losses: hand-computed values, gradients, and a TRL-formula equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_variants.errors import ConfigError, UnknownLossError
from grpo_variants.losses import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    RATIO_LEVELS,
    VETO_SCOPES,
    LossSpec,
    aggregate,
    batch_std_advantages,
    clipped_surrogate,
    compute_log_ratio,
    compute_policy_loss,
    discounted_future_sum,
    entropy_bonus,
    fipo_drop_mask,
    fipo_weights,
    get_advantage_estimator,
    get_aggregation,
    get_kl_estimator,
    group_mean_advantages,
    group_std_advantages,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    relaxed_clip_eps,
    sequence_log_ratio,
    sequence_token_log_ratio,
    token_log_ratio,
    veto_keep_mask,
    veto_triggers,
)

D = torch.float64
NAN = float("nan")


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def test_group_std_hand_values_and_zero_std_group():
    # group 1: mean 2, unbiased std 1; group 2: all equal -> exactly 0
    a = group_std_advantages(t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3)
    close(a, [-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0])
    assert (a[3:] == 0.0).all()
    # eps is honoured
    close(group_std_advantages(t([0.0, 2.0]), 2, eps=0.5), [-1 / (math.sqrt(2) + 0.5), 1 / (math.sqrt(2) + 0.5)])


def test_group_std_nan_rewards_are_ignored_and_get_zero():
    # group 1 scorable {1, 3}: mean 2, unbiased std sqrt(2); group 2 has one scorable reward: std undefined -> 0;
    # group 3 is all NaN -> 0
    r = t([1.0, NAN, 3.0, 4.0, NAN, NAN, NAN, NAN, NAN])
    a = group_std_advantages(r, 3)
    s = math.sqrt(2) + 1e-4
    close(a, [-1 / s, 0.0, 1 / s, 0, 0, 0, 0, 0, 0])
    assert not torch.isnan(a).any()
    close(group_mean_advantages(t([1.0, NAN, 3.0]), 3), [-1.0, 0.0, 1.0])


def test_group_mean_and_batch_std_hand_values():
    r = t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    close(group_mean_advantages(r, 3), [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    # batch mean 3.5, squared deviations sum 15.5, unbiased var 15.5 / 5 = 3.1
    sd = math.sqrt(3.1) + 1e-4
    close(batch_std_advantages(r, 3), [-1 / sd, 0.0, 1 / sd, 0.0, 0.0, 0.0])
    close(batch_std_advantages(t([1.0, NAN, 3.0, 3.0]), 2), [0.0, 0.0, 0.0, 0.0])  # group 2 equal, NaN -> 0


def test_group_size_one_gives_zero_and_bad_group_size_raises():
    close(group_std_advantages(t([3.0, -1.0]), 1), [0.0, 0.0])
    with pytest.raises(ConfigError, match="group_size"):
        group_std_advantages(t([1.0, 2.0, 3.0]), 2)


def test_advantage_registry():
    assert set(ADVANTAGE_ESTIMATORS) == {"group_std", "group_mean", "batch_std"}
    assert get_advantage_estimator("group_mean") is group_mean_advantages
    with pytest.raises(UnknownLossError, match="group_std.*group_mean.*batch_std"):
        get_advantage_estimator("rloo")


# ---------------------------------------------------------------------------------------------------------------
# Ratios
# ---------------------------------------------------------------------------------------------------------------

LOGP = [[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0]]
OLD = [[-1.5, -2.0, -2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # row 1: single-token completion, row 2: fully masked


def test_ratio_hand_values():
    logp, old, mask = t(LOGP), t(OLD), torch.tensor(MASK)
    close(token_log_ratio(logp, old), [[0.5, 0.0, -1.0], [0.5, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    close(sequence_log_ratio(logp, old, mask), [[-1 / 6], [0.5], [0.0]])
    close(sequence_token_log_ratio(logp, old, mask), [[-1 / 6] * 3, [0.5] * 3, [0.0] * 3])
    assert sequence_log_ratio(logp, old, mask).shape == (3, 1)
    for level in ("token", "sequence", "sequence_token"):
        close(compute_log_ratio(level, logp, old, mask), RATIO_LEVELS[level](logp, old, mask))
    with pytest.raises(UnknownLossError, match="token.*sequence.*sequence_token"):
        compute_log_ratio("group", logp, old, mask)


def test_gspo_sequence_vs_sequence_token_log_ratio_jacobians():
    torch.manual_seed(0)
    old = torch.randn(3, 4, dtype=D)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    jac_seq = torch.autograd.functional.jacobian(lambda lp: sequence_log_ratio(lp, old, mask).expand(3, 4), old + 0.1)
    jac_tok = torch.autograd.functional.jacobian(lambda lp: sequence_token_log_ratio(lp, old, mask), old + 0.1)
    # row 0: d log s_0 / d logp_{0,k} = M_k / 3 for every output position; GSPO-token: identity
    close(jac_seq[0, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0.0])
    close(jac_seq[0, 2, 0], [1 / 3, 1 / 3, 1 / 3, 0.0])
    close(jac_tok[0, 0, 0], [1.0, 0.0, 0.0, 0.0])
    close(jac_tok[0, 2, 0], [0.0, 0.0, 1.0, 0.0])
    assert not torch.allclose(jac_seq, jac_tok)


def test_gspo_sequence_vs_sequence_token_losses():
    torch.manual_seed(1)
    B, T = 4, 5
    old = torch.randn(B, T, dtype=D)
    base = old + 0.05 * torch.randn(B, T, dtype=D)
    mask = t([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])

    def run(level, adv):
        lp = base.clone().requires_grad_(True)
        out = compute_policy_loss(LossSpec(ratio_level=level, eps_low=3e-4, eps_high=4e-4), lp, old, adv, mask)
        out.loss.backward()
        return out.loss.detach(), lp.grad

    # per-token advantages: same forward value, different per-token gradients
    adv_tok = torch.randn(B, T, dtype=D)
    (ls, gs), (lt, gt) = run("sequence", adv_tok), run("sequence_token", adv_tok)
    close(ls, lt)
    assert (gs - gt).abs().max() > 1e-3
    # sequence level spreads the gradient uniformly over a row's trained tokens
    close(gs[0, :4], gs[0, :1].expand(4))
    # per-sequence advantages: GSPO-token reduces to GSPO (same value and same gradient, paper's identity)
    adv_seq = torch.randn(B, dtype=D)
    (ls, gs), (lt, gt) = run("sequence", adv_seq), run("sequence_token", adv_seq)
    close(ls, lt)
    close(gs, gt)


# ---------------------------------------------------------------------------------------------------------------
# Clipped surrogate
# ---------------------------------------------------------------------------------------------------------------


def test_surrogate_hand_values_and_masks():
    r = t([0.5, 0.8, 1.0, 1.2, 1.5])
    pos = clipped_surrogate(r, t([1.0]), 0.2, 0.2)
    close(pos.per_token_loss, [[-0.5, -0.8, -1.0, -1.2, -1.2]])
    assert pos.is_high_clipped.tolist() == [[False, False, False, False, True]]
    assert not pos.is_low_clipped.any() and not pos.is_dual_clipped.any()
    neg = clipped_surrogate(r, t([-1.0]), 0.2, 0.2)
    close(neg.per_token_loss, [[0.8, 0.8, 1.0, 1.2, 1.5]])
    assert neg.is_low_clipped.tolist() == [[True, False, False, False, False]]
    assert not neg.is_high_clipped.any()
    # asymmetric: eps_high = 0.28 and a (B, 1) advantage against (B, T) ratios; masks take the loss's shape
    out = clipped_surrogate(t([[1.25, 1.3], [0.75, 0.7]]), t([[2.0], [-2.0]]), 0.2, 0.28)
    close(out.per_token_loss, [[-2.5, -2.56], [1.6, 1.6]])
    assert out.is_high_clipped.tolist() == [[False, True], [False, False]]
    assert out.is_low_clipped.tolist() == [[False, False], [True, True]]
    assert out.is_dual_clipped.shape == (2, 2)
    # A = 0: zero loss, nothing clipped
    z = clipped_surrogate(t([0.1, 5.0]), t([0.0]), 0.2, 0.2, clip_ratio_c=3.0)
    assert (z.per_token_loss == 0).all() and not (z.is_low_clipped | z.is_high_clipped | z.is_dual_clipped).any()


def test_surrogate_at_exact_clip_bounds_is_not_clipped_and_passes_gradient():
    r = torch.tensor([[1 - 0.2, 1 + 0.28]], dtype=D, requires_grad=True)
    adv = t([[-1.0, 1.0]])  # per-token advantages
    out = clipped_surrogate(r, adv, 0.2, 0.28)
    assert not out.is_low_clipped.any() and not out.is_high_clipped.any()
    close(out.per_token_loss, [[0.8, -1.28]])
    out.per_token_loss.sum().backward()
    close(r.grad, [[1.0, -1.0]])  # torch.clamp has an inclusive-bound gradient: d l / d r = -A


def test_surrogate_gradient_zero_in_clipped_region():
    r = torch.tensor([[0.5, 1.5, 0.5, 1.5]], dtype=D, requires_grad=True)
    clipped_surrogate(r, t([[-1.0, 1.0, 1.0, -1.0]]), 0.2, 0.2).per_token_loss.sum().backward()
    close(r.grad, [[0.0, 0.0, -1.0, 1.0]])


def test_dual_clip_hand_values():
    r = torch.tensor([0.5, 2.0, 3.0, 5.0], dtype=D, requires_grad=True)
    out = clipped_surrogate(r, t([-1.0]), 0.2, 0.2, clip_ratio_c=3.0)
    close(out.per_token_loss, [[0.8, 2.0, 3.0, 3.0]])  # bound c|A| = 3
    assert out.is_dual_clipped.tolist() == [[False, False, False, True]]  # strict: r = c is not dual-clipped
    assert out.is_low_clipped.tolist() == [[True, False, False, False]]
    r.grad = None
    out = clipped_surrogate(r, t([-1.0]), 0.2, 0.2, clip_ratio_c=3.0)
    out.per_token_loss[0, [0, 1, 3]].sum().backward()
    close(r.grad, [0.0, 1.0, 0.0, 0.0])
    # A > 0 is never dual-clipped
    pos = clipped_surrogate(t([5.0]), t([1.0]), 0.2, 0.2, clip_ratio_c=3.0)
    close(pos.per_token_loss, [[-1.2]])
    assert not pos.is_dual_clipped.any()


def test_ratio_cap_two_sided_clipping():
    r = torch.tensor([[3.0, 3.0, 1.5]], dtype=D, requires_grad=True)
    out = clipped_surrogate(r, t([[-1.0, 1.0, -1.0]]), 0.2, 0.2, ratio_cap=2.0)
    close(out.per_token_loss, [[2.0, -1.2, 1.5]])
    out.per_token_loss.sum().backward()
    close(r.grad, [[0.0, 0.0, 1.0]])


def test_surrogate_gradcheck_away_from_kinks():
    r = torch.tensor([[0.5, 0.9, 1.1, 1.5, 2.5, 4.0], [0.5, 0.9, 1.1, 1.5, 2.5, 4.0]], dtype=D, requires_grad=True)
    adv = t([[0.7], [-1.3]])
    assert torch.autograd.gradcheck(lambda x: clipped_surrogate(x, adv, 0.2, 0.28).per_token_loss, (r,))
    assert torch.autograd.gradcheck(lambda x: clipped_surrogate(x, adv, 0.2, 0.28, 3.0).per_token_loss, (r,))
    assert torch.autograd.gradcheck(lambda x: clipped_surrogate(x, adv, 0.2, 0.28, 3.0, 3.5).per_token_loss, (r,))
    a = torch.tensor([[0.7], [-1.3]], dtype=D, requires_grad=True)  # advantages, too
    assert torch.autograd.gradcheck(lambda y: clipped_surrogate(r.detach(), y, 0.2, 0.28, 3.0).per_token_loss, (a,))


def test_relaxed_clip_eps():
    assert relaxed_clip_eps(0.0, 5.0) == (1.0, 4.0)
    lo, hi = relaxed_clip_eps(0.8, 1.2)
    close([lo, hi], [0.2, 0.2], tol=1e-12)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ConfigError, match="mu_clip_lower"):
            relaxed_clip_eps(bad, 5.0)
    for bad in (1.0, 0.5):
        with pytest.raises(ConfigError, match="mu_clip_upper"):
            relaxed_clip_eps(0.0, bad)


# ---------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------

PTL = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AMASK = [[1, 1, 0], [1, 1, 0], [0, 0, 0]]


def test_aggregation_hand_values():
    ptl, mask = t(PTL), torch.tensor(AMASK)
    close(aggregate(ptl, mask, "seq_mean_token_mean"), (1.5 + 4.5 + 0.0) / 3)  # masked row counts
    close(aggregate(ptl, mask, "token_mean"), 12 / 4)  # bnpo: local token count
    close(aggregate(ptl, mask, "token_mean", num_items=8), 12 / 8)
    close(aggregate(ptl, mask, "token_mean", num_items=torch.tensor(8.0)), 12 / 8)
    close(aggregate(ptl, mask, "seq_mean_token_sum"), (3 + 9 + 0) / 3)
    close(aggregate(ptl, mask, "constant", max_completion_length=5), 12 / (3 * 5))
    with pytest.raises(ConfigError, match="max_completion_length"):
        aggregate(ptl, mask, "constant")
    with pytest.raises(UnknownLossError, match="seq_mean_token_mean.*token_mean.*seq_mean_token_sum.*constant"):
        aggregate(ptl, mask, "sum")
    assert get_aggregation("token_mean") is AGGREGATIONS["token_mean"]


def test_aggregation_edge_cases():
    # fully masked batch -> 0 (no NaN); single-token completion
    zero = torch.zeros(2, 3)
    for mode in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum"):
        assert aggregate(t(PTL[:2]), zero, mode).item() == 0.0
    one = torch.tensor([[1, 0, 0]])
    for mode in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum"):
        close(aggregate(t([[5.0, 99.0, 99.0]]), one, mode), 5.0)
    # a (B, 1) sequence-level loss: seq_mean_token_mean gives the per-sequence value (GSPO), token sums weight
    # by length (the pitfall docs/algorithms.md, "GSPO", warns about)
    seq = t([[2.0], [3.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(aggregate(seq, m, "seq_mean_token_mean"), 2.5)
    close(aggregate(seq, m, "seq_mean_token_sum"), (6 + 3) / 2)
    close(aggregate(t([[2.0], [3.0], [7.0]]), torch.tensor(AMASK), "seq_mean_token_mean"), 5 / 3)


def test_aggregation_gradcheck():
    torch.manual_seed(2)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    m = t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    for mode in AGGREGATIONS:
        assert torch.autograd.gradcheck(lambda y: aggregate(y, m, mode, num_items=5, max_completion_length=4), (x,))
    aggregate(x, m, "seq_mean_token_mean").backward()
    close(x.grad, [[1 / 6, 1 / 6, 0, 0], [1 / 12] * 4, [0, 0, 0, 0]])


# ---------------------------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------------------------


def test_kl_hand_values():
    logp, ref = t([0.0, -1.0]), t([-1.0, 0.0])
    close(kl_k1(logp, ref), [1.0, -1.0])
    close(kl_k2(logp, ref), [0.5, 0.5])
    close(kl_k3(logp, ref), [math.exp(-1), math.e - 2])
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"} and get_kl_estimator("k3") is kl_k3
    with pytest.raises(UnknownLossError, match="k1.*k2.*k3"):
        get_kl_estimator("k4")


def test_k3_nonnegative_and_zero_at_equality():
    torch.manual_seed(3)
    a, b = torch.randn(1000, dtype=D) * 3, torch.randn(1000, dtype=D) * 3
    assert (kl_k3(a, b) >= 0).all()
    assert (kl_k3(a, a) == 0).all() and (kl_k2(a, a) == 0).all() and (kl_k1(a, a) == 0).all()


def test_kl_in_reward():
    kl = t([[0.5, 1.0, 9.0], [2.0, 0.0, 0.0]])
    r = kl_penalized_rewards(t([1.0, 2.0]), kl, torch.tensor([[1, 1, 0], [1, 0, 0]]), 0.1)
    close(r, [0.85, 1.8])


# ---------------------------------------------------------------------------------------------------------------
# µ-GRPO veto
# ---------------------------------------------------------------------------------------------------------------

TINY = 1e-5
VRATIO = [
    [TINY, 1.0, 1.0, TINY, 1.0],  # A < 0, triggers at the first token and at 3
    [1.0, 1.0, 1.0, TINY, TINY],  # A < 0, trigger at the last trained token (position 4 is masked)
    [1.0, TINY, 1.0, 1.0, 1.0],  # A > 0: never a trigger
    [1.0, 1.0, 1.0, 1.0, 1.0],  # A < 0, no trigger
]
VADV = [-1.0, -0.5, 1.0, -1.0]
VMASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
EXPECTED_KEEP = {
    "T": [[0, 1, 1, 0, 1], [1, 1, 1, 0, 1], [1] * 5, [1] * 5],
    "S_kappa": [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1] * 5, [1] * 5],  # after kappa: kappa itself kept
    "H_kappa": [[1, 0, 0, 1, 0], [1, 1, 1, 1, 1], [1] * 5, [1] * 5],
    "S_seq": [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [1] * 5, [1] * 5],
}


def test_veto_triggers():
    trig = veto_triggers(t(VRATIO), t(VADV), torch.tensor(VMASK))
    assert trig.tolist() == [
        [True, False, False, True, False],
        [False, False, False, True, False],
        [False] * 5,
        [False] * 5,
    ]
    # strict threshold, per-token advantages
    trig = veto_triggers(t([[1e-4, 0.9e-4]]), t([[-1.0, -1.0]]), torch.ones(1, 2))
    assert trig.tolist() == [[False, True]]
    assert not veto_triggers(t([[TINY, TINY]]), t([[-1.0, 0.0]]), torch.ones(1, 2))[0, 1]


@pytest.mark.parametrize("scope", list(EXPECTED_KEEP))
def test_veto_keep_mask_every_scope(scope):
    mask = torch.tensor(VMASK)
    trig = veto_triggers(t(VRATIO), t(VADV), mask)
    keep = veto_keep_mask(trig, mask, scope)
    assert keep.tolist() == EXPECTED_KEEP[scope]
    assert keep.dtype.is_floating_point
    assert (keep[2:] == 1).all()  # A >= 0 row and trigger-free row untouched


def test_veto_scope_relations_and_registry():
    torch.manual_seed(4)
    mask = (torch.rand(6, 9) > 0.2).long()
    trig = (torch.rand(6, 9) > 0.8) & (mask > 0)
    drop = {s: (veto_keep_mask(trig, mask, s) == 0) for s in VETO_SCOPES}
    assert torch.equal(drop["T"], trig)
    assert torch.equal(drop["H_kappa"], drop["S_kappa"] & ~trig)  # H = S_kappa \ T
    assert not (drop["S_kappa"] & ~drop["S_seq"]).any()
    kappa = torch.where(trig, torch.arange(9), torch.full((6, 9), 9)).min(-1, keepdim=True).values
    assert torch.equal(drop["S_kappa"], (torch.arange(9) > kappa) & (mask > 0))  # exclusive of kappa
    assert not (drop["S_kappa"] & (torch.arange(9) == kappa)).any()
    assert set(VETO_SCOPES) == {"T", "S_kappa", "H_kappa", "S_seq"}
    with pytest.raises(UnknownLossError, match="T.*S_kappa.*H_kappa.*S_seq"):
        veto_keep_mask(trig, mask, "prefix")


def test_veto_gradient_is_exactly_zero_on_vetoed_tokens():
    mask = torch.tensor(VMASK)
    old = torch.zeros(4, 5, dtype=D)
    logp = torch.log(t(VRATIO)).requires_grad_(True)
    lo, hi = relaxed_clip_eps(0.0, 5.0)  # relaxed bounds so trigger tokens themselves still carry gradient
    out = compute_policy_loss(LossSpec(eps_low=lo, eps_high=hi, veto_scope="H_kappa"), logp, old, t(VADV), mask)
    out.loss.backward()
    keep = t(EXPECTED_KEEP["H_kappa"]) * mask
    assert (logp.grad[keep == 0] == 0.0).all()
    assert (logp.grad[keep == 1] != 0.0).all()
    assert out.stats["vetoed"].tolist() == ((keep == 0) & (mask > 0)).tolist()
    assert out.stats["veto_triggers"][0].tolist() == [True, False, False, True, False]
    # veto off: the same tokens do get gradient
    logp.grad = None
    compute_policy_loss(LossSpec(eps_low=lo, eps_high=hi), logp, old, t(VADV), mask).loss.backward()
    assert (logp.grad[mask > 0] != 0).all()


# ---------------------------------------------------------------------------------------------------------------
# FIPO
# ---------------------------------------------------------------------------------------------------------------


def loop_future_sum(x, gamma):
    B, T = x.shape
    out = torch.zeros_like(x)
    for b in range(B):
        for i in range(T):
            out[b, i] = sum(gamma ** (k - i) * x[b, k].item() for k in range(i, T))
    return out


def loop_fipo(logp, old, mask, adv, tau, c, lo, hi, safety):
    gamma = 2 ** (-1 / tau)
    B, T = logp.shape
    out = torch.ones(B, T, dtype=D)
    for b in range(B):
        for i in range(T):
            if mask[b, i] == 0:
                continue
            fk = 0.0
            for k in range(i, T):
                d = min(max((logp[b, k] - old[b, k]).item(), -20.0), 20.0)
                if mask[b, k] and d <= math.log(c):
                    fk += gamma ** (k - i) * d
            f = min(max(math.exp(fk), lo), hi)
            if adv[b] < 0 and math.exp((logp[b, i] - old[b, i]).item()) > safety:
                f = min(max(f, 0.8), 1.0)
            out[b, i] = f
    return out


@pytest.mark.parametrize("chunk", [1, 3, 4, 13, 256])
def test_discounted_future_sum_matches_loop(chunk):
    torch.manual_seed(5)
    x = torch.randn(3, 13, dtype=D)
    close(discounted_future_sum(x, 0.8, chunk_size=chunk), loop_future_sum(x, 0.8), tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lo", [1.0, 0.8])
def test_fipo_weights_match_double_loop(seed, lo):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 11
    old = torch.randn(B, T, generator=g, dtype=D)
    delta = 0.4 * torch.randn(B, T, generator=g, dtype=D)
    delta[0, 3], delta[1, 0], delta[2, 7] = 3.0, 2.5, 25.0  # excluded (> log 10), r > 10 for the safety rule
    logp = old + delta
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[:, 0] = 1
    adv = t([-1.0, 1.0, -0.5, 0.3])
    tau = [4.0, 32.0, 1.0][seed]
    w = fipo_weights(logp, old, mask, adv, tau=tau, clip_low=lo)
    close(w, loop_fipo(logp, old, mask, adv, tau, 10.0, lo, 1.2, 10.0), tol=1e-12)
    m = mask > 0
    assert (w[m] >= lo).all() and (w[m] <= 1.2).all() and (w[~m] == 1.0).all()
    assert not w.requires_grad


def test_fipo_hand_values_upward_vs_symmetric():
    # delta = [0.1, -0.2, 0.05], tau = 1 -> gamma = 0.5: F = [0.0125, -0.175, 0.05]
    old = torch.zeros(1, 3, dtype=D)
    logp = t([[0.1, -0.2, 0.05]])
    m = torch.ones(1, 3)
    up = fipo_weights(logp, old, m, t([1.0]), tau=1.0)
    sym = fipo_weights(logp, old, m, t([1.0]), tau=1.0, clip_low=0.8)
    close(up, [[math.exp(0.0125), 1.0, math.exp(0.05)]])
    close(sym, [[math.exp(0.0125), math.exp(-0.175), math.exp(0.05)]])
    close(fipo_weights(t([[0.5, 0.5]]), torch.zeros(1, 2, dtype=D), torch.ones(1, 2), t([1.0]), tau=1.0), [[1.2, 1.2]])


def test_fipo_safety_clamp():
    # delta = [3, 1]: token 0 excluded from M' (3 > log 10) but r = e^3 > 10; F_0 = gamma * 1 -> exp > 1.2
    old = torch.zeros(1, 2, dtype=D)
    logp = t([[3.0, 1.0]])
    m = torch.ones(1, 2)
    close(fipo_weights(logp, old, m, t([-1.0])), [[1.0, 1.2]])  # A < 0 and r > 10: clamped to [0.8, 1]
    close(fipo_weights(logp, old, m, t([1.0])), [[1.2, 1.2]])  # A > 0: no safety clamp
    close(fipo_weights(logp, old, m, t([-1.0]), safety_ratio=30.0), [[1.2, 1.2]])


def test_fipo_drop_mask():
    dual = torch.tensor([[True, True, False], [False, True, False], [True, True, False], [True, True, True]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 1]])
    keep = fipo_drop_mask(dual, t([-1.0, -1.0, -1.0, 1.0]), mask)
    assert keep.shape == (4, 1)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0, 1.0]


def test_fipo_in_compute_policy_loss():
    torch.manual_seed(6)
    B, T = 3, 6
    old = torch.randn(B, T, dtype=D)
    logp = (old + 0.3 * torch.randn(B, T, dtype=D)).requires_grad_(True)
    mask = torch.ones(B, T)
    adv = t([0.5, -1.0, 1.5])
    spec = LossSpec(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, aggregation="token_mean", fipo=True, fipo_tau=4.0)
    out = compute_policy_loss(spec, logp, old, adv, mask)
    f = fipo_weights(logp, old, mask, adv, tau=4.0)
    close(out.stats["fipo_weights"], f)
    expected = clipped_surrogate(torch.exp(logp - old), adv[:, None] * f, 0.2, 0.28, 10.0).per_token_loss.mean()
    close(out.loss, expected)
    assert not out.stats["fipo_dropped"].any()
    # a negative response with two tokens in the dual-clip regime (r > c) is dropped, a one-token one is not
    lp = old.detach().clone()
    lp[1, 1:3] += 3.0
    lp[0, 4] += 3.0
    out = compute_policy_loss(spec, lp, old, t([-1.0, -1.0, 1.0]), mask)
    assert out.stats["fipo_dropped"].flatten().tolist() == [False, True, False]
    assert (out.per_token_loss[1] == 0).all() and out.per_token_loss[0, 4] == 10.0 * f.new_tensor(1.0)


# ---------------------------------------------------------------------------------------------------------------
# Entropy, spec validation, stats
# ---------------------------------------------------------------------------------------------------------------


def test_entropy_bonus():
    close(entropy_bonus(t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]])), 1.5)
    assert entropy_bonus(t([[1.0, 2.0]]), torch.zeros(1, 2)).item() == 0.0
    lp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    ent = t([[1.0, 3.0]])
    out = compute_policy_loss(LossSpec(entropy_coef=0.1), lp, None, t([0.0]), torch.ones(1, 2), entropies=ent)
    close(out.loss, -0.2)
    with pytest.raises(ConfigError, match="entropies"):
        compute_policy_loss(LossSpec(entropy_coef=0.1), lp, None, t([0.0]), torch.ones(1, 2))


@pytest.mark.parametrize(
    "kwargs, err, field",
    [
        ({"ratio_level": "group"}, UnknownLossError, "ratio level"),
        ({"aggregation": "sum"}, UnknownLossError, "aggregation"),
        ({"kl_estimator": "k9"}, UnknownLossError, "KL estimator"),
        ({"veto_scope": "all"}, UnknownLossError, "veto scope"),
        ({"clip_ratio_c": 0.5}, ConfigError, "clip_ratio_c"),
        ({"ratio_cap": 1.1}, ConfigError, "ratio_cap"),
        ({"eps_low": 1.5}, ConfigError, "eps_low"),
        ({"eps_high": -0.1}, ConfigError, "eps_high"),
        ({"beta": -1.0}, ConfigError, "beta"),
        ({"veto_threshold": 0.0}, ConfigError, "veto_threshold"),
        ({"fipo_tau": 0.0}, ConfigError, "fipo_tau"),
        ({"fipo_clip_low": 1.3}, ConfigError, "fipo_clip_low"),
    ],
)
def test_loss_spec_validation(kwargs, err, field):
    with pytest.raises(err, match=field):
        LossSpec(**kwargs)


def test_unknown_loss_error_is_keyerror_and_valueerror():
    with pytest.raises(KeyError):
        LossSpec(aggregation="nope")
    with pytest.raises(ValueError, match="Valid names"):
        LossSpec(aggregation="nope")


def test_beta_needs_ref_logp():
    with pytest.raises(ConfigError, match="ref_logp"):
        compute_policy_loss(LossSpec(beta=0.1), torch.zeros(1, 2), None, t([1.0]), torch.ones(1, 2))


def test_useful_mask_hand_case():
    old = torch.zeros(1, 7, dtype=D)
    # tokens: normal, low-clipped (A<0), masked, normal, capped (r > delta, A<0), dual-clipped (r > c), trigger
    ratio = t([[1.0, 0.5, 1.0, 1.1, 3.0, 6.0, 1e-5]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1]])
    spec = LossSpec(clip_ratio_c=5.0, ratio_cap=2.5, veto_scope="T")
    out = compute_policy_loss(spec, torch.log(ratio), old, t([[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]), mask)
    assert out.stats["useful"].tolist() == [[True, False, False, True, False, False, False]]
    assert out.stats["is_low_clipped"].tolist() == [[False, True, False, False, False, False, True]]
    assert out.stats["is_capped"].tolist() == [[False, False, False, False, True, True, False]]
    assert out.stats["vetoed"].tolist() == [[False, False, False, False, False, False, True]]
    # A = 0 row: nothing useful; with beta > 0 those tokens still get the KL gradient
    lp = torch.log(t([[1.0, 1.1]])).requires_grad_(True)
    zeros = torch.zeros(1, 2, dtype=D)
    out = compute_policy_loss(LossSpec(beta=0.1), lp, zeros, t([0.0]), torch.ones(1, 2), ref_logp=zeros)
    assert not out.stats["useful"].any()
    out.loss.backward()
    assert lp.grad[0, 1] != 0 and "kl" in out.stats


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_useful_equals_nonzero_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 8
    old = torch.randn(B, T, generator=g, dtype=D)
    delta = torch.randn(B, T, generator=g, dtype=D)
    delta[delta < -2.0] = -12.0  # some veto triggers
    logp = (old + delta).requires_grad_(True)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    adv = torch.randn(B, generator=g, dtype=D)
    adv[0] = 0.0
    adv[1], adv[2] = -1.0, 1.0
    delta[1:3, 2] = -12.0  # a sure trigger (A < 0) and a tiny ratio that is no trigger (A > 0)
    mask[1:3, 2:] = 1
    logp = (old + delta).requires_grad_(True)
    spec = LossSpec(
        eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, ratio_cap=2.5, veto_scope="H_kappa",
        fipo=True, fipo_drop_multi_dual_clip=True, aggregation="token_mean",
    )
    out = compute_policy_loss(spec, logp, old, adv, mask)
    out.loss.backward()
    useful = out.stats["useful"]
    assert torch.equal(useful, logp.grad != 0)
    assert useful.any() and (~useful & (mask > 0)).any()
    assert out.stats["vetoed"][1, 3:].all() and not out.stats["vetoed"][2].any()


def test_veto_uses_token_ratio_at_sequence_level():
    # one tiny token ratio in an otherwise inflated sequence: the sequence ratio is not tiny, the trigger fires
    old = torch.zeros(1, 4, dtype=D)
    logp = t([[3.0, -12.0, 3.0, 3.0]]).requires_grad_(True)
    lo, hi = relaxed_clip_eps(0.0, 5.0)
    spec = LossSpec(ratio_level="sequence", eps_low=lo, eps_high=hi, veto_scope="H_kappa")
    out = compute_policy_loss(spec, logp, old, t([-1.0]), torch.ones(1, 4))
    assert out.stats["veto_triggers"].tolist() == [[False, True, False, False]]
    assert out.stats["vetoed"].tolist() == [[False, False, True, True]]
    assert out.stats["ratio"].shape == (1, 1) and out.stats["ratio"].item() == pytest.approx(math.exp(-0.75))


# ---------------------------------------------------------------------------------------------------------------
# Equivalence with TRL 1.16 _compute_loss, re-derived independently from docs/algorithms.md
# ---------------------------------------------------------------------------------------------------------------


def reference_trl_loss(loss_type, level, logp, old, adv, mask, beta, ref, eps_low, eps_high, delta, num_items, L):
    """Independent re-derivation (formulas of docs/algorithms.md, TRL 1.16 conventions)."""
    m = mask.to(logp.dtype)
    lr = logp - old
    if level == "sequence":
        lr = ((lr * m).sum(1) / torch.clamp(m.sum(1), min=1.0))[:, None]
    r = lr.exp()
    r_clip = torch.clamp(r, 1 - eps_low, 1 + eps_high)
    r_un = r if delta is None else torch.clamp(r, max=delta)
    a = adv[:, None]
    loss_tok = -torch.minimum(r_un * a, r_clip * a)
    if beta:
        loss_tok = loss_tok + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    loss_tok = loss_tok * m
    if loss_type == "grpo":
        return (loss_tok.sum(1) / torch.clamp(m.sum(1), min=1.0)).mean()
    if loss_type == "bnpo":
        return loss_tok.sum() / torch.clamp(m.sum(), min=1.0)
    if loss_type == "dr_grpo":
        return loss_tok.sum() / (logp.shape[0] * L)
    if loss_type == "dapo":
        return loss_tok.sum() / num_items
    raise AssertionError(loss_type)


TRL_SPECS = {
    "grpo": {"aggregation": "seq_mean_token_mean"},
    "bnpo": {"aggregation": "token_mean"},
    "dr_grpo": {"aggregation": "constant"},
    "dapo": {"aggregation": "token_mean"},
}


@pytest.mark.parametrize("loss_type", list(TRL_SPECS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, delta", [(0.0, None), (0.04, None), (0.04, 1.6)])
def test_equivalence_with_trl_formula(loss_type, level, beta, delta):
    g = torch.Generator().manual_seed(hash((loss_type, level, beta, delta)) % 2**31)
    B, T, L = 6, 7, 10
    old = torch.randn(B, T, generator=g, dtype=D)
    base = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[-1] = 0  # one fully masked row
    mask[0] = 0
    mask[0, 0] = 1  # one single-token completion
    adv = group_std_advantages(torch.randn(B, generator=g, dtype=D), 3)
    adv[1] = 0.0
    num_items = 37.0
    spec = LossSpec(ratio_level=level, eps_low=0.2, eps_high=0.28, beta=beta, ratio_cap=delta, **TRL_SPECS[loss_type])
    kw = {"num_items": num_items} if loss_type == "dapo" else {}
    lp1 = base.clone().requires_grad_(True)
    got = compute_policy_loss(spec, lp1, old, adv, mask, ref_logp=ref, max_completion_length=L, **kw).loss
    lp2 = base.clone().requires_grad_(True)
    want = reference_trl_loss(loss_type, level, lp2, old, adv, mask, beta, ref, 0.2, 0.28, delta, num_items, L)
    close(got, want, tol=1e-12)
    got.backward()
    want.backward()
    close(lp1.grad, lp2.grad, tol=1e-12)
    assert lp1.grad.abs().sum() > 0


def test_default_spec_is_trl_grpo_and_on_policy_ratio_is_one():
    torch.manual_seed(7)
    logp = torch.randn(4, 5, dtype=D, requires_grad=True)
    adv = t([1.0, -1.0, 0.5, 0.0])
    mask = torch.ones(4, 5)
    out = compute_policy_loss(LossSpec(), logp, None, adv, mask)
    close(out.loss, -adv.mean())  # r = 1: l = -A per token
    assert out.per_token_loss.shape == (4, 5)
    assert (out.stats["ratio"] == 1).all()
    assert "kl" not in out.stats and "fipo_weights" not in out.stats
    for key in ("ratio", "is_low_clipped", "is_high_clipped", "is_dual_clipped", "veto_triggers", "vetoed", "useful"):
        assert not out.stats[key].requires_grad


def test_end_to_end_gradcheck():
    torch.manual_seed(8)
    old = torch.randn(3, 4, dtype=D)
    lp = (old + 0.05 * torch.randn(3, 4, dtype=D)).requires_grad_(True)  # inside the clip range: no kinks
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    ref = old + 0.1
    adv = t([0.5, -1.0, 2.0])
    for level in RATIO_LEVELS:
        spec = LossSpec(ratio_level=level, beta=0.04, clip_ratio_c=3.0)
        fn = lambda x: compute_policy_loss(spec, x, old, adv, mask, ref_logp=ref).loss  # noqa: E731
        assert torch.autograd.gradcheck(fn, (lp,))


# ---------------------------------------------------------------------------------------------------------------
# Zero-std groups get exactly zero advantage; token-mean over each update's own tokens
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.1, 0.7, 1.2])
@pytest.mark.parametrize("G", [8, 16])
def test_zero_std_groups_get_exactly_zero_advantage(value, G):
    from grpo_variants.losses import zero_std_groups

    rewards = torch.cat([torch.full((G,), value), torch.arange(G, dtype=torch.float32) % 2]).float()  # fp32 as TRL
    assert zero_std_groups(rewards, G).tolist() == [True, False]
    # TRL's arithmetic (nanmean, two-pass nanstd) leaves a residue of one sign where the value is not representable
    grouped = rewards.view(-1, G)
    mean = grouped.mean(1, keepdim=True)
    std = ((grouped - mean) ** 2).mean(1, keepdim=True).mul(G / (G - 1)).sqrt()
    for estimator in (group_std_advantages, group_mean_advantages, batch_std_advantages):
        adv = estimator(rewards, G)
        assert torch.equal(adv[:G], torch.zeros(G)), estimator.__name__  # exactly 0, every member
        assert (adv[G:] != 0).all()
    if (grouped[0] - mean[0]).abs().max() > 0:  # where float arithmetic leaves a residue, TRL's A is not 0
        assert ((grouped[0] - mean[0]) / (std[0] + 1e-4)).abs().max() > 0


def test_update_token_counts():
    from grpo_variants.losses import update_token_counts

    counts = torch.tensor([3.0, 5.0, 2.0, 9.0, 4.0, 4.0])
    assert update_token_counts(counts, 2).tolist() == [8.0, 8.0, 11.0, 11.0, 8.0, 8.0]
    assert update_token_counts(counts, 1).tolist() == counts.tolist()
    with pytest.raises(ConfigError, match="multiple of gradient_accumulation_steps"):
        update_token_counts(counts, 4)


def _trainer_run(toy_kit, tmp_path, reward, **overrides):
    from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer
    from grpo_variants.lab import TOY_CONFIG

    values = {**TOY_CONFIG, "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
              "num_generations": 4, "max_steps": 1, "seed": 0, "reward_cache": False, **overrides}
    return GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=reward, args=GRPOVariantConfig(**values),
                              train_dataset=toy_kit.train_dataset.select(range(256)))


@pytest.mark.parametrize("value", [0.1, 0.7, 1.2])
def test_trainer_gives_constant_groups_exactly_zero_advantage(toy_kit, tmp_path, value):
    def reward(prompts, completions, **kwargs):  # group 0 of each 16-row call constant, the others vary
        return [value if i % 16 < 4 else float(i % 2) for i in range(len(completions))]

    trainer = _trainer_run(toy_kit, tmp_path, reward, per_device_train_batch_size=16)
    seen = []
    rollout = trainer._scored_rollout
    trainer._scored_rollout = lambda inputs: seen.append(rollout(inputs)) or seen[-1]
    trainer.train()
    (out,) = seen
    constant = torch.tensor([abs(v - value) < 1e-6 for v in trainer.weighted_rewards().tolist()])
    assert int(constant.sum()) == 4
    assert torch.equal(out["advantages"][constant], torch.zeros(4))
    assert (out["advantages"][~constant] != 0).all()
    # TRL's frac_reward_zero_std counts the rows zeroed here: 1 group of 4 (TRL's isclose alone misses 0.7 x 4)
    logged = [r["frac_reward_zero_std"] for r in trainer.state.log_history if "frac_reward_zero_std" in r]
    assert logged and logged[0] == 0.25


@pytest.mark.parametrize("aggregation", ["token_mean", None])
def test_token_mean_normalises_each_update_by_its_own_tokens(toy_kit, tmp_path, monkeypatch, aggregation):
    """16 updates per rollout (2 micro-batches each) of unequal lengths: each update's loss is its own token mean,
    with aggregation="token_mean" or with loss_type="dapo" alone (announced: TRL divides by the rollout average)."""
    import grpo_variants.trainer as trainer_module

    calls = []
    original = trainer_module.compute_policy_loss

    def recording(spec, logp, old, adv, mask, **kw):
        out = original(spec, logp, old, adv, mask, **kw)
        calls.append((out.per_token_loss.detach(), mask.detach().float(), kw["num_items"], out.loss.detach()))
        return out

    monkeypatch.setattr(trainer_module, "compute_policy_loss", recording)
    trainer = _trainer_run(toy_kit, tmp_path, "toy_accuracy", loss_type="dapo", aggregation=aggregation,
                           gradient_accumulation_steps=2, mini_batches_per_rollout=16, max_steps=16)
    assert trainer.args.steps_per_generation == 32
    notes = trainer.args.loss_composition_notes()
    assert (len(notes) == 1 and "each optimizer update's own token count" in notes[0]) if aggregation is None \
        else notes == []
    trainer.train()
    assert len(calls) == 32
    window_tokens = []
    for w in range(16):
        (l0, m0, n0, loss0), (l1, m1, n1, loss1) = calls[2 * w], calls[2 * w + 1]
        tokens = m0.sum() + m1.sum()
        window_tokens.append(float(tokens))
        assert float(n0) == float(n1) == float(tokens)  # the normaliser is this update's token count
        direct = ((l0 * m0).sum() + (l1 * m1).sum()) / tokens  # token mean over the update's optimisation batch
        torch.testing.assert_close(loss0 + loss1, direct, atol=1e-6, rtol=1e-6)
    assert len(set(window_tokens)) > 1, "all updates had equal token counts: the test would not see the difference"
    rollout_average = sum(window_tokens) / 16  # what TRL's num_items_in_batch normaliser would divide by
    assert any(abs(t - rollout_average) > 0.5 for t in window_tokens)
