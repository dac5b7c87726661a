"""A registry of reward functions, selectable by name in configs and the CLI.

A reward is any callable with TRL's signature::

    def my_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]

Register it with ``@reward("my_reward", "one-line description")``; look it up with
:func:`get_reward`. Registered names are what ``grpo-variants train --reward NAME`` accepts.

This module is only the table and imports no reward. The built-ins register themselves when the
package is imported: ``grpo_variants.rewards`` imports :mod:`~grpo_variants.rewards.builtin`, and
``grpo_variants`` imports :mod:`grpo_variants.toy` (the toy task's rewards); Python runs both packages'
``__init__`` before this module, so the table is complete whenever :func:`get_reward` can be called.
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


def get_reward(name: str) -> RewardFn:
    """Return the reward registered as ``name``; raise :class:`UnknownRewardError` naming the known ones."""
    if name not in _REWARDS:
        known = ", ".join(sorted(_REWARDS)) or "(none)"
        raise UnknownRewardError(
            f"Unknown reward {name!r}. Registered rewards: {known}. "
            "Register your own with @grpo_variants.reward('name') or pass the callable directly."
        )
    return _REWARDS[name].func


def list_rewards() -> list[RewardSpec]:
    """All registered rewards, sorted by name."""
    return [_REWARDS[k] for k in sorted(_REWARDS)]
