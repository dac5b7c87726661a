"""Exception types raised by grpo-variants.

Every error we raise on bad input derives from :class:`GRPOVariantsError`, which is also a
``ValueError`` so that code written against TRL's ``ValueError`` checks keeps working. Each
message says what is wrong and how to fix it, and names the offending field or function.
"""

from __future__ import annotations


class GRPOVariantsError(ValueError):
    """Base class of every error grpo-variants raises for bad input or state."""


class ConfigError(GRPOVariantsError):
    """A config field (or a combination of fields) is invalid."""


class DatasetError(GRPOVariantsError):
    """The training or evaluation dataset is unusable (missing column, empty, ...)."""


class UnknownVariantError(GRPOVariantsError, KeyError):
    """A variant name is not registered."""

    __str__ = ValueError.__str__  # KeyError would quote the message


class UnknownRewardError(GRPOVariantsError, KeyError):
    """A reward name is not registered."""

    __str__ = ValueError.__str__


class UnknownLossError(GRPOVariantsError, KeyError):
    """A loss building block (advantage, ratio, aggregation, KL, veto scope) is not registered."""

    __str__ = ValueError.__str__


class ModelPathError(GRPOVariantsError, FileNotFoundError):
    """A model path does not exist or holds no model."""

    __str__ = ValueError.__str__


class RewardFunctionError(GRPOVariantsError, RuntimeError):
    """A reward function crashed, timed out, or returned something unusable."""


class DynamicSamplingError(GRPOVariantsError, RuntimeError):
    """DAPO dynamic sampling could not fill the batch within ``max_num_gen_batches`` rounds."""


class NonFiniteLossError(GRPOVariantsError, RuntimeError):
    """Loss or gradients were non-finite for too many consecutive steps."""
