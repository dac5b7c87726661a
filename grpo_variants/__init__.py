"""grpo-variants: the GRPO family of critic-free RL algorithms on top of Hugging Face TRL.

    from grpo_variants import GRPOVariantTrainer, GRPOVariantConfig, get_variant, toy

Variants: grpo, dapo, dr_grpo, gspo, gspo_token, mu_grpo, igrpo, fipo (``list_variants()``).
"""

from grpo_variants import _aliases

_aliases.install()  # old flat import paths (grpo_variants.toy, .sampling, ...) name the moved modules

from grpo_variants.runtime.noise import install_noise_filters  # noqa: E402

install_noise_filters()  # before DeepSpeed / torch are imported (see grpo_variants.runtime.noise)

from grpo_variants.runtime.distributed import install_cpu_distributed_shim  # noqa: E402

install_cpu_distributed_shim()  # no-op unless a launcher started us on a machine without CUDA

from grpo_variants.tasks import toy  # noqa: E402
from grpo_variants.tasks import toy_reasoning  # noqa: E402,F401  (registers the chain task with the toy kit)
from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import (
    ConfigError,
    DatasetError,
    DynamicSamplingError,
    GRPOVariantsError,
    ModelPathError,
    NonFiniteLossError,
    RewardFunctionError,
    UnknownLossError,
    UnknownRewardError,
    UnknownVariantError,
)
from grpo_variants.registry import VariantSpec, get_variant, list_variants, register_variant
from grpo_variants.rewards.registry import get_reward, list_rewards, reward
from grpo_variants.rewards.steps import StepReward, step_reward
from grpo_variants.trainer import GRPOVariantTrainer
from grpo_variants import variants as _variants  # noqa: E402  (registers the built-in variants)

__version__ = "0.1.0"

__all__ = [
    "GRPOVariantConfig",
    "GRPOVariantTrainer",
    "VariantSpec",
    "get_variant",
    "list_variants",
    "register_variant",
    "reward",
    "step_reward",
    "StepReward",
    "get_reward",
    "list_rewards",
    "toy",
    "ConfigError",
    "DatasetError",
    "DynamicSamplingError",
    "GRPOVariantsError",
    "ModelPathError",
    "NonFiniteLossError",
    "RewardFunctionError",
    "UnknownLossError",
    "UnknownRewardError",
    "UnknownVariantError",
]


def __getattr__(name):
    # Variant classes (DAPOTrainer, DAPOConfig, ...) are importable from the top level.
    if hasattr(_variants, name):
        return getattr(_variants, name)
    raise AttributeError(f"module 'grpo_variants' has no attribute {name!r}")
