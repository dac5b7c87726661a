"""Dynamic sampling's top-up sized from the running pass rate, and the token ledger (where generated tokens go)."""

from __future__ import annotations

import math

import pytest

from grpo_variants import ConfigError, GRPOVariantConfig, get_variant
from grpo_variants.metrics import TOKEN_FATES
from grpo_variants.rollout.sampling import topup_groups


# ------------------------------------------------------------------------------------------------
# The pure size rule
# ------------------------------------------------------------------------------------------------
def test_topup_groups_formula_bounds_and_rounding():
    # n = ceil((d + z sqrt(d (1 - p))) / p) - already, hand-computed
    assert topup_groups(10, 0.5, margin=0.0, max_groups=64) == 20
    assert topup_groups(10, 0.5, margin=1.0, max_groups=64) == 25  # (10 + sqrt(5)) / 0.5 = 24.47
    assert topup_groups(7, 1.0, margin=1.0, max_groups=64) == 7  # p = 1: no variance, exactly the deficit
    assert topup_groups(3, 0.75, margin=0.0, max_groups=64) == 4  # 3 / 0.75 = 4 exactly, no rounding up to 5
    assert topup_groups(64, 0.8, margin=0.0, max_groups=64, already=64) == 16  # 80 in all, 64 from the loader
    assert topup_groups(10, 0.8, margin=1.0, max_groups=64, already=64) == 0  # the loader's groups are enough
    # nothing missing; no pass rate yet (or 0): a whole batch, or nothing to predict the first call from
    assert topup_groups(0, 0.5, max_groups=64) == 0
    assert topup_groups(10, None, max_groups=64) == topup_groups(10, 0.0, max_groups=64) == 64
    assert topup_groups(10, None, max_groups=64, already=64) == 0
    # floor and cap
    assert topup_groups(1, 1.0, margin=0.0, min_groups=4, max_groups=64) == 4
    assert topup_groups(100, 0.5, margin=0.0, max_groups=64) == 64
    # lock-step: a multiple of processes / gcd(G, processes), rounded up, or down where the cap forbids it
    assert topup_groups(5, 1.0, margin=0.0, max_groups=64, multiple=4) == 8
    assert topup_groups(100, 0.5, margin=0.0, max_groups=10, multiple=4) == 8


def test_topup_config_is_checked():
    with pytest.raises(ConfigError, match="dynamic_sampling_topup="):
        GRPOVariantConfig(output_dir="o", dynamic_sampling_topup="half")
    with pytest.raises(ConfigError, match="dynamic_sampling_topup_margin"):
        GRPOVariantConfig(output_dir="o", dynamic_sampling_topup_margin=-1.0)
    with pytest.raises(ConfigError, match="dynamic_sampling_pass_rate_decay"):
        GRPOVariantConfig(output_dir="o", dynamic_sampling_pass_rate_decay=1.0)
    with pytest.raises(ConfigError, match="dynamic_sampling_topup_min_groups"):
        GRPOVariantConfig(output_dir="o", dynamic_sampling_topup_min_groups=0)
    with pytest.raises(ConfigError, match="dynamic_sampling_topup_min_groups"):
        GRPOVariantConfig(output_dir="o", dynamic_sampling_topup_min_groups=4, dynamic_sampling_topup_max_groups=2)


# ------------------------------------------------------------------------------------------------
# In training: a reward pattern whose pass rate is known by construction
# ------------------------------------------------------------------------------------------------
G = 4


def three_of_every_four_groups(prompts, completions, **kwargs):
    """Within each reward call (one generation round), group j varies (0/1) unless j % 4 == 3 (constant, dropped).

    A round of n groups therefore has exactly n - n // 4 qualifying groups, whatever the policy samples.
    """
    return [0.0 if (i // G) % 4 == 3 else float(i % 2) for i in range(len(completions))]


def _qualifying(n: int) -> int:
    return n - n // 4


def _expected_rounds(steps: int, needed: int, decay: float, margin: float = 1.0):
    """The rule written out independently: (round sizes, carried in, carried out, running rate) per batch."""
    def size(d, rate):
        return math.ceil((d + margin * math.sqrt(d * (1 - rate))) / rate - 1e-9)

    q_sum = n_sum = 0.0
    carry, out = 0, []
    for _ in range(steps):
        carried_in = carry
        extra = 0
        if n_sum:  # the first call adds its predicted top-up, bounded so the surplus stays below one batch
            extra = min(max(size(needed - carry, q_sum / n_sum) - needed, 0), needed - 1 - carry)
        sizes = [needed + extra]
        have, batch_q, batch_n = carry + _qualifying(sizes[0]), _qualifying(sizes[0]), sizes[0]
        q_sum, n_sum = decay * q_sum + _qualifying(sizes[0]), decay * n_sum + sizes[0]
        while have < needed:
            rate = min(q_sum / n_sum, batch_q / batch_n)
            n = min(max(size(needed - have, rate), 1), needed)
            sizes.append(n)
            have, batch_q, batch_n = have + _qualifying(n), batch_q + _qualifying(n), batch_n + n
            q_sum, n_sum = decay * q_sum + _qualifying(n), decay * n_sum + n
        carry = have - needed
        out.append((sizes, carried_in, carry, q_sum / n_sum))
    return out


def test_topup_follows_the_running_pass_rate(toy_model_path, small_train_dataset, make_args):
    spec = get_variant("grpo")
    args = make_args(spec.config_cls, max_steps=6, dynamic_sampling=True, reward_cache=False, max_num_gen_batches=0)
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=three_of_every_four_groups, args=args,
                               train_dataset=small_train_dataset)
    infos, generated_calls = [], []
    trainer._on_dynamic_sampling_batch = lambda batch, info: infos.append(info)
    generate = trainer._generate

    def _generate(prompts):
        generated_calls.append(len(prompts))
        return generate(prompts)

    trainer._generate = _generate
    trainer.train()
    expected = _expected_rounds(6, needed=4, decay=args.dynamic_sampling_pass_rate_decay)
    assert [(i.round_groups, i.groups_carried_in, i.groups_carried_out) for i in infos] == [e[:3] for e in expected]
    assert generated_calls == [G * n for i in infos for n in i.round_groups]  # each round is one generate call
    # the case is not trivial: top-up rounds smaller than a generation batch, and first calls holding a top-up
    assert any(n < 4 for i in infos for n in i.round_groups[1:])
    assert any(i.round_groups[0] > 4 for i in infos)
    logged = [r for r in trainer.state.log_history if "dynamic_sampling/topup_groups" in r]
    assert [r["dynamic_sampling/topup_groups"] for r in logged] == [sum(e[0]) - 4 for e in expected]
    assert [r["dynamic_sampling/running_pass_rate"] for r in logged] == pytest.approx([e[3] for e in expected])
    assert trainer.running_pass_rate == pytest.approx(expected[-1][3])


def test_whole_batch_topups_when_asked(toy_model_path, small_train_dataset, make_args):
    spec = get_variant("grpo")
    args = make_args(spec.config_cls, max_steps=3, dynamic_sampling=True, reward_cache=False,
                     dynamic_sampling_topup="full")
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=three_of_every_four_groups, args=args,
                               train_dataset=small_train_dataset)
    infos = []
    trainer._on_dynamic_sampling_batch = lambda batch, info: infos.append(info)
    trainer.train()
    assert all(n == 4 for i in infos for n in i.round_groups)  # verl's rounds: one generation batch each
    # 3 of 4 qualify per round: 3 + 3 -> carry 2; 2 + 3 -> carry 1; 1 + 3 -> carry 0
    assert [i.round_groups for i in infos] == [[4, 4], [4], [4]]


# ------------------------------------------------------------------------------------------------
# The token ledger
# ------------------------------------------------------------------------------------------------
def test_token_ledger_accounts_for_every_generated_token(toy_model_path, small_train_dataset, make_args):
    spec = get_variant("dapo")
    args = make_args(spec.config_cls, mini_batches_per_rollout=2, max_steps=4, reward_cache=False,
                     max_num_gen_batches=0)
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=three_of_every_four_groups, args=args,
                               train_dataset=small_train_dataset)
    dropped, lengths = [], []
    select = trainer._dynamic_sampling_rollout

    def rollout(inputs):
        before = trainer._token_ledger["dropped_by_filter"]
        out = select(inputs)
        dropped.append(trainer._token_ledger["dropped_by_filter"] - before)
        return out

    trainer._dynamic_sampling_rollout = rollout
    scored = trainer._scored_rollout

    def _scored_rollout(batch):
        output = scored(batch)
        per_group = output["generated_mask"].sum(dim=1).view(-1, G).sum(dim=1)
        lengths.append(int(per_group[3::4].sum()))  # the groups the pattern makes constant (dropped)
        return output

    trainer._scored_rollout = _scored_rollout
    trainer.train()
    ledger = trainer.token_ledger()
    tokens = ledger["tokens"]
    # every generated token has exactly one fate, and the run left nothing in the buffer
    assert set(TOKEN_FATES) <= set(tokens)
    assert ledger["generated"] == trainer._tokens_generated_total > 0
    assert tokens["unaccounted"] == 0
    assert sum(tokens[k] for k in (*TOKEN_FATES, "carried_pending")) == ledger["generated"]
    # dropped: exactly the tokens of the groups the filter removed
    assert sum(dropped) == tokens["dropped_by_filter"] == sum(lengths) > 0
    # useful: the same count as the useful-token fraction's
    assert tokens["useful"] == trainer._tokens_useful_total
    carried = trainer._ds_carried
    assert tokens["carried_pending"] == (0 if carried is None else int(carried["generated_mask"].sum()))
    assert ledger["fractions"]["signal"] == pytest.approx(
        sum(tokens[k] for k in ("useful", "clipped_dual", "clipped_low", "clipped_high", "no_gradient_other"))
        / ledger["generated"])
    split = ledger["carried_rows"]  # the carried groups' share of the signal tokens, and their clipped ones
    assert 0 <= split["clipped"] <= split["signal"] <= tokens["signal"]
    assert "token_ledger" in trainer.variant_state_dict()
    logged = [r for r in trainer.state.log_history if "tokens/signal_fraction" in r]
    assert logged and all(f"token_fate/{name}" in logged[-1] for name in TOKEN_FATES)


def test_token_ledger_charges_zero_advantage_without_dynamic_sampling(toy_model_path, small_train_dataset,
                                                                     make_args):
    spec = get_variant("grpo")
    args = make_args(spec.config_cls, max_steps=2, reward_cache=False)
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=three_of_every_four_groups, args=args,
                               train_dataset=small_train_dataset)
    lengths = []
    scored = trainer._scored_rollout

    def _scored_rollout(batch):
        output = scored(batch)
        lengths.append(int(output["completion_mask"].sum(dim=1).view(-1, G).sum(dim=1)[3::4].sum()))
        return output

    trainer._scored_rollout = _scored_rollout
    trainer.train()
    tokens = trainer.token_ledger()["tokens"]
    # plain GRPO trains the constant groups with advantage exactly 0: their tokens, and only theirs
    assert tokens["zero_advantage"] == sum(lengths) > 0
    assert tokens["dropped_by_filter"] == tokens["carried_pending"] == tokens["unaccounted"] == 0
    assert trainer.token_ledger()["carried_rows"] == {"signal": 0, "clipped": 0}
    assert tokens["useful"] + tokens["zero_advantage"] + tokens["masked"] == trainer._tokens_generated_total
