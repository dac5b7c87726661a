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
# torch's deprecation of the c10d collectives DeepSpeed's ZeRO-3 calls (all_gather_into_tensor, reduce_scatter_tensor)
TORCH_C10D_DEPRECATION = r"`torch\.distributed\.\w+` is deprecated\. Please use `torch\.distributed\.\w+` instead"


def install_noise_filters() -> None:
    """Silence messages that say nothing actionable about a grpo-variants run (idempotent).

    * DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." line, printed on every start on
      a machine without an accelerator (DeepSpeed is imported by accelerate / transformers). The filter
      covers the processes that import grpo_variants; ``accelerate launch``'s own launcher process imports
      DeepSpeed before any of our code runs, so the documented CPU launches set ``DS_ACCELERATOR=cpu``
      (DeepSpeed's own switch: no detection, no warning).
    * torch's "`torch.distributed.all_gather_into_tensor` is deprecated. Please use
      `torch.distributed.all_gather_single` instead" (and ``reduce_scatter_tensor``) FutureWarning, raised
      from ``torch.distributed.c10d_logger`` each time DeepSpeed's ZeRO-3 gathers or reduce-scatters: a
      3-step ZeRO-3 toy launch on CPU printed 471 (twice that many lines), since any ``warnings.catch_warnings``
      block resets the once-per-location registry. DeepSpeed's call, nothing a user can change.
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
    install_warning_filters()


def install_warning_filters() -> None:
    """The ``warnings`` part of :func:`install_noise_filters` (each filter by message, category and module)."""
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true but no accelerator is found")
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=TORCH_C10D_DEPRECATION, category=FutureWarning,
                            module=r"torch\.distributed\.c10d_logger")


