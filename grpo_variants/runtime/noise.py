"""Filters for third-party messages known to be harmless on a grpo-variants run.

This module imports nothing heavy: ``grpo_variants/__init__`` calls :func:`install_noise_filters`
before torch, transformers or DeepSpeed are imported.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["install_noise_filters"]


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001
            return True
        return not any(fragment in message for fragment in self.fragments)


_INSTALLED = False

# where bitsandbytes logs its CPU kernel warning (its module's logger; the package logger in case it moves)
BITSANDBYTES_CPU_LOGGERS = ("bitsandbytes.backends.cpu.ops", "bitsandbytes")


def install_noise_filters() -> None:
    """Silence messages that say nothing actionable about a grpo-variants run (idempotent).

    * DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." line, printed on every start on
      a machine without an accelerator (DeepSpeed is imported by accelerate / transformers).
    * torch's "'pin_memory' argument is set as true but no accelerator is found": pinning is a
      no-op without an accelerator, and ``dataloader_pin_memory=True`` is transformers' default.
    * transformers' "`is_gradient_checkpointing` is deprecated" FutureWarning, triggered by TRL's
      own generation code (``trl.models.utils``), not by anything a user sets.
    * bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community: ..." warning, logged
      at import (``import peft`` imports bitsandbytes when it is installed) on CPUs with AVX512-BF16
      whenever the optional ``kernels`` hub package is missing or has no build for this torch: the 4-bit
      CPU matmul then uses bitsandbytes' PyTorch path, and QLoRA needs CUDA here anyway.
    Only these exact messages are filtered; everything else passes.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    logging.getLogger("DeepSpeed").addFilter(_DropMessages("Setting accelerator to CPU"))
    bnb_kernels = _DropMessages("Failed to load CPU gemm_4bit_forward from kernels-community")
    for name in BITSANDBYTES_CPU_LOGGERS:
        logging.getLogger(name).addFilter(bnb_kernels)
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true but no accelerator is found")
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


