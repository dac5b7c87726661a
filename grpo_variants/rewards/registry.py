"""A registry of reward functions, selectable by name in configs and the CLI.

A reward is any callable with TRL's signature::

    def my_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]

Register it with ``@reward("my_reward", "one-line description")``; look it up with
:func:`get_reward`. Registered names, TRL's script names (``accuracy_reward``, ...) and dotted
import paths are what ``grpo-variants train --reward NAME`` (or ``--reward_funcs``) accepts.

This module is only the table and imports no reward. The built-ins register themselves when the
package is imported: ``grpo_variants.rewards`` imports :mod:`~grpo_variants.rewards.builtin`, and
``grpo_variants`` imports :mod:`grpo_variants.tasks.toy` (the toy task's rewards); Python runs both packages'
``__init__`` before this module, so the table is complete whenever :func:`get_reward` can be called.
TRL's rewards and dotted paths are imported only when asked for by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from grpo_variants.errors import UnknownRewardError

RewardFn = Callable[..., list]


@dataclass(frozen=True)
class RewardSpec:
    name: str
    func: RewardFn
    description: str


_REWARDS: dict[str, RewardSpec] = {}


def reward(name: str, description: str | None = None):
    """Decorator: register ``func`` under ``name``. The description defaults to the docstring's first line."""

    def decorator(func: RewardFn) -> RewardFn:
        doc = (func.__doc__ or "").strip().splitlines()
        desc = description or (doc[0] if doc else "")
        if name in _REWARDS and _REWARDS[name].func is not func:
            raise ValueError(f"A reward named {name!r} is already registered ({_REWARDS[name].func!r}).")
        _REWARDS[name] = RewardSpec(name=name, func=func, description=desc)
        return func

    return decorator


# The names `trl grpo --reward_funcs` accepts (trl/scripts/grpo.py), with the same arguments.
TRL_SCRIPT_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                      "get_soft_overlong_punishment")


def _trl_script_reward(name: str) -> RewardFn:
    import trl.rewards

    if name == "get_soft_overlong_punishment":  # as `trl grpo` builds it
        return trl.rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(trl.rewards, name)


def _import_reward(path: str) -> RewardFn:
    """``package.module.function`` -> the function (the current directory is importable, as in `trl grpo`)."""
    import importlib
    import os
    import sys

    module_path, _, attr = path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ImportError as err:
        raise UnknownRewardError(f"Reward {path!r}: cannot import module {module_path!r} ({err}).") from err
    func = getattr(module, attr, None)
    if func is None:
        raise UnknownRewardError(f"Reward {path!r}: module {module_path!r} has no attribute {attr!r}.")
    if not callable(func):
        raise UnknownRewardError(f"Reward {path!r} is {type(func).__name__}, not a callable reward function.")
    return func


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``, one of TRL's script names (``accuracy_reward``, ...) or a dotted
    import path (``trl.rewards.accuracy_reward``, ``my_lib.rewards.custom``), as ``trl grpo`` accepts.

    Raises :class:`UnknownRewardError` naming the known ones otherwise.
    """
    if name in _REWARDS:
        return _REWARDS[name].func
    if name in TRL_SCRIPT_REWARDS:
        return _trl_script_reward(name)
    if "." in name and "/" not in name and not name.startswith(".") and all(
        part.isidentifier() for part in name.split(".")
    ):
        return _import_reward(name)
    known = ", ".join(sorted(_REWARDS)) or "(none)"
    raise UnknownRewardError(
        f"Unknown reward {name!r}. Registered rewards: {known}; TRL's: {', '.join(TRL_SCRIPT_REWARDS)}; or a "
        "dotted import path (my_lib.rewards.my_reward). Register your own with @grpo_variants.reward('name') or "
        "pass the callable directly."
    )


def list_rewards() -> list[RewardSpec]:
    """All registered rewards, sorted by name."""
    return [_REWARDS[k] for k in sorted(_REWARDS)]
