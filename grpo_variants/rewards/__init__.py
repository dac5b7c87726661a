"""Reward functions: the registry, the built-ins, robust calling and the code sandbox.

    from grpo_variants.rewards import get_reward, RobustReward, make_overlong_penalty, run_in_sandbox
"""

from grpo_variants.rewards.registry import RewardSpec, get_reward, list_rewards, reward  # noqa: I001
from grpo_variants.rewards.builtin import (
    REWARD_FACTORIES,
    CodeReward,
    FormatReward,
    LengthCosine,
    MathAccuracy,
    OverlongPenalty,
    build_reward,
    code_pass,
    code_pass_fraction,
    completion_text,
    dapo_overlong,
    extract_code,
    format_think_answer,
    length_cosine,
    make_code_reward,
    make_format_reward,
    make_length_cosine,
    make_math_accuracy,
    make_overlong_penalty,
    math_accuracy,
    math_accuracy_pm1,
    overlong_penalty_value,
)
from grpo_variants.rewards.math_verify_utils import (
    answers_match,
    extract_boxed,
    extract_final_answer,
    math_verify_available,
    normalize_answer,
)
from grpo_variants.rewards.robust import RobustReward, wrap_reward_funcs
from grpo_variants.rewards.steps import StepReward, step_reward
from grpo_variants.rewards.sandbox import SandboxPool, SandboxResult, run_in_sandbox, sandbox_capabilities

__all__ = [
    "RewardSpec",
    "reward",
    "StepReward",
    "step_reward",
    "get_reward",
    "list_rewards",
    "REWARD_FACTORIES",
    "build_reward",
    "CodeReward",
    "FormatReward",
    "LengthCosine",
    "MathAccuracy",
    "OverlongPenalty",
    "make_code_reward",
    "make_format_reward",
    "make_length_cosine",
    "make_math_accuracy",
    "make_overlong_penalty",
    "overlong_penalty_value",
    "extract_code",
    "completion_text",
    "math_accuracy",
    "math_accuracy_pm1",
    "format_think_answer",
    "dapo_overlong",
    "length_cosine",
    "code_pass",
    "code_pass_fraction",
    "answers_match",
    "extract_boxed",
    "extract_final_answer",
    "math_verify_available",
    "normalize_answer",
    "RobustReward",
    "wrap_reward_funcs",
    "SandboxPool",
    "SandboxResult",
    "run_in_sandbox",
    "sandbox_capabilities",
]
