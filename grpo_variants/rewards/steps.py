"""Step rewards: reward functions that score every step of a completion (process supervision).

A *step reward function* keeps TRL's calling convention (``f(prompts, completions, completion_ids,
**columns) -> list``, one entry per completion) and is declared with :func:`step_reward`. Per
completion it returns one of:

* a :class:`StepReward` (``ends``: the character offset in the completion text where each step ends,
  exclusive, i.e. the step is ``text[previous_end:end]``; ``scores``: one float per step);
* a list of ``(end_char, score)`` pairs;
* with a declared ``delimiter``, a plain list of floats: step ``j`` ends right after the ``j``-th
  occurrence of the delimiter, and one extra score (if given) scores the text after the last one;
* an empty list (no step: the completion gets no process advantage) or ``None`` (missing).

The trainer maps each step end to the completion token that holds the last byte of its last character
(:func:`step_token_indices`), using the tokenizer's own decoding of the generated ids
(:func:`token_char_ends`): a step ending in the middle of a token belongs to that token; a character
that byte-level BPE splits over tokens belongs to the token that completes it; an empty step shares
the token of the step before it. In a completion cut by the length limit only the steps that ended
before the cut are credited: the step reaching the cut (ending at the end of the text, unless it ends
with the function's declared delimiter) and any step ending past the decoded text are dropped and
counted (``process/steps_dropped``); the tokens after the last credited step get no process credit.

Through :class:`~grpo_variants.rewards.robust.RobustReward` a step reward gets the timeouts, error
handling, NaN checks and caching of every reward. TRL sees one number per completion for it (the
mean of its step scores, ``None`` with no step), which is what TRL logs as ``rewards/<name>/mean``;
the advantages use the steps (:func:`grpo_variants.losses.process_advantages`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = [
    "PrefixCharEnds",
    "StepReward",
    "coerce_step_reward",
    "ended_steps",
    "is_step_reward",
    "step_delimiter",
    "step_reward",
    "step_token_indices",
    "token_char_ends",
]


@dataclass(frozen=True)
class StepReward:
    """The steps of one completion: ``ends[j]`` (character offset, exclusive) and ``scores[j]``.

    Steps are kept sorted by end (a stable sort of what the function returned).
    """

    ends: tuple[int, ...] = ()
    scores: tuple[float, ...] = ()

    def __post_init__(self):
        ends, scores = tuple(self.ends), tuple(self.scores)
        if len(ends) != len(scores):
            raise ValueError(f"StepReward has {len(ends)} step ends but {len(scores)} scores; give one score per step.")
        clean_ends = []
        for e in ends:
            if isinstance(e, bool) or not isinstance(e, int) and not (hasattr(e, "__index__")):
                raise ValueError(f"a step end must be an integer character offset, got {e!r}.")
            if int(e) < 0:
                raise ValueError(f"a step end must be >= 0 (a character offset into the completion), got {e}.")
            clean_ends.append(int(e))
        clean_scores = []
        for s in scores:
            if isinstance(s, (str, bytes)) or s is None:
                raise ValueError(f"a step score must be a number, got {s!r}.")
            clean_scores.append(float(s))
        order = sorted(range(len(clean_ends)), key=lambda j: clean_ends[j])
        object.__setattr__(self, "ends", tuple(clean_ends[j] for j in order))
        object.__setattr__(self, "scores", tuple(clean_scores[j] for j in order))

    @classmethod
    def from_pairs(cls, pairs: Sequence) -> StepReward:
        """From ``[(end_char, score), ...]``."""
        ends, scores = [], []
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"a step must be an (end_char, score) pair, got {pair!r}.")
            ends.append(pair[0])
            scores.append(pair[1])
        return cls(tuple(ends), tuple(scores))

    @classmethod
    def split(cls, text: str, scores: Sequence[float], delimiter: str) -> StepReward:
        """Steps delimited by ``delimiter``: step j ends right after its j-th occurrence; one more score than
        delimiters scores the rest of the text (ending at ``len(text)``)."""
        if not delimiter:
            raise ValueError("the step delimiter must be a non-empty string.")
        ends, start = [], 0
        while True:
            at = text.find(delimiter, start)
            if at < 0:
                break
            start = at + len(delimiter)
            ends.append(start)
        if len(scores) == len(ends) + 1:
            ends.append(len(text))
        if len(scores) > len(ends):
            raise ValueError(
                f"{len(scores)} step scores for a completion with {len(ends) - (len(ends) and ends[-1] == len(text))} "
                f"delimiters {delimiter!r}: give at most one score per delimited step plus one for the rest."
            )
        return cls(tuple(ends[: len(scores)]), tuple(scores))

    @property
    def summary(self) -> float | None:
        """What TRL sees for this completion: the mean step score (None without steps)."""
        return sum(self.scores) / len(self.scores) if self.scores else None

    def finite(self) -> bool:
        return all(math.isfinite(s) for s in self.scores)


def step_reward(func: Callable | None = None, *, delimiter: str | None = None):
    """Declare ``func`` a step reward function (usable as ``@step_reward`` or ``@step_reward(delimiter="\\n")``)."""

    def mark(f):
        f.returns_steps = True
        f.step_delimiter = delimiter
        return f

    return mark(func) if func is not None else mark


def _unwrap(func: Any) -> Any:
    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(func, functools.partial):
            func = func.func
        elif getattr(func, "__wrapped__", None) is not None and not getattr(func, "returns_steps", False):
            func = func.__wrapped__
        else:
            break
    return func


def is_step_reward(func: Any) -> bool:
    """Whether ``func`` (or what it wraps) was declared with :func:`step_reward`."""
    return bool(getattr(func, "returns_steps", False) or getattr(_unwrap(func), "returns_steps", False))


def step_delimiter(func: Any) -> str | None:
    return getattr(func, "step_delimiter", None) or getattr(_unwrap(func), "step_delimiter", None)


def coerce_step_reward(value: Any, text: str | None, delimiter: str | None) -> StepReward | None:
    """One completion's return value as a :class:`StepReward` (None stays None); ValueError on a bad shape."""
    if value is None or isinstance(value, StepReward):
        return value
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(
            f"a step reward function returns, per completion, a StepReward, a list of (end_char, score) pairs or "
            f"(with a declared delimiter) a list of step scores; got {type(value).__name__} {value!r}"
        )
    items = list(value)
    if not items:
        return StepReward()
    if all(isinstance(x, (tuple, list)) for x in items):
        return StepReward.from_pairs(items)
    if delimiter is None:
        raise ValueError(
            "returned a list of plain scores but declared no step delimiter: return (end_char, score) pairs, a "
            "StepReward, or declare @step_reward(delimiter=...)"
        )
    return StepReward.split(text or "", items, delimiter)


def ended_steps(step: StepReward, text: str, *, truncated: bool, delimiter: str | None = None) -> tuple[StepReward, int]:
    """The steps of one completion that ended, and how many were dropped.

    A completion that ended (EOS) keeps every step. One cut by the length limit (``truncated``) keeps the steps
    that ended before the cut: a step ending at or past the end of ``text`` (the text the reward saw) reached the
    cut and is dropped, unless it ends exactly there with the function's declared ``delimiter`` (the delimiter was
    generated, so the step ended).
    """
    if not truncated or not step.ends:
        return step, 0
    cut = len(text)
    keep = [j for j, e in enumerate(step.ends)
            if e < cut or (e == cut and delimiter and text[:e].endswith(delimiter))]
    if len(keep) == len(step.ends):
        return step, 0
    return StepReward(tuple(step.ends[j] for j in keep), tuple(step.scores[j] for j in keep)), len(step.ends) - len(keep)


# ------------------------------------------------------------------------------------------------
# Step ends -> completion tokens
# ------------------------------------------------------------------------------------------------
def _agreed_chars(prefix: str, full: str) -> int:
    """Characters of ``full`` that the decoded ``prefix`` already holds: their common prefix's length.

    A prefix that ends inside a multi-byte character (byte-level BPE splits one character over tokens) decodes
    its incomplete bytes to replacement characters, which the full text does not have there: they do not count,
    so the character counts once the token holding its last byte is decoded.
    """
    if full.startswith(prefix):
        return len(prefix)
    lo, hi = 0, min(len(prefix), len(full))  # the longest n with prefix[:n] == full[:n] (monotone in n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if full.startswith(prefix[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_char_ends(tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[int]:
    """``ends[k]``: characters of the decoded completion complete once tokens ``0..k`` are decoded (non-decreasing).

    Each prefix is decoded with the tokenizer itself (as TRL decodes the completion), so the offsets
    agree with the text the reward saw; a character counts from the token that holds its last byte (a prefix
    that ends inside a multi-byte character decodes to a replacement character, which is not counted:
    :func:`_agreed_chars`).
    """
    ids = [int(i) for i in ids]
    if not ids:
        return []
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    ends, best = [], 0
    for k in range(1, len(ids) + 1):
        n = _agreed_chars(tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens), full)
        best = max(best, n)
        ends.append(best)
    ends[-1] = len(full)
    return ends


class PrefixCharEnds:
    """:func:`token_char_ends` computed lazily: ``ends[k]`` decodes ``ids[: k + 1]`` on first access (cached).

    :func:`step_token_indices` bisects it, so mapping K steps decodes O(K log T) prefixes instead of T. A character
    counts from the token that holds its last byte (:func:`_agreed_chars`), as in :func:`token_char_ends`.
    """

    def __init__(self, tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True):
        self.tokenizer, self.ids, self.skip = tokenizer, [int(i) for i in ids], skip_special_tokens
        self._cache: dict[int, int] = {}
        self.text = tokenizer.decode(self.ids, skip_special_tokens=self.skip) if self.ids else ""
        self.total = len(self.text)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> int:
        if k < 0:
            k += len(self.ids)
        if not 0 <= k < len(self.ids):
            raise IndexError(k)
        if k == len(self.ids) - 1:
            return self.total
        if k not in self._cache:
            prefix = self.tokenizer.decode(self.ids[: k + 1], skip_special_tokens=self.skip)
            self._cache[k] = _agreed_chars(prefix, self.text)
        return self._cache[k]


def step_token_indices(step_ends: Sequence[int], char_ends: Sequence[int], *, offset: int = 0) -> list[int | None]:
    """Map step ends (character offsets, exclusive) to completion token indices; None for a dropped step.

    Step j covers characters ``[.., e_j)``; its last character ``e_j - 1 - offset`` (``offset``: characters the
    reward saw before the decoded completion, e.g. a prefilled assistant turn) is complete at the first token k with
    ``char_ends[k] > e_j - 1 - offset``, i.e. ``char_ends[k] >= e_j - offset``: a step that ends in the middle
    of a token belongs to that token, and one whose last character spans tokens (a multi-byte character under
    byte-level BPE) to the token holding the character's last byte. A step ending at or before the completion's first character (an empty
    first step, or one inside the prefill) maps to token 0. A step ending past the decoded text (cut by the
    length limit), or any step of an empty completion, is dropped (None).
    """
    import bisect

    if not isinstance(char_ends, PrefixCharEnds):
        char_ends = list(char_ends)
    total = char_ends[-1] if len(char_ends) else 0
    out: list[int | None] = []
    for end in step_ends:
        e = int(end) - offset
        if not len(char_ends) or e > total:
            out.append(None)
        elif e <= 0:
            out.append(0)
        else:
            out.append(bisect.bisect_left(char_ends, e))
    return out
