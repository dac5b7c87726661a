"""Built-in reward functions, registered by name (``grpo-variants train --reward NAME``).

Every reward has TRL's signature ``f(prompts, completions, completion_ids=None, **kwargs)`` and
returns one float (or None = missing) per completion. Completions may be strings or, in the
conversational format, lists of messages (the text of the last message is scored).

The parametrised rewards are small classes (picklable, with a ``__name__`` that TRL uses as the
metric name) built by factories; :func:`build_reward` builds any of them from a config mapping::

    build_reward("overlong_penalty", max_completion_len=4096, soft_cache_len=512)
    build_reward({"name": "math_accuracy", "correct": 1.0, "wrong": -1.0})

Registered names: ``math_accuracy`` (+1/0), ``math_accuracy_pm1`` (+1/-1), ``format_think_answer``,
``dapo_overlong`` (DAPO eq. 13 with L_max = 20480, L_cache = 4096), ``length_cosine``,
``code_pass``, ``code_pass_fraction``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from typing import Any, Callable, Mapping

from grpo_variants.errors import ConfigError, DatasetError, RewardFunctionError
from grpo_variants.rewards.math_verify_utils import (
    answers_match,
    extract_final_answer,
    extract_gold_answer,
    gold_is_parsable,
)
from grpo_variants.rewards import judge
from grpo_variants.rewards.registry import reward
from grpo_variants.rewards.sandbox import SandboxPool, SandboxResult

logger = logging.getLogger(__name__)

__all__ = [
    "completion_text",
    "MathAccuracy",
    "make_math_accuracy",
    "FormatReward",
    "make_format_reward",
    "OverlongPenalty",
    "make_overlong_penalty",
    "overlong_penalty_value",
    "LengthCosine",
    "make_length_cosine",
    "CodeReward",
    "make_code_reward",
    "extract_code",
    "REWARD_FACTORIES",
    "build_reward",
    "math_accuracy",
    "math_accuracy_pm1",
    "format_think_answer",
    "dapo_overlong",
    "length_cosine",
    "code_pass",
    "code_pass_fraction",
]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """The text of a completion: a string as is; for a list of messages, the last message's content."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return completion_text(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        last = completion[-1]
        if isinstance(last, Mapping) and "content" in last:
            content = last.get("content")
            if isinstance(content, (list, tuple)):  # multimodal parts: [{"type": "text", "text": ...}]
                return "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
            return "" if content is None else str(content)
        if isinstance(last, Mapping) and last.get("type") == "text":
            return "".join(p.get("text", "") for p in completion if isinstance(p, Mapping))
        return str(last)
    return str(completion)


def _column(kwargs: dict, column: str, n: int, reward_name: str) -> list:
    if column not in kwargs or kwargs[column] is None:
        have = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric", "environments"))
        raise DatasetError(
            f"Reward '{reward_name}' needs the dataset column '{column}', which the batch does not have "
            f"(columns present: {have or 'none'}). Add the column to the dataset, or pass "
            f"{column}_column=... to the reward's factory."
        )
    values = list(kwargs[column])
    if len(values) != n:
        raise DatasetError(
            f"Reward '{reward_name}': column '{column}' has {len(values)} values for {n} completions."
        )
    return values


def _completion_lengths(completion_ids, n: int, reward_name: str) -> list[int]:
    if completion_ids is None:
        raise RewardFunctionError(
            f"Reward '{reward_name}' measures length in tokens and needs completion_ids (TRL passes them); "
            "call it as f(prompts=..., completions=..., completion_ids=...)."
        )
    ids = list(completion_ids)
    if len(ids) != n:
        raise RewardFunctionError(f"Reward '{reward_name}': {len(ids)} completion_ids for {n} completions.")
    return [len(x) for x in ids]


class _NamedReward:
    """Base: a picklable callable with a ``__name__`` (TRL's metric name)."""

    __name__: str

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"

    def _params(self) -> dict:
        return {}

    @property
    def required_columns(self) -> list[str]:
        """The dataset columns this reward reads: every ``*_column`` parameter (checked at construction)."""
        return [v for k, v in self._params().items() if k.endswith("_column") and isinstance(v, str)]


# --------------------------------------------------------------------------------------------
# Math accuracy
# --------------------------------------------------------------------------------------------
_warned_golds: set[str] = set()
_warn_lock = threading.Lock()
_MAX_GOLD_WARNINGS = 20


def _warn_unparsable_gold(gold: object, reward_name: str) -> None:
    key = repr(gold)[:200]
    with _warn_lock:
        if key in _warned_golds or len(_warned_golds) >= _MAX_GOLD_WARNINGS:
            return
        _warned_golds.add(key)
    logger.warning(
        "Reward '%s': cannot parse the gold answer %s; its samples score None (missing, ignored by TRL). "
        "Fix the dataset's answer column.",
        reward_name,
        key,
    )


class MathAccuracy(_NamedReward):
    """Whether the completion's final answer equals the gold answer (``correct`` / ``wrong`` score).

    The gold answer is read from ``answer_column`` (default ``answer``; with the default, a dataset
    with TRL's ``solution`` column instead works too). The final answer is the last ``\\boxed{...}``,
    else "#### X" / "The answer is X" / "Answer: X", else the last number. Equivalence: math_verify when importable (its timeouts
    disabled) or-ed with a built-in normaliser (1/2 == 0.5 == \\frac{1}{2} == \\dfrac12);
    see :mod:`grpo_variants.rewards.math_verify_utils`. A gold answer that cannot be parsed
    scores None (missing) with a one-time warning naming it.
    """

    factory_name = "make_math_accuracy"  # named in the missing-column error: point it at another column

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = 0.0,
        *,
        answer_column: str = "answer",
        use_math_verify: bool | None = None,
        name: str = "math_accuracy",
    ):
        self.correct = float(correct)
        self.wrong = float(wrong)
        self.answer_column = answer_column
        self.use_math_verify = use_math_verify
        self.__name__ = name

    def _params(self) -> dict:
        return {"correct": self.correct, "wrong": self.wrong, "answer_column": self.answer_column}

    @property
    def _gold_columns(self) -> tuple[str, ...]:
        # The default column also accepts TRL's `accuracy_reward` convention, `solution`.
        return (self.answer_column, "solution") if self.answer_column == "answer" else (self.answer_column,)

    @property
    def required_columns(self) -> list[tuple[str, ...]]:
        """One of ``answer`` / ``solution`` (or the configured ``answer_column``)."""
        return [self._gold_columns]

    def judge(self, completion: Any, gold: object) -> bool | None:
        """True / False, or None when the gold answer is unparsable."""
        g = extract_gold_answer(gold)
        if not gold_is_parsable(g):
            _warn_unparsable_gold(gold, self.__name__)
            return None
        pred = extract_final_answer(completion_text(completion))
        return answers_match(pred, g, use_math_verify=self.use_math_verify)

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        completions = list(completions or [])
        column = next((c for c in self._gold_columns if kwargs.get(c) is not None), self.answer_column)
        golds = _column(kwargs, column, len(completions), self.__name__)
        out: list[float | None] = []
        for c, g in zip(completions, golds):
            ok = self.judge(c, g)
            out.append(None if ok is None else (self.correct if ok else self.wrong))
        return out


def make_math_accuracy(correct: float = 1.0, wrong: float = 0.0, **options) -> MathAccuracy:
    """A math accuracy reward scoring ``correct`` / ``wrong`` (e.g. ``make_math_accuracy(1.0, -1.0)``)."""
    options.setdefault("name", "math_accuracy" if (correct, wrong) == (1.0, 0.0) else "math_accuracy_custom")
    return MathAccuracy(correct, wrong, **options)


# --------------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------------
class FormatReward(_NamedReward):
    """1.0 when the completion is ``<think>...</think>`` followed by a non-empty answer, else 0.0.

    With ``answer_tag="answer"`` the answer must be ``<answer>non-empty</answer>`` and nothing may
    follow it. ``require_open_tag=False`` accepts a completion that starts inside the thinking
    block (chat templates that put ``<think>`` in the prompt). Exactly one thinking block.
    """

    def __init__(
        self,
        think_tag: str = "think",
        answer_tag: str | None = None,
        *,
        require_open_tag: bool = True,
        name: str = "format_think_answer",
    ):
        if not think_tag or not re.fullmatch(r"[\w.-]+", think_tag):
            raise ConfigError(f"make_format_reward: think_tag must be a tag name like 'think', got {think_tag!r}.")
        if answer_tag is not None and not re.fullmatch(r"[\w.-]+", answer_tag):
            raise ConfigError(f"make_format_reward: answer_tag must be a tag name or None, got {answer_tag!r}.")
        self.think_tag, self.answer_tag, self.require_open_tag = think_tag, answer_tag, require_open_tag
        self.__name__ = name
        t = re.escape(think_tag)
        opening = f"<{t}>" if require_open_tag else f"(?:<{t}>)?"
        no_tags = f"(?:(?!</?{t}>).)*"
        if answer_tag is None:
            answer = rf"{no_tags}?(?!</?{t}>)\S{no_tags}"
        else:
            a = re.escape(answer_tag)
            in_answer = f"(?:(?!</?{a}>|</?{t}>).)*"
            answer = rf"<{a}>{in_answer}?(?!</?{a}>)\S{in_answer}</{a}>\s*"
        self._pattern = re.compile(rf"\s*{opening}{no_tags}</{t}>\s*{answer}", re.DOTALL)

    def _params(self) -> dict:
        return {"think_tag": self.think_tag, "answer_tag": self.answer_tag, "require_open_tag": self.require_open_tag}

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_pattern", None)
        return state

    def __setstate__(self, state):
        self.__init__(state["think_tag"], state["answer_tag"], require_open_tag=state["require_open_tag"],
                      name=state["__name__"])

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        return [1.0 if self._pattern.fullmatch(completion_text(c)) else 0.0 for c in (completions or [])]


def make_format_reward(think_tag: str = "think", answer_tag: str | None = None, **options) -> FormatReward:
    return FormatReward(think_tag, answer_tag, **options)


# --------------------------------------------------------------------------------------------
# DAPO overlong shaping (eq. 13)
# --------------------------------------------------------------------------------------------
def overlong_penalty_value(length: int, max_completion_len: int, soft_cache_len: int) -> float:
    """DAPO eq. 13: 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache in the buffer; -1 beyond L_max."""
    threshold = max_completion_len - soft_cache_len
    if length <= threshold:
        return 0.0
    if length <= max_completion_len:
        return (threshold - length) / soft_cache_len
    return -1.0


class OverlongPenalty(_NamedReward):
    """DAPO soft overlong punishment (eq. 13), added to the correctness reward.

    L = number of completion tokens (``len(completion_ids[i])``):
    0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache for L_max - L_cache < L <= L_max
    (linear from 0 to -1); -1 if L > L_max. Set L_max to the trainer's ``max_completion_length``.
    """

    def __init__(self, max_completion_len: int, soft_cache_len: int, *, name: str = "overlong_penalty"):
        for field, v in (("max_completion_len", max_completion_len), ("soft_cache_len", soft_cache_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"make_overlong_penalty: {field} must be a positive integer, got {v!r}.")
        if soft_cache_len > max_completion_len:
            raise ConfigError(
                f"make_overlong_penalty: soft_cache_len ({soft_cache_len}) must not exceed max_completion_len "
                f"({max_completion_len}); DAPO uses L_max = 20480 with L_cache = 4096."
            )
        self.max_completion_len = max_completion_len
        self.soft_cache_len = soft_cache_len
        self.__name__ = name

    def _params(self) -> dict:
        return {"max_completion_len": self.max_completion_len, "soft_cache_len": self.soft_cache_len}

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        n = len(completions) if completions is not None else len(completion_ids or [])
        lengths = _completion_lengths(completion_ids, n, self.__name__)
        return [overlong_penalty_value(L, self.max_completion_len, self.soft_cache_len) for L in lengths]


def make_overlong_penalty(
    max_completion_len: int, soft_cache_len: int, *, name: str = "overlong_penalty"
) -> OverlongPenalty:
    """DAPO eq. 13 with L_max = ``max_completion_len`` and L_cache = ``soft_cache_len`` (token counts)."""
    return OverlongPenalty(int(max_completion_len), int(soft_cache_len), name=name)


# --------------------------------------------------------------------------------------------
# Cosine length scaling (Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs")
# --------------------------------------------------------------------------------------------
class LengthCosine(_NamedReward):
    """Cosine length-scaled correctness reward (Yeo et al. 2025, arXiv 2502.03373).

    With L the completion length in tokens and T = ``max_len``::

        R = r_e                                              if L >= T
        R = r_T + (r_0 - r_T) * (1 + cos(pi * L / T)) / 2     otherwise

    where (r_0, r_T) = (r0_correct, rL_correct) for a correct answer and (r0_wrong, rL_wrong) for
    a wrong one: r_0 is the reward at length 0 and r_T the reward at length T, joined by a half
    cosine. The defaults (correct 1.0 -> 0.5, wrong -1.0 -> -0.5, exceed -1.0; those of open-r1's
    ``get_cosine_scaled_reward``) make short correct answers best and give wrong answers more room
    to think. Correctness comes from ``correctness`` (a reward function; score > ``threshold`` =
    correct; default: :class:`MathAccuracy`); a None correctness gives None.
    """

    def __init__(
        self,
        max_len: int,
        *,
        r0_correct: float = 1.0,
        rL_correct: float = 0.5,
        r0_wrong: float = -1.0,
        rL_wrong: float = -0.5,
        exceed_penalty: float = -1.0,
        correctness: Callable[..., list] | None = None,
        threshold: float = 0.5,
        name: str = "length_cosine",
    ):
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ConfigError(f"make_length_cosine: max_len must be a positive integer, got {max_len!r}.")
        self.max_len = max_len
        self.r0_correct, self.rL_correct = float(r0_correct), float(rL_correct)
        self.r0_wrong, self.rL_wrong = float(r0_wrong), float(rL_wrong)
        self.exceed_penalty = float(exceed_penalty)
        self.correctness = correctness if correctness is not None else MathAccuracy(1.0, 0.0)
        self.threshold = float(threshold)
        self.__name__ = name

    def _params(self) -> dict:
        return {
            "max_len": self.max_len, "r0_correct": self.r0_correct, "rL_correct": self.rL_correct,
            "r0_wrong": self.r0_wrong, "rL_wrong": self.rL_wrong, "exceed_penalty": self.exceed_penalty,
        }

    def value(self, length: int, correct: bool) -> float:
        if length >= self.max_len:
            return self.exceed_penalty
        r0, rT = (self.r0_correct, self.rL_correct) if correct else (self.r0_wrong, self.rL_wrong)
        return rT + (r0 - rT) * 0.5 * (1.0 + math.cos(math.pi * length / self.max_len))

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        completions = list(completions or [])
        lengths = _completion_lengths(completion_ids, len(completions), self.__name__)
        scores = self.correctness(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [None if s is None else self.value(L, s > self.threshold) for L, s in zip(lengths, scores)]


def make_length_cosine(max_len: int, **options) -> LengthCosine:
    return LengthCosine(int(max_len), **options)


# --------------------------------------------------------------------------------------------
# Code execution
# --------------------------------------------------------------------------------------------
_FENCE_LANG = re.compile(r"[ \t]*([\w+#.-]*)")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of each closed fenced block, left to right, in linear time: a fence is three
    backticks, its info string runs to the end of the line, its code to the next three backticks."""
    out = []
    pos = 0
    while True:
        i = text.find("```", pos)
        if i < 0:
            return out
        nl = text.find("\n", i + 3)
        if nl < 0:
            return out  # no later fence can have a line after it either
        end = text.find("```", nl + 1)
        if end < 0:
            return out
        lang = _FENCE_LANG.match(text, i + 3, nl).group(1)
        out.append((lang.lower(), text[nl + 1:end]))
        pos = end + 3


def extract_code(text: str) -> str:
    """The last ```python fenced block, else the last fenced block of any language, else (an unclosed
    final fence: the completion was truncated) what follows the first fence's line, else the whole text.
    Linear in the length of ``text`` whatever it holds (no regex backtracking)."""
    text = text or ""
    blocks = _fenced_blocks(text)
    py = [code for lang, code in blocks if lang in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    i = text.find("```")
    if i >= 0:
        nl = text.find("\n", i + 3)
        if nl >= 0:
            return text[nl + 1:]
    return text


class CodeReward(_NamedReward):
    """Runs the completion's program against the dataset's ``tests`` column in the sandbox: the tests run
    as Python in a program-free sandbox, the program (in its own sandbox) only answers calls.

    The program is the last ```python block (else any fenced block, else the whole text). ``tests``
    holds test code (a list of strings joined into one file, or one string: asserts, HumanEval's
    ``check(candidate)``, unittest classes, pytest-style ``test_*`` functions) and/or stdin/stdout cases
    (``{"input", "output"}`` items, or ``{"inputs": [...], "outputs": [...]}``); see
    :mod:`grpo_variants.rewards.judge`. The test file runs unmodified in the *tests' process*, every name of
    the program bound to a stub; a call sends its arguments, as values, to the program and gets back the
    return value and the arguments after the call. Nothing else crosses, so no expected value is ever in
    the program's process; Python itself decides every test.

    ``mode="all"``: 1.0 when every test passes, else 0.0; ``mode="fraction"``: the fraction that
    pass (each top-level statement holding an assert, each unittest method, each uncalled ``test_*``
    function, each stdin/stdout case is one test; a setup statement that fails counts as one failed test).
    A sample without tests scores None. ``on_unsupported`` (a test that passes the program something that
    is not data, or an item that does not parse): ``"error"`` (a DatasetError naming the test and why),
    ``"fail"`` (the test counts as failed) or ``"skip"`` (it is left out of the count; a sample with only
    such tests scores None); the last two log "unsupported test" once per test, all count it in
    ``last_unsupported``.

    **Time.** A completion's budget is of the program's *own* time (its sandbox's start-up, the time it
    takes to answer the calls, and its stdin/stdout runs), never the tests' time, relative to a
    program-free run on this machine *now*, as a judge's time limit is a multiple of its reference
    solution's time::

        budget = min(timeout, max(min_timeout, time_factor * n_runs * t_base))

    ``t_base`` is the start-up time of this call's fastest program-free sandbox (the tests' processes, or
    one calibration run when there is no test code), ``n_runs`` is 1 for the test file plus one per
    stdin/stdout case. Defaults: ``time_factor=4``, ``min_timeout=0.5`` s, ``timeout=10`` s (the
    ceiling); ``time_factor=None`` gives every completion the whole ``timeout``. A program that does real
    work beyond what a sandbox start costs needs a larger ``time_factor`` or ``None``. A program's sandbox
    starts beside the tests' processes and is stopped once its budget is spent, so a call whose completions
    fit in the workers returns within ``max(last_budgets)`` + 1 s when the tests' own code is quick, and
    within ``timeout`` + 1 s whatever either side does (every wait of the relay has a deadline).
    ``last_budgets`` holds each completion's budget; a time-out reason names it. ``test_timeout`` bounds
    each call into the program (SIGALRM there) and each test's own CPU time in the tests' process. Why each
    completion lost points is in ``last_reasons``. Completions are judged in parallel in a
    :class:`SandboxPool`'s threads; ``sandbox_options`` go to :func:`run_in_sandbox` (timeout, memory_mb, ...).
    """

    factory_name = "make_code_reward"  # named in the missing-column error: point it at another column

    def __init__(
        self,
        mode: str = "all",
        *,
        tests_column: str = "tests",
        max_workers: int | None = None,
        test_timeout: float = 5.0,
        on_unsupported: str = "error",
        time_factor: float | None = 4.0,
        min_timeout: float = 0.5,
        name: str | None = None,
        **sandbox_options,
    ):
        if mode not in ("all", "fraction"):
            raise ConfigError(f"make_code_reward: mode must be 'all' or 'fraction', got {mode!r}.")
        if time_factor is not None and (isinstance(time_factor, bool) or not isinstance(time_factor, (int, float))
                                        or not math.isfinite(time_factor) or time_factor < 1):
            raise ConfigError(f"make_code_reward: time_factor must be a number >= 1 (a completion's budget in units "
                              f"of a program-free run's time) or None (the whole timeout), got {time_factor!r}.")
        if isinstance(min_timeout, bool) or not isinstance(min_timeout, (int, float)) or not min_timeout > 0:
            raise ConfigError(f"make_code_reward: min_timeout must be a number of seconds > 0, got {min_timeout!r}.")
        if on_unsupported not in ("error", "fail", "skip"):
            raise ConfigError(f"make_code_reward: on_unsupported must be 'error', 'fail' or 'skip', got "
                              f"{on_unsupported!r}.")
        self.mode = mode
        self.tests_column = tests_column
        self.max_workers = max_workers
        self.test_timeout = float(test_timeout)
        self.on_unsupported = on_unsupported
        self.time_factor = None if time_factor is None else float(time_factor)
        self.min_timeout = float(min_timeout)
        # A timeout given without a time_factor is a ceiling the relative budget may stay under: said once.
        self._announce = "timeout" in sandbox_options and time_factor == 4.0
        self.sandbox_options = dict(sandbox_options)
        self.sandbox_options.setdefault("timeout", 10.0)
        self.sandbox_options.setdefault("cpu_time", 10)
        self.sandbox_options.setdefault("max_output_bytes", 1_000_000)
        self.__name__ = name or ("code_pass" if mode == "all" else "code_pass_fraction")
        self._pool: SandboxPool | None = None
        self._lock = threading.Lock()
        self.last_results: list[SandboxResult | None] = []
        self.last_reasons: list[list[str]] = []
        self.last_budgets: list[float | None] = []
        self.last_unsupported = 0

    def _params(self) -> dict:
        return {"mode": self.mode, "tests_column": self.tests_column, "time_factor": self.time_factor,
                "min_timeout": self.min_timeout, **self.sandbox_options}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = None
        state["_lock"] = None
        state["last_results"] = []
        state["last_reasons"] = []
        return state

    def __setstate__(self, state):
        state.setdefault("time_factor", 4.0)
        state.setdefault("min_timeout", 0.5)
        state.setdefault("last_budgets", [])
        state.setdefault("_announce", False)
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def pool(self) -> SandboxPool:
        if self._pool is not None and self._pool._pid != os.getpid():
            self._pool, self._lock = None, threading.Lock()  # forked (process isolation): a fresh pool
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.max_workers, **self.sandbox_options)
            return self._pool

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        completions = list(completions or [])
        tests_col = _column(kwargs, self.tests_column, len(completions), self.__name__)
        parsed: list[judge.Tests | None] = [None] * len(completions)
        for i, tests in enumerate(tests_col):
            t = judge.parse_tests(tests)
            if t.empty:
                logger.warning("Reward '%s': sample %d has no tests; it scores None.", self.__name__, i)
                continue
            if t.unparsable and self.on_unsupported == "error":  # known before anything runs
                raise DatasetError(self._unsupported(i, t.unparsable[0][1], t.unparsable[0][0]) + " Rewrite the "
                                   "test, or pass on_unsupported='fail' (counts it failed) or 'skip' (leaves it out).")
            parsed[i] = t
        todo = [i for i, t in enumerate(parsed) if t is not None and (t.source is not None or t.cases)]
        n_files = sum(parsed[i].source is not None for i in todo)
        ceiling = float(self.sandbox_options["timeout"])
        refs = None
        if n_files:  # the tests' processes start now; the programs start beside them (each charged its own time)
            n = min(self.pool.max_workers, n_files)
            refs = judge.ReferencePool(n, self.sandbox_options, lifetime=ceiling * (n_files // n + 2) + 30,
                                       ready_within=ceiling)
        budgets: list[float | None] = [None] * len(completions)
        self.last_budgets = budgets
        once = threading.Lock()
        known: list[bool] = []

        def budget_of(i: int) -> float:
            """Completion i's budget, known once the tests' processes are ready (their start-up is its base)."""
            with once:
                if not known:
                    known.append(True)
                    base = None
                    if refs is not None:
                        refs.wait_ready()
                        base = refs.startup
                    elif todo and self.time_factor is not None:
                        base = self._calibrate()
                    if base is None and todo and self.time_factor is not None:
                        logger.warning("Reward '%s': no program-free run finished in this call, so each completion "
                                       "gets the whole timeout=%gs instead of %g x that run's time.", self.__name__,
                                       ceiling, self.time_factor)
                    if self._announce:
                        self._announce = False
                        logger.warning("Reward '%s': timeout=%gs is the ceiling of each completion's budget, which "
                                       "is %g x a program-free run's time (at least %g s); pass time_factor=None to "
                                       "give every completion the whole timeout.", self.__name__, ceiling,
                                       self.time_factor, self.min_timeout)
                    for j in todo:
                        budgets[j] = self._budget(parsed[j], base)
            return budgets[i]

        if todo and not n_files:
            budget_of(todo[0])
        self.last_results = [None] * len(completions)
        self.last_reasons = [[] for _ in completions]
        self.last_unsupported = 0
        programs = {i: extract_code(completion_text(completions[i])) for i in todo}
        try:
            done = self.pool.map(lambda i: self._judge_one(programs[i], parsed[i], lambda: budget_of(i), refs,
                                                            ceiling), todo)
        finally:
            if refs is not None:
                refs.close()
        out: list[float | None] = [None] * len(completions)
        refused: list[str] = []
        for i, (units, results) in zip(todo, done):
            t = parsed[i]
            self.last_results[i] = results[0] if results else None
            reasons = self.last_reasons[i]
            passed = total = 0
            for kind, label, why in [("unsupported", item, w) for item, w in t.unparsable] + units:
                if kind == "unsupported":
                    self.last_unsupported += 1
                    refused.append(self._unsupported(i, why, label))
                    if self.on_unsupported != "fail":
                        continue
                    why = "unsupported test: " + why
                total += 1
                passed += kind == "pass"
                if kind != "pass":
                    reasons.append(f"{label[:80]!r}: {why}")
            if reasons and logger.isEnabledFor(logging.DEBUG):
                logger.debug("Reward '%s': completion %d lost points: %s", self.__name__, i, "; ".join(reasons))
            if total:
                out[i] = (1.0 if passed == total else 0.0) if self.mode == "all" else passed / total
        if refused and self.on_unsupported == "error":
            raise DatasetError(refused[0] + " Rewrite the test, or pass on_unsupported='fail' (counts it failed) "
                               "or 'skip' (leaves it out).")
        return out

    def _unsupported(self, i: int, why: str, source: str) -> str:
        msg = (f"Reward '{self.__name__}': sample {i} has an unsupported test ({why}): {source[:200]!r}. "
               "See docs/rewards.md for the supported forms.")
        if self.on_unsupported != "error":
            judge.warn_once(source + why, "%s It %s (on_unsupported=%r).", msg,
                            "counts as failed" if self.on_unsupported == "fail" else "is left out of the score",
                            self.on_unsupported)
        return msg

    def _judge_one(self, program: str, t: "judge.Tests", budget_of, refs, ceiling: float):
        """One completion: its test file (a session with a tests' process), then its stdin/stdout cases, all
        in one budget of the program's own time (``budget_of()``). Returns ``(units, results)``. The program's
        sandbox is launched first, so that its start-up overlaps the tests' process's."""
        units: list[tuple[str, str, str]] = []
        results: list[SandboxResult] = []
        used = 0.0
        prog = judge.Program(program, self.sandbox_options, self.test_timeout, ceiling) if t.source is not None \
            else None
        try:
            budget = budget_of()
            ref = refs.take() if prog is not None else None
        except BaseException:
            if prog is not None:
                prog.close()
            raise
        if prog is not None:
            if ref is None:
                prog.close()
                units.append(("fail", "the tests", "the reference run failed (not the program's fault)"))
            else:
                try:
                    s = judge.run_session(prog, t.source, ref, run_options=self.sandbox_options, budget=budget,
                                          test_timeout=self.test_timeout, ceiling=ceiling)
                finally:
                    refs.put_back(ref)
                used = s.program_seconds
                if s.result is not None:
                    results.append(s.result)
                timed_out = s.gone is not None and "budget" in s.gone
                for kind, label, why in s.units:
                    if kind == "fail" and timed_out and s.gone in why:
                        why = self._killed_by_budget(budget)
                    units.append((kind, label, why))
                if s.reference_failed is not None:
                    logger.warning("Reward '%s': the program-free reference run "
                                    "of a test file failed (%s); its tests count as failed.", self.__name__,
                                    s.reference_failed)
                    units.append(("fail", "the tests", f"the reference run failed ({s.reference_failed}; not "
                                                       f"the program's fault)"))
        for case in t.cases:
            left = budget - used
            if left < 0.05:
                res = SandboxResult(None, "", "wall-clock budget of the group spent", True, "timeout", 0.0)
            else:
                res = self.pool.run(program, stdin=case.input, timeout=min(ceiling, left))
                used += res.duration
            results.append(res)
            ok = res.ok and judge.stdout_matches(res.stdout, case.output)
            units.append(("pass" if ok else "fail", "stdin/stdout case", "" if ok else (
                self._killed(res, budget) if res.killed_reason else (
                    f"exit status {res.returncode}" if res.returncode else "wrong output"))))
        return units, results

    def _killed_by_budget(self, budget: float) -> str:
        return self._killed(SandboxResult(None, "", "", True, "timeout", budget), budget)

    def _killed(self, res: SandboxResult, budget: float | None) -> str:
        """A kill reason; a time-out names the completion's budget and where it came from."""
        if res.killed_reason != "timeout" or budget is None:
            return str(res.killed_reason)
        timeout = float(self.sandbox_options["timeout"])
        if self.time_factor is None or budget >= timeout:
            return f"timeout: the completion's budget of {budget:.2f} s (timeout) was spent"
        return (f"timeout: the completion's budget of {budget:.2f} s was spent ({self.time_factor:g} x the "
                f"program-free run's time, at least min_timeout={self.min_timeout:g} s; raise time_factor, or "
                f"time_factor=None for the whole timeout={timeout:g} s)")

    def _budget(self, t: "judge.Tests", base: float | None) -> float:
        """One completion's budget of the program's own time (the class docstring's formula)."""
        timeout = float(self.sandbox_options["timeout"])
        if self.time_factor is None or base is None:
            return timeout
        runs = (t.source is not None) + len(t.cases)
        return min(timeout, max(self.min_timeout, self.time_factor * runs * base))

    def _calibrate(self) -> float | None:
        """The wall time of one program-free run now (the sandbox's start-up under the current load)."""
        res = self.pool.run("pass\n")
        return res.duration if res.ok else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def make_code_reward(mode: str = "all", **options) -> CodeReward:
    """A sandboxed unit-test reward; ``mode`` is ``"all"`` (1/0) or ``"fraction"`` (share passed)."""
    return CodeReward(mode, **options)


# --------------------------------------------------------------------------------------------
# Registered instances and config factories
# --------------------------------------------------------------------------------------------
math_accuracy = reward("math_accuracy", "final answer equals the gold 'answer' column: +1 correct / 0 wrong")(
    MathAccuracy(1.0, 0.0, name="math_accuracy")
)
math_accuracy_pm1 = reward("math_accuracy_pm1", "final answer equals the gold 'answer' column: +1 / -1 (DAPO)")(
    MathAccuracy(1.0, -1.0, name="math_accuracy_pm1")
)
format_think_answer = reward("format_think_answer", "1 if <think>...</think> is followed by a non-empty answer")(
    FormatReward(name="format_think_answer")
)
dapo_overlong = reward("dapo_overlong", "DAPO soft overlong punishment (eq. 13), L_max=20480, L_cache=4096")(
    OverlongPenalty(20480, 4096, name="dapo_overlong")
)
length_cosine = reward("length_cosine", "cosine length-scaled math correctness (Yeo et al. 2025), max_len=4096")(
    LengthCosine(4096, name="length_cosine")
)
code_pass = reward("code_pass", "1 if the completion's program passes every test in the 'tests' column (sandboxed)")(
    CodeReward("all", name="code_pass")
)
code_pass_fraction = reward("code_pass_fraction", "fraction of the 'tests' column the program passes (sandboxed)")(
    CodeReward("fraction", name="code_pass_fraction")
)

REWARD_FACTORIES: dict[str, Callable[..., Callable]] = {
    "math_accuracy": make_math_accuracy,
    "format_think_answer": make_format_reward,
    "format": make_format_reward,
    "overlong_penalty": make_overlong_penalty,
    "dapo_overlong": make_overlong_penalty,
    "length_cosine": make_length_cosine,
    "code_pass": lambda **kw: make_code_reward("all", **kw),
    "code_pass_fraction": lambda **kw: make_code_reward("fraction", **kw),
}


def build_reward(spec: str | Mapping[str, Any], **params) -> Callable:
    """A reward from a config: a registered name (no params: the registered instance), or a
    factory name with parameters, given as keywords or as a mapping ``{"name": ..., **params}``."""
    from grpo_variants.rewards.registry import get_reward

    if isinstance(spec, Mapping):
        params = {**{k: v for k, v in spec.items() if k != "name"}, **params}
        if "name" not in spec:
            raise ConfigError(f"A reward config mapping needs a 'name' key, got {dict(spec)!r}.")
        spec = spec["name"]
    if not params:
        return get_reward(spec)
    if spec not in REWARD_FACTORIES:
        raise ConfigError(
            f"Reward {spec!r} takes no parameters (got {sorted(params)}). Parametrised rewards: "
            f"{', '.join(sorted(REWARD_FACTORIES))}."
        )
    try:
        return REWARD_FACTORIES[spec](**params)
    except TypeError as exc:
        raise ConfigError(f"Bad parameters for reward {spec!r}: {exc}") from exc
