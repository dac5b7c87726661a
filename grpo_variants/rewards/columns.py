"""Which dataset columns a reward needs, checked when the trainer is built (before any generation).

TRL passes every dataset column except ``prompt`` to each reward as a keyword argument, so a reward
that needs ``answer`` only finds out it is missing at the first reward call, after the first
generation (minutes on a real model). :func:`check_reward_columns` finds out at construction.

What a reward needs, in order of precedence:

* a ``required_columns`` attribute: a sequence whose entries are a column name or a tuple of
  alternative names (any one of them will do), e.g. ``(("answer", "solution"),)``;
* otherwise, for a plain function, its signature: every parameter without a default that is not one
  of TRL's own arguments (``prompts``, ``completions``, ``completion_ids``, ``trainer_state``, ...) is a
  column TRL must pass (``def toy_accuracy(prompts, completions, answer, **kw)`` needs ``answer``).

Reward *models* (paths or hub ids) need no column.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from grpo_variants.errors import DatasetError

__all__ = ["required_columns", "check_reward_columns", "TRL_REWARD_ARGUMENTS"]

# Arguments TRL itself passes to a reward (not dataset columns).
TRL_REWARD_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
     "self", "kwargs", "args"}
)


def _as_alternatives(entry: Any) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    return tuple(str(x) for x in entry)


def required_columns(func: Any) -> list[tuple[str, ...]]:
    """The columns ``func`` needs: a list of alternatives tuples (one name of each tuple must be present)."""
    if isinstance(func, (str, bytes)) or not callable(func):
        return []  # a reward model: TRL loads it and it reads no column
    declared = getattr(func, "required_columns", None)
    if declared is not None:
        return [_as_alternatives(entry) for entry in declared]
    target = func if inspect.isfunction(func) or inspect.ismethod(func) else getattr(func, "__call__", func)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    needed = []
    for param in sig.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        if param.default is not param.empty or param.name in TRL_REWARD_ARGUMENTS:
            continue
        needed.append((param.name,))
    return needed


def _reward_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def check_reward_columns(reward_funcs: Sequence[Any], dataset, dataset_name: str = "train_dataset") -> None:
    """Raise :class:`DatasetError` naming the reward and each column it needs that ``dataset`` lacks.

    Datasets without ``column_names`` (plain lists, some iterable datasets) are not checked.
    """
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_reward_columns(reward_funcs, value, f"{dataset_name}[{key!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return
    present = set(columns)
    problems, missing = [], []
    for func in reward_funcs:
        for alternatives in required_columns(func):
            if not present.intersection(alternatives):
                wanted = " or ".join(f"'{c}'" for c in alternatives)
                problems.append(f"reward '{_reward_name(func)}' needs the column {wanted}")
                missing.append((func, alternatives[0]))
    if problems:
        func, column = missing[0]
        raise DatasetError(
            f"{dataset_name} is missing columns its rewards read: {'; '.join(problems)}. "
            f"Columns present: {sorted(present)}. {_fix_hint(func, column, sorted(present))}"
        )


def _fix_hint(func: Any, column: str, present: list[str]) -> str:
    """How to give ``func`` its ``column``: rename one, or point the reward's own factory at another column
    (``make_code_reward(tests_column=...)`` for ``code_pass``; only a reward that has such a factory says so)."""
    other = next((c for c in present if c != "prompt"), "your_column")
    text = f"Add or rename the column (e.g. dataset.rename_column({other!r}, {column!r}))"
    factory = getattr(func, "factory_name", None)
    params = getattr(func, "_params", None)
    try:
        values = params() if callable(params) else {}
    except Exception:  # noqa: BLE001 - a reward whose parameters cannot be read gets the plain hint
        values = {}
    key = next((k for k, v in values.items() if k.endswith("_column") and v == column), None)
    if factory and key:
        text += f", or point the reward at another column (e.g. {factory}({key}={other!r}))"
    return text + "."
