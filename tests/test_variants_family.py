"""GRPO, Dr.GRPO, GSPO, GSPO-token and FIPO: each loss equals its docs/algorithms.md formula, each trains.

The formula tests build one micro-batch by hand, call ``trainer._compute_loss`` and compare the
loss AND the parameter gradients with the docs/algorithms.md formula, written out here from the model's own
log-probs (a plain forward pass + log_softmax, not through grpo_variants or TRL code).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import HfArgumentParser

from conftest import position_reward
from grpo_variants import ConfigError, get_variant
from grpo_variants.losses import discounted_future_sum, fipo_weights

B, P, T = 6, 5, 6  # hand batch: 6 sequences, prompts of 5 tokens, 6 completion positions
LENGTHS = torch.tensor([6, 5, 3, 1, 6, 4])
ADV = torch.tensor([1.2, -0.7, 0.5, -1.3, 0.9, -0.4])


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def make_trainer(name, make_args, toy_model_path, dataset, reward_funcs="toy_accuracy", **overrides):
    spec = get_variant(name)
    args = make_args(spec.config_cls, **overrides)
    return spec.trainer_cls(model=toy_model_path, reward_funcs=reward_funcs, args=args, train_dataset=dataset)


def hand_batch(trainer, seed=0):
    """Prompt (one row left-padded) + completions of lengths LENGTHS, right-padded."""
    g = torch.Generator().manual_seed(seed)
    vocab, pad = trainer.model.config.vocab_size, trainer.processing_class.pad_token_id
    prompt_ids = torch.randint(6, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_ids[1, :2], prompt_mask[1, :2] = pad, 0
    completion_ids = torch.randint(6, vocab, (B, T), generator=g)
    completion_mask = (torch.arange(T).unsqueeze(0) < LENGTHS.unsqueeze(1)).long()
    completion_ids[completion_mask == 0] = pad
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": ADV.clone(),
        "num_items_in_batch": torch.tensor(40.0),
    }


def plain_logps(model, batch, temperature):
    """log pi(o_t | q, o_<t) from a plain forward pass (logits / temperature, log_softmax, gather)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def with_old_logps(trainer, batch, delta):
    """Set pi_old so that log pi_theta - log pi_old = delta on this batch."""
    with torch.no_grad():
        logp = plain_logps(trainer.model, batch, trainer.args.temperature)
    batch["old_per_token_logps"] = logp - delta
    return logp


def assert_loss_and_grads_match(trainer, batch, formula):
    """trainer._compute_loss == formula(plain log-probs), in value and in every parameter gradient."""
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    model.zero_grad()
    loss = trainer._compute_loss(model, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected = formula(plain_logps(model, batch, trainer.args.temperature))
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-7)
    assert got.keys() == want.keys() and got
    scale = max(g.abs().max().item() for g in want.values())  # float32 noise is relative to the gradient scale
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, msg=f"gradient of {name}")
    assert want["model.embed_tokens.weight"].abs().sum() > 0  # the formula has a gradient at all
    return loss.detach()


def ppo_term(ratio, adv, eps_low, eps_high):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def mask_of(batch):
    return batch["completion_mask"].float()


# ---------------------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------------------
def test_grpo_loss_equals_formula(toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer("grpo", make_args, toy_model_path, small_train_dataset, gradient_accumulation_steps=2,
                           temperature=0.7)
    assert trainer.args.beta == 0.04 and trainer.args.epsilon == trainer.args.epsilon_high == 0.2
    batch = hand_batch(trainer)
    delta = torch.randn(B, T, generator=torch.Generator().manual_seed(1)) * 0.3
    logp0 = with_old_logps(trainer, batch, delta)
    batch["ref_per_token_logps"] = logp0 + torch.randn(B, T, generator=torch.Generator().manual_seed(2)) * 0.5
    M, A, old, ref = mask_of(batch), ADV.unsqueeze(1), batch["old_per_token_logps"], batch["ref_per_token_logps"]

    def formula(logp):
        d = ref - logp
        kl = torch.exp(d) - d - 1  # k3
        per_token = ppo_term(torch.exp(logp - old), A, 0.2, 0.2) + 0.04 * kl
        return ((per_token * M).sum(1) / M.sum(1)).mean() / 2  # seq-mean-token-mean, / grad accumulation

    assert_loss_and_grads_match(trainer, batch, formula)
    clipped = (torch.exp(delta) > 1.2) & (A > 0) | (torch.exp(delta) < 0.8) & (A < 0)
    assert (clipped & (M > 0)).any() and (~clipped & (M > 0)).any()  # both branches of the min are exercised


# ---------------------------------------------------------------------------------------------------------------
# Dr.GRPO
# ---------------------------------------------------------------------------------------------------------------
def test_dr_grpo_loss_equals_formula(toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer("dr_grpo", make_args, toy_model_path, small_train_dataset, gradient_accumulation_steps=2,
                           max_completion_length=8)
    batch = hand_batch(trainer)
    delta = torch.randn(B, T, generator=torch.Generator().manual_seed(3)) * 0.3
    with_old_logps(trainer, batch, delta)
    M, A, old = mask_of(batch), ADV.unsqueeze(1), batch["old_per_token_logps"]
    L = 8  # the generation budget, not the longest completion of the batch (6)

    def formula(logp):
        return (ppo_term(torch.exp(logp - old), A, 0.2, 0.2) * M).sum() / (B * L) / 2

    assert_loss_and_grads_match(trainer, batch, formula)


def test_dr_grpo_advantage_is_group_mean(toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer("dr_grpo", make_args, toy_model_path, small_train_dataset)
    assert trainer.args.scale_rewards == "none" and trainer.args.resolved_advantage_estimator == "group_mean"
    assert trainer.args.beta == 0.0 and trainer.loss_spec.aggregation == "constant"


# ---------------------------------------------------------------------------------------------------------------
# GSPO and GSPO-token
# ---------------------------------------------------------------------------------------------------------------
def gspo_delta():
    """Token log-ratios that vary a lot within a row (+-5%) around a row mean (the log of s_i) that keeps
    rows 0-2 inside [1 - 3e-4, 1 + 4e-4] and moves rows 3-5 out of it: token-level clipping would act
    on almost every token, sequence-level clipping only on rows 3 and 4."""
    g = torch.Generator().manual_seed(4)
    mask = (torch.arange(T).unsqueeze(0) < LENGTHS.unsqueeze(1)).float()
    spread = torch.randn(B, T, generator=g) * 0.05
    spread = spread - ((spread * mask).sum(1) / mask.sum(1)).unsqueeze(1)  # zero mean over each row's tokens
    # row 3: A < 0, s < 1 - eps_low: clipped; row 4: A > 0, s > 1 + eps_high: clipped;
    # row 5: A < 0, s > 1 + eps_high: not clipped (the min keeps s A)
    log_s = torch.tensor([1e-5, -1e-5, 5e-6, -2e-3, 2e-3, 2e-3])
    return spread + log_s.unsqueeze(1)


def gspo_formula(batch, seq_level=True):
    M, A, old = mask_of(batch), ADV, batch["old_per_token_logps"]

    def formula(logp):
        log_s = ((logp - old) * M).sum(1) / M.sum(1)  # log of the geometric mean of the token ratios
        if seq_level:  # GSPO: one ratio and one loss per sequence, averaged over sequences
            return ppo_term(torch.exp(log_s), A, 3e-4, 4e-4).mean() / 2
        s_tok = torch.exp(log_s.detach().unsqueeze(1) + logp - logp.detach())  # sg(s_i) pi(t) / sg(pi(t))
        per_token = ppo_term(s_tok, A.unsqueeze(1), 3e-4, 4e-4)
        return ((per_token * M).sum(1) / M.sum(1)).mean() / 2

    return formula


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_loss_equals_formula(name, toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer(name, make_args, toy_model_path, small_train_dataset, gradient_accumulation_steps=2)
    assert (trainer.args.epsilon, trainer.args.epsilon_high, trainer.args.beta) == (3e-4, 4e-4, 0.0)
    batch = hand_batch(trainer)
    with_old_logps(trainer, batch, gspo_delta())
    loss = assert_loss_and_grads_match(trainer, batch, gspo_formula(batch, seq_level=name == "gspo"))
    # GSPO-token carries the sequence's advantage on every token: identical to GSPO (value and gradient).
    assert_loss_and_grads_match(trainer, batch, gspo_formula(batch, seq_level=True))
    assert loss.abs() > 0
    seq = trainer._metrics["train"]
    assert seq["clip_ratio/seq_low_mean"][-1] == pytest.approx(1 / 6)  # row 3
    assert seq["clip_ratio/seq_high_mean"][-1] == pytest.approx(1 / 6)  # row 4
    assert seq["clip_ratio/seq_region_mean"][-1] == pytest.approx(2 / 6)
    tokens = (LENGTHS[3] + LENGTHS[4]).item() / LENGTHS.sum().item()
    assert seq["clip_ratio/region_mean"][-1] == pytest.approx(tokens)  # token-weighted, as the paper reports


def test_gspo_token_with_per_token_advantages(toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer("gspo_token", make_args, toy_model_path, small_train_dataset, gradient_accumulation_steps=2)
    batch = hand_batch(trainer)
    with_old_logps(trainer, batch, gspo_delta())
    adv = ADV.unsqueeze(1) * torch.linspace(0.5, 1.5, T).unsqueeze(0)  # (B, T): differs per token
    batch["advantages"] = adv
    M, old = mask_of(batch), batch["old_per_token_logps"]

    def formula(logp):
        log_s = ((logp - old) * M).sum(1, keepdim=True) / M.sum(1, keepdim=True)
        s_tok = torch.exp(log_s.detach() + logp - logp.detach())
        return ((ppo_term(s_tok, adv, 3e-4, 4e-4) * M).sum(1) / M.sum(1)).mean() / 2

    assert_loss_and_grads_match(trainer, batch, formula)


# ---------------------------------------------------------------------------------------------------------------
# FIPO
# ---------------------------------------------------------------------------------------------------------------
def fipo_weights_loop(logp, old, mask, adv, tau=32.0, c=10.0, low=1.0, high=1.2, safety=10.0):
    """Direct transcription of docs/algorithms.md (FIPO), one token at a time, in float64 Python numbers."""
    rows, cols = logp.shape
    adv = adv.double().reshape(rows, -1).expand(rows, cols).tolist()
    delta = (logp.double() - old.double()).clamp(-20, 20).tolist()
    mask = mask.bool().tolist()
    gamma = 2.0 ** (-1.0 / tau)
    f = [[1.0] * cols for _ in range(rows)]
    for i in range(rows):
        for t in range(cols):
            if not mask[i][t]:
                continue
            future = 0.0
            for k in range(t, cols):
                if mask[i][k] and delta[i][k] <= math.log(c):
                    future += gamma ** (k - t) * delta[i][k]
            w = min(max(math.exp(future), low), high)
            if adv[i][t] < 0 and math.exp(delta[i][t]) > safety:
                w = min(max(w, 0.8), 1.0)
            f[i][t] = w
    return torch.tensor(f, dtype=torch.float64)


def test_fipo_weights_equal_direct_loop_on_random_inputs():
    g = torch.Generator().manual_seed(5)
    rows, cols = 3, 300  # longer than one 256-token chunk of the vectorised sum
    logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    old = logp - torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.05
    old[0, 10] = logp[0, 10] - 3.0  # delta > log 10: excluded from the sum, r > 10: safety clamp for A < 0
    mask = torch.rand(rows, cols, generator=g) > 0.1
    adv = torch.tensor([0.8, -1.1, -0.3], dtype=torch.float64)
    adv_rows = torch.tensor([-0.8, -1.1, 0.3], dtype=torch.float64)
    for a, low, tau in ((adv, 1.0, 32.0), (adv_rows, 0.8, 32.0), (adv, 1.0, 4.0)):
        got = fipo_weights(logp, old, mask, a, tau=tau, clip_low=low)
        want = fipo_weights_loop(logp, old, mask, a, tau=tau, low=low)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert (want[mask] > 1.0).any() and (want[mask] < 1.2).any()  # weights are neither trivial nor saturated
    x = torch.randn(2, 50, generator=g, dtype=torch.float64)
    loop = torch.stack([torch.stack([sum(0.9 ** (k - t) * x[i, k] for k in range(t, 50)) for t in range(50)])
                        for i in range(2)])
    torch.testing.assert_close(discounted_future_sum(x, 0.9, chunk_size=7), loop)


def fipo_delta():
    g = torch.Generator().manual_seed(6)
    delta = torch.rand(B, T, generator=g) * 0.12 - 0.02  # mostly positive: the policy moved up on the future
    delta[1, 1] = delta[1, 3] = 3.0  # A < 0, r = e^3 > c = 10 twice: dual clip, row dropped
    delta[3, 0] = 3.0  # A < 0, one dual-clipped token: row kept
    delta[0, 2] = 2.5  # delta > log c: excluded from M'; A > 0 so high-clipped
    delta[5, 3] = -0.3  # last token of row 5: FutureKL < 0, so f < 1 with the symmetric option
    return delta


@pytest.mark.parametrize("clip_low", [1.0, 0.8])
def test_fipo_loss_equals_formula(clip_low, toy_model_path, small_train_dataset, make_args):
    trainer = make_trainer("fipo", make_args, toy_model_path, small_train_dataset, gradient_accumulation_steps=2,
                           mini_batches_per_rollout=2, fipo_clip_low=clip_low, warmup_steps=0)
    args = trainer.args
    assert (args.epsilon, args.epsilon_high, args.clip_ratio_c, args.fipo_tau, args.beta) == (
        0.2, 0.28, 10.0, 32.0, 0.0)
    assert args.steps_per_generation == 4 and args.mask_truncated_completions
    batch = hand_batch(trainer)
    logp0 = with_old_logps(trainer, batch, fipo_delta())
    M, A, old = mask_of(batch), ADV.unsqueeze(1), batch["old_per_token_logps"]
    f = fipo_weights_loop(logp0, old, M > 0, ADV, low=clip_low).float()
    normaliser = 40.0 * args.gradient_accumulation_steps / args.steps_per_generation  # tokens per optimizer step

    def formula(logp):
        r = torch.exp(logp - old)
        adv = A * f  # f is a stop-gradient weight
        loss = ppo_term(r, adv, 0.2, 0.28)
        bound = -10.0 * adv
        dual = (adv < 0) & (bound < loss)
        loss = torch.where(adv < 0, torch.min(loss, bound), loss)
        keep = ((dual & (M > 0)).sum(1, keepdim=True) <= 1).float()  # drop rows with > 1 dual-clipped token
        return (loss * M * keep).sum() / normaliser

    assert_loss_and_grads_match(trainer, batch, formula)
    # The same weights through the trainer's metrics.
    metrics = trainer._metrics["train"]
    assert metrics["fipo/weight_mean"][-1] == pytest.approx((f * M).sum().item() / M.sum().item(), rel=1e-5)
    assert metrics["fipo/weight_max"][-1] == pytest.approx(f[M > 0].max().item(), rel=1e-6)
    assert metrics["fipo/weight_max"][-1] > 1.0
    assert metrics["fipo/dropped_fraction"][-1] == pytest.approx(1 / 6)  # row 1
    assert metrics["clip_ratio/dual_mean"][-1] == pytest.approx(3 / LENGTHS.sum().item())
    if clip_low == 0.8:
        assert (f[M > 0] < 1.0).any()  # the symmetric option lets weights go down


def test_fipo_is_trivial_on_policy(toy_model_path, small_train_dataset, make_args):
    """Without pi_old (on-policy) every weight is 1: FIPO reduces to DAPO with dual clip."""
    with pytest.warns(UserWarning, match="on-policy"):
        trainer = make_trainer("fipo", make_args, toy_model_path, small_train_dataset, mini_batches_per_rollout=1)
    batch = hand_batch(trainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, batch)
    assert trainer._metrics["train"]["fipo/weight_max"][-1] == 1.0
    assert trainer._metrics["train"]["fipo/weight_mean"][-1] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# Short training runs
# ---------------------------------------------------------------------------------------------------------------
def train_and_logs(name, make_args, toy_model_path, dataset, **overrides):
    """A short real run whose every group has distinct rewards (``position_reward``): the advantages and the
    policy gradient are non-zero at every step by construction, whatever the policy sampled."""
    values = dict(per_device_train_batch_size=8, max_steps=3, reward_cache=False)
    values.update(overrides)
    trainer = make_trainer(name, make_args, toy_model_path, dataset, reward_funcs=position_reward, **values)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == values["max_steps"] and math.isfinite(result.training_loss)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters()), "no parameter changed"
    return [r for r in trainer.state.log_history if "loss" in r]


def test_grpo_trains_with_kl(toy_model_path, small_train_dataset, make_args):
    logs = train_and_logs("grpo", make_args, toy_model_path, small_train_dataset, max_steps=2)
    assert all("kl" in r and r["kl"] >= 0 for r in logs)


def test_dr_grpo_trains(toy_model_path, small_train_dataset, make_args):
    logs = train_and_logs("dr_grpo", make_args, toy_model_path, small_train_dataset, max_steps=2)
    assert all("kl" not in r and "clip_ratio/region_mean" in r for r in logs)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_trains_and_clips_at_sequence_level(name, toy_model_path, small_train_dataset, make_args):
    logs = train_and_logs(name, make_args, toy_model_path, small_train_dataset, mini_batches_per_rollout=3)
    keys = ("clip_ratio/seq_low_mean", "clip_ratio/seq_high_mean", "clip_ratio/seq_region_mean")
    for record in logs:
        assert all(0.0 <= record[k] <= 1.0 for k in keys)
    assert logs[0]["clip_ratio/seq_region_mean"] == 0.0  # first mini-batch: on-policy, s_i = 1
    assert max(r["clip_ratio/seq_region_mean"] for r in logs[1:]) > 0.0  # later mini-batches: clipped sequences


def test_fipo_trains_with_active_weights(toy_model_path, small_train_dataset, make_args):
    logs = train_and_logs("fipo", make_args, toy_model_path, small_train_dataset, max_steps=2,
                          mini_batches_per_rollout=2, warmup_steps=0)
    for record in logs:
        for key in ("fipo/weight_mean", "fipo/weight_max", "fipo/dropped_fraction", "clip_ratio/dual_mean"):
            assert key in record
        assert 1.0 <= record["fipo/weight_mean"] <= record["fipo/weight_max"] <= 1.2 + 1e-6  # float32 1.2
    # first mini-batch of the rollout: pi_old = pi_theta (old log-probs recorded in generate: equal to rounding)
    assert logs[0]["fipo/weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert logs[1]["fipo/weight_max"] > 1.0 + 1e-4  # second: the policy has moved, the weights act
    assert "dynamic_sampling/pass_rate" in logs[0] and "rewards/overlong_penalty/mean" in logs[0]  # DAPO's parts


# ---------------------------------------------------------------------------------------------------------------
# Config validation and defaults
# ---------------------------------------------------------------------------------------------------------------
def cfg(name, **kwargs):
    kwargs.setdefault("output_dir", "unused")
    kwargs.setdefault("report_to", "none")
    return get_variant(name).config_cls(**kwargs)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("grpo", dict(resolved_advantage_estimator="group_std", resolved_ratio_level="token", epsilon=0.2,
                      epsilon_high=0.2, resolved_aggregation="seq_mean_token_mean", beta=0.04, learning_rate=1e-6)),
        ("dr_grpo", dict(resolved_advantage_estimator="group_mean", resolved_ratio_level="token", epsilon=0.2,
                         epsilon_high=0.2, resolved_aggregation="constant", beta=0.0, learning_rate=1e-6,
                         num_generations=8)),
        ("gspo", dict(resolved_advantage_estimator="group_std", resolved_ratio_level="sequence", epsilon=3e-4,
                      epsilon_high=4e-4, resolved_aggregation="seq_mean_token_mean", beta=0.0, steps_per_generation=4)),
        ("gspo_token", dict(resolved_ratio_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4,
                            resolved_aggregation="seq_mean_token_mean", beta=0.0)),
        ("fipo", dict(resolved_advantage_estimator="group_std", resolved_ratio_level="token", epsilon=0.2,
                      epsilon_high=0.28, resolved_aggregation="token_mean", beta=0.0, clip_ratio_c=10.0, fipo=True,
                      fipo_tau=32.0, fipo_clip_low=1.0, fipo_clip_high=1.2, fipo_safety_ratio=10.0,
                      fipo_drop_multi_dual_clip=True, mask_truncated_completions=True, num_generations=16,
                      learning_rate=1e-6, steps_per_generation=16, dynamic_sampling=True, overlong_penalty=True)),
    ],
)
def test_paper_defaults(name, expected):
    config = cfg(name)
    assert config.variant == name
    for field_name, value in expected.items():
        assert getattr(config, field_name) == value, field_name


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("override", [dict(aggregation="token_mean"), dict(aggregation="constant"),
                                      dict(aggregation="seq_mean_token_sum"), dict(aggregation=None, loss_type="dapo"),
                                      dict(aggregation=None, loss_type="dr_grpo")])
def test_gspo_rejects_length_weighted_aggregation(name, override):
    with pytest.raises(ConfigError, match="seq_mean_token_mean.*length"):
        cfg(name, **override)


def test_gspo_ratio_level_is_enforced():
    with pytest.raises(ConfigError, match="ratio_level='sequence'"):
        cfg("gspo", ratio_level="token")
    with pytest.raises(ConfigError, match="ratio_level='sequence_token'"):
        cfg("gspo_token", ratio_level="sequence")


def test_mini_batches_per_rollout():
    assert cfg("gspo", gradient_accumulation_steps=2).steps_per_generation == 8  # 4 updates x 2 micro-steps
    assert cfg("gspo", steps_per_generation=3).steps_per_generation == 3  # explicit TRL field wins
    assert cfg("gspo", mini_batches_per_rollout=None, gradient_accumulation_steps=2).steps_per_generation == 2
    config = cfg("gspo", generation_batch_size=16, per_device_train_batch_size=8)
    assert config.steps_per_generation == 2
    with pytest.raises(ConfigError, match="mini_batches_per_rollout"):
        cfg("gspo", mini_batches_per_rollout=0)
    with pytest.raises(ConfigError, match="mini_batches_per_rollout"):
        cfg("fipo", mini_batches_per_rollout=0)


def test_dr_grpo_rejects_std_advantage_and_other_normalisers():
    with pytest.raises(ConfigError, match="group-mean advantage"):
        cfg("dr_grpo", scale_rewards="group")
    with pytest.raises(ConfigError, match="group-mean advantage"):
        cfg("dr_grpo", advantage_estimator="group_std")
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        with pytest.raises(ConfigError, match="constant"):
            cfg("dr_grpo", aggregation=aggregation)


def test_fipo_validation():
    with pytest.raises(ConfigError, match="fipo=True"):
        cfg("fipo", fipo=False)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        cfg("fipo", clip_ratio_c=None)
    with pytest.raises(ConfigError, match="ratio_level='token'"):
        cfg("fipo", ratio_level="sequence")
    with pytest.raises(ConfigError, match="fipo_clip_low"):
        cfg("fipo", fipo_clip_low=1.1)
    assert cfg("fipo", clip_ratio_c=None, fipo_drop_multi_dual_clip=False).clip_ratio_c is None
    with pytest.warns(UserWarning, match="on-policy"):
        cfg("fipo", mini_batches_per_rollout=1, per_device_train_batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        # reusing the rollout (num_iterations > 1) makes it off-policy: no warning
        cfg("fipo", mini_batches_per_rollout=1, per_device_train_batch_size=16, num_iterations=2)


@pytest.mark.parametrize("name", ["dr_grpo", "gspo", "gspo_token", "fipo"])
def test_configs_parse_from_the_command_line(name):
    """The CLI and the recipes build configs with HfArgumentParser."""
    argv = ["--output_dir", "x", "--report_to", "none", "--gradient_accumulation_steps", "2"]
    if name != "dr_grpo":
        argv += ["--mini_batches_per_rollout", "2"]
    (config,) = HfArgumentParser(get_variant(name).config_cls).parse_args_into_dataclasses(args=argv)
    assert config.variant == name and config.gradient_accumulation_steps == 2
    if name != "dr_grpo":
        assert config.steps_per_generation == 4


# ---------------------------------------------------------------------------------------------------------------
# Recipes (recipes/_common.py and the four recipes of this family)
# ---------------------------------------------------------------------------------------------------------------
RECIPES_DIR = __import__("pathlib").Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(module_name):
    import importlib
    import sys

    if str(RECIPES_DIR) not in sys.path:
        sys.path.insert(0, str(RECIPES_DIR))
    return importlib.import_module(module_name)


@pytest.mark.parametrize(
    "module, processes, expected",
    [
        # DeepSeekMath: 1024 completions per update, one update per rollout, 64 samples per question
        ("grpo_qwen", 8, dict(gradient_accumulation_steps=16, steps_per_generation=16, num_generations=64, beta=0.04)),
        # Oat-Zero: 128 completions per update, 8 updates per rollout (128 questions x 8 samples), L = 3000
        ("dr_grpo_qwen", 8, dict(gradient_accumulation_steps=8, steps_per_generation=64, num_generations=8,
                                 max_completion_length=3000, aggregation="constant")),
        # GSPO: 4 mini-batches per rollout
        ("gspo_qwen3_moe", 8, dict(gradient_accumulation_steps=32, steps_per_generation=128, mini_batches_per_rollout=4,
                                   epsilon=3e-4, epsilon_high=4e-4)),
        # FIPO / DAPO: 512 completions per update, 16 updates per rollout (512 prompts x 16 samples)
        ("fipo_qwen32b", 64, dict(gradient_accumulation_steps=8, steps_per_generation=128, mini_batches_per_rollout=16,
                                  max_completion_length=20480, overlong_buffer_len=4096, warmup_steps=20)),
    ],
)
def test_recipe_paper_scale_batching(module, processes, expected):
    recipe = load_recipe(module).RECIPE
    config, options = load_recipe("_common").build_config(recipe, [], num_processes=processes)
    assert not options.toy and config.variant == recipe.variant
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    per_update = config.per_device_train_batch_size * processes * config.gradient_accumulation_steps
    assert per_update == recipe.samples_per_update
    assert per_update * config.steps_per_generation // config.gradient_accumulation_steps == (
        recipe.samples_per_update * recipe.updates_per_rollout
    )


def test_recipe_command_line_and_toy_switch():
    common, recipe = load_recipe("_common"), load_recipe("dr_grpo_qwen").RECIPE
    config, _ = common.build_config(recipe, ["--per_device_train_batch_size", "4"], num_processes=8)
    assert (config.gradient_accumulation_steps, config.steps_per_generation) == (4, 32)  # still 128 per update
    config, _ = common.build_config(recipe, ["--gradient_accumulation_steps", "2", "--learning_rate", "3e-6"],
                                    num_processes=8)
    assert (config.gradient_accumulation_steps, config.steps_per_generation, config.learning_rate) == (2, 16, 3e-6)
    config, _ = common.build_config(recipe, ["--generation_batch_size", "64"], num_processes=1)
    assert config.generation_batch_size == 64  # an explicit TRL batching field wins
    with pytest.raises(SystemExit, match="samples_per_update=128 is not a multiple"):
        common.build_config(recipe, ["--per_device_train_batch_size", "3"], num_processes=8)
    config, options = common.build_config(recipe, ["--toy", "--max_steps", "2"])
    assert options.toy and config.max_steps == 2 and config.max_completion_length == 6
    assert config.use_vllm is False and config.per_device_train_batch_size == 32
    assert config.steps_per_generation == 4  # the recipe's 8 updates per rollout, capped at 4 for the toy
    assert config.aggregation == "constant" and config.scale_rewards == "none"  # the variant is unchanged


def test_recipe_dataset_mapping(tmp_path):
    import json

    rows = [
        {"problem": "1+1?", "level": "Level 1", "solution": "It is \\boxed{2}."},
        {"problem": "2+3?", "level": "Level 4", "solution": "So \\boxed{5}."},
        {"problem": [{"role": "user", "content": "chat 4*4?"}], "level": "Level 5", "meta": {"gold": 16}},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    common = load_recipe("_common")
    spec = common.DatasetSpec(str(path), prompt="problem", answer="solution", template="Q: {question}",
                              filter=lambda row: row["level"] != "Level 1")
    data = common.load_prompts(spec, system_prompt="Reason step by step.")
    assert data.column_names == ["prompt", "answer"] and len(data) == 1
    assert data[0]["prompt"] == [{"role": "system", "content": "Reason step by step."},
                                 {"role": "user", "content": "Q: 2+3?"}]
    from grpo_variants import get_reward

    assert get_reward("math_accuracy")(completions=["the answer is \\boxed{5}"], answer=data["answer"]) == [1.0]
    path2 = tmp_path / "chat.jsonl"
    path2.write_text(json.dumps(rows[2]))
    data = common.load_prompts(common.DatasetSpec(str(path2), prompt="problem", answer="meta.gold"))
    assert data[0]["prompt"] == [{"role": "user", "content": "chat 4*4?"}] and data[0]["answer"] == "16"


@pytest.mark.slow
@pytest.mark.parametrize("module", ["grpo_qwen", "dr_grpo_qwen", "gspo_qwen3_moe", "fipo_qwen32b"])
def test_recipe_toy_run(module, toy_model_path, tmp_path):
    """The recipe script itself, launched as a user would, on the toy kit (``--toy``)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(RECIPES_DIR / f"{module}.py"), "--toy", "--max_steps", "2",
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out accuracy after" in result.stdout
    assert (tmp_path / "out" / "config.json").exists()  # the trained policy was saved
