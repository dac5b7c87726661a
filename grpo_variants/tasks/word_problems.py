"""Arithmetic word problems: a natural-language verifiable task for small real chat models.

Each problem is a short story with one or two arithmetic steps on small whole numbers and a single
whole-number answer ("Mia has 12 apples. She buys 7 more. How many apples does Mia have now?"). The
prompt is in chat form (``[{"role": "user", "content": ...}]``) and asks for the final answer as
``\\boxed{N}``; the gold number is in the ``answer`` column, which :func:`math_accuracy` reads (it also
accepts TRL's ``solution``), so the task works with the registered ``math_accuracy`` reward.

Why this task for SmolLM2-135M-Instruct on a CPU:

* **Verifiable and unambiguous**: one integer answer, checked exactly; no judge model.
* **Partly solvable at the start**: the model understands the stories and often gets one-step sums
  right, but it rarely uses the required ``\\boxed{}`` format and it slips on subtraction and two-step
  problems, so its greedy accuracy starts low but not at zero: GRPO has a signal from the first step
  (groups with both right and wrong answers) and room to improve (format, then arithmetic).
* **Short answers**: the answer fits in ~10 tokens, so 24-32 new tokens per completion suffice and a
  training step on 2 CPU cores takes seconds to tens of seconds, not minutes.
* **Natural language and a real chat template**: unlike the toy task's ``37+45=`` strings, it exercises
  a BPE tokenizer, a ChatML template and an ``<|im_end|>`` end of turn.
* **Held-out evaluation**: the ``train`` and ``eval`` splits come from different seeds and every eval
  problem whose text also occurs in the train split is removed, so evaluation is on unseen problems.

Problems are generated deterministically from a seed (:func:`make_dataset`); :func:`evaluate` measures
greedy accuracy with its standard error.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from grpo_variants.rewards.registry import reward
from grpo_variants.rewards.steps import step_reward

__all__ = [
    "INSTRUCTION",
    "Problem",
    "generate_problem",
    "make_problems",
    "make_dataset",
    "evaluate",
    "accuracy_with_stderr",
    "word_problem_steps",
]

INSTRUCTION = "Reply with only the final answer in the form \\boxed{N}."

_NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ella", "Noah", "Lily", "Ben", "Emma", "Max"]
_PRONOUN = {"Mia": "She", "Ava": "She", "Zoe": "She", "Ella": "She", "Lily": "She", "Emma": "She",
            "Tom": "He", "Leo": "He", "Sam": "He", "Noah": "He", "Ben": "He", "Max": "He"}
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards", "shells", "balloons"]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    kind: str  # add, sub, mul, add_sub, mul_add, sub_add
    steps: int
    intermediate: int | None = None  # the first step's result of a two-step problem (process supervision)


def generate_problem(rng: random.Random) -> Problem:
    """One problem: five one-step and two-step templates with small whole numbers (answers 0..~100)."""
    name = rng.choice(_NAMES)
    he = _PRONOUN[name]
    item = rng.choice(_ITEMS)
    kind = rng.choice(["add", "sub", "mul", "add_sub", "mul_add", "sub_add"])
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        q = f"{name} has {a} {item}. {he} gets {b} more. How many {item} does {name} have now?"
        return Problem(q, a + b, kind, 1)
    if kind == "sub":
        a = rng.randint(10, 50)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item}. {he} gives away {b} of them. How many {item} does {name} have left?"
        return Problem(q, a - b, kind, 1)
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?"
        return Problem(q, a * b, kind, 1)
    if kind == "add_sub":
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}. {he} buys {b} more and then gives {c} to a friend. "
             f"How many {item} does {name} have now?")
        return Problem(q, a + b - c, kind, 2, a + b)
    if kind == "mul_add":
        a, b, c = rng.randint(2, 6), rng.randint(2, 6), rng.randint(1, 15)
        q = (f"{name} buys {a} bags with {b} {item} in each bag. {he} already had {c} {item}. "
             f"How many {item} does {name} have now?")
        return Problem(q, a * b + c, kind, 2, a * b)
    # sub_add
    a = rng.randint(10, 40)
    b = rng.randint(1, a - 1)
    c = rng.randint(1, 20)
    q = (f"{name} has {a} {item}. {he} loses {b} of them and then finds {c} more. "
         f"How many {item} does {name} have now?")
    return Problem(q, a - b + c, kind, 2, a - b)


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [generate_problem(rng) for _ in range(n)]


def _split_seed(split: str, seed: int) -> int:
    offsets = {"train": 0, "eval": 1_000_003}
    if split not in offsets:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return seed + offsets[split]


def make_dataset(split: str = "train", n: int = 1000, seed: int = 0, *, conversational: bool = True):
    """A ``datasets.Dataset`` with ``prompt`` (chat messages, or a string), ``answer`` (the gold number
    as a string), ``kind`` and ``steps``. The ``eval`` split excludes every question of the
    ``train`` split of the same seed and size (up to 20,000 training problems are screened)."""
    from datasets import Dataset

    problems = make_problems(n, _split_seed(split, seed))
    if split == "eval":
        seen = {p.question for p in make_problems(max(n, 20_000), _split_seed("train", seed))}
        rng = random.Random(_split_seed(split, seed) + 7)
        problems = [p for p in problems if p.question not in seen]
        while len(problems) < n:
            p = generate_problem(rng)
            if p.question not in seen:
                problems.append(p)

    def prompt(p: Problem):
        text = f"{p.question} {INSTRUCTION}"
        return [{"role": "user", "content": text}] if conversational else text

    return Dataset.from_dict(
        {
            "prompt": [prompt(p) for p in problems],
            "answer": [str(p.answer) for p in problems],
            "kind": [p.kind for p in problems],
            "steps": [p.steps for p in problems],
            "intermediate": [-1 if p.intermediate is None else p.intermediate for p in problems],
        }
    )


_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_NUMBER = re.compile(r"-?\d+")


def _steps_of(text: str, gold: str, intermediate: int, given: set[int]) -> list[tuple[int, float]]:
    boxed = list(_BOXED.finditer(text))
    final = boxed[-1] if boxed else None
    steps = []
    if intermediate >= 0:  # a two-step problem: the first new quantity stated before the answer is the first step
        before = text[: final.start()] if final else text
        for number in _NUMBER.finditer(before):
            value = int(number.group())
            if value == intermediate or value not in given:  # a number of the question restated is no step
                steps.append((number.end(), 1.0 if value == intermediate else 0.0))
                break
    if final is not None:
        steps.append((final.end(), 1.0 if final.group(1) == str(gold).strip() else 0.0))
    else:
        steps.append((len(text), 0.0))  # no boxed answer: the last step scores 0
    return steps


@step_reward
def word_problem_steps(prompts, completions, answer, intermediate, **kwargs):
    """Word problems, per step: for a two-step problem the first new quantity the completion states (a number that
    is not one of the question's, or the intermediate itself) scores 1 when it is the intermediate quantity (a + b,
    a x b or a - b), 0 otherwise; the boxed answer scores 1 when right (0, ending the completion, when there is
    none). Needs the dataset's ``answer`` and ``intermediate`` columns (``intermediate`` is -1 for a one-step
    problem)."""
    from grpo_variants.rewards.robust import _completion_text

    out = []
    for p, c, g, m in zip(prompts, completions, answer, intermediate, strict=True):
        given = {int(x) for x in _NUMBER.findall(_completion_text(p))} if p is not None else set()
        out.append(_steps_of(_completion_text(c), g, int(m), given))
    return out


def accuracy_with_stderr(correct: list[bool]) -> tuple[float, float]:
    """Mean and its binomial standard error sqrt(p(1-p)/n)."""
    n = len(correct)
    if n == 0:
        return 0.0, 0.0
    p = sum(bool(c) for c in correct) / n
    return p, math.sqrt(p * (1 - p) / n)


def evaluate(model, tokenizer, dataset, *, max_new_tokens: int = 32, batch_size: int = 32,
             return_details: bool = False):
    """Greedy held-out accuracy of ``model`` on ``dataset`` scored with ``math_accuracy``.

    Returns ``{"accuracy", "stderr", "n", "correct", "by_kind"}`` (``correct`` is the per-problem list
    of booleans, for paired comparisons; ``completions`` too when ``return_details``).
    """
    import torch

    from grpo_variants.rewards.builtin import MathAccuracy

    judge = MathAccuracy()
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    texts, completions = [], []
    for prompt in dataset["prompt"]:
        if isinstance(prompt, list):
            texts.append(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        else:
            texts.append(prompt)
    try:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            enc = {k: v.to(model.device) for k, v in enc.items()}
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    correct = [bool(judge.judge(c, g)) for c, g in zip(completions, dataset["answer"], strict=True)]
    acc, se = accuracy_with_stderr(correct)
    by_kind: dict[str, list[bool]] = {}
    for ok, kind in zip(correct, dataset["kind"] if "kind" in dataset.column_names else ["all"] * len(correct)):
        by_kind.setdefault(kind, []).append(ok)
    result = {
        "accuracy": acc,
        "stderr": se,
        "n": len(correct),
        "correct": correct,
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
    }
    if return_details:
        result["completions"] = completions
    return result


word_problem_steps = reward(
    "word_problem_steps",
    "Word problems, step reward: the intermediate quantity of a two-step problem, then the boxed answer (process "
    "supervision)",
)(word_problem_steps)
