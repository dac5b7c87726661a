"""The arithmetic word-problem task: golds follow from the stated numbers, splits are disjoint, s.e. is binomial."""

from __future__ import annotations

import math
import random
import re

import pytest

from grpo_variants.tasks import word_problems as wp
from grpo_variants.rewards import math_accuracy
from grpo_variants.rewards.columns import check_reward_columns

RULES = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "add_sub": lambda a, b, c: a + b - c,
    "mul_add": lambda a, b, c: a * b + c,
    "sub_add": lambda a, b, c: a - b + c,
}


def test_gold_follows_from_the_numbers_in_the_question():
    rng = random.Random(123)
    kinds = set()
    for _ in range(600):
        p = wp.generate_problem(rng)
        numbers = [int(x) for x in re.findall(r"\d+", p.question)]
        assert numbers, p.question
        assert p.answer == RULES[p.kind](*numbers), p
        assert p.answer >= 0 and p.steps == (1 if p.kind in ("add", "sub", "mul") else 2)
        kinds.add(p.kind)
    assert kinds == set(RULES)


def test_dataset_is_chat_formatted_deterministic_and_held_out():
    train = wp.make_dataset("train", 300, seed=0)
    again = wp.make_dataset("train", 300, seed=0)
    assert train["prompt"] == again["prompt"] and train["answer"] == again["answer"]
    prompt = train[0]["prompt"]
    assert prompt[0]["role"] == "user" and prompt[0]["content"].endswith(wp.INSTRUCTION)
    eval_ds = wp.make_dataset("eval", 200, seed=0)
    assert len(eval_ds) == 200
    seen = {p.question for p in wp.make_problems(20_000, 0)}
    assert not any(row[0]["content"].replace(" " + wp.INSTRUCTION, "") in seen for row in eval_ds["prompt"])
    assert isinstance(wp.make_dataset("train", 3, conversational=False)["prompt"][0], str)
    check_reward_columns([math_accuracy], train)  # the registered reward reads the task's gold column


def test_math_accuracy_scores_boxed_answers_of_the_task():
    ds = wp.make_dataset("train", 4, seed=1)
    right = [f"The answer is \\boxed{{{g}}}." for g in ds["answer"]]
    wrong = [f"\\boxed{{{int(g) + 1}}}" for g in ds["answer"]]
    assert math_accuracy(prompts=ds["prompt"], completions=right, answer=ds["answer"]) == [1.0] * 4
    assert math_accuracy(prompts=ds["prompt"], completions=wrong, answer=ds["answer"]) == [0.0] * 4


def test_accuracy_with_stderr():
    assert wp.accuracy_with_stderr([True, False, False, False]) == pytest.approx((0.25, math.sqrt(0.25 * 0.75 / 4)))
    assert wp.accuracy_with_stderr([]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="split"):
        wp.make_dataset("test", 2)
