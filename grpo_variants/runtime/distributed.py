"""CPU multi-process support for accelerate + DeepSpeed (gloo), used for tests and CPU runs.

accelerate 1.15 picks no backend for a DeepSpeed launch on a machine without CUDA: every rank
ends up with ``distributed_type == NO`` and ``num_processes == 1``, so ZeRO-3 silently does not
shard. :func:`install_cpu_distributed_shim` makes ``PartialState._prepare_backend`` return
``("gloo", MULTI_CPU)`` in exactly that situation (no CUDA, ``LOCAL_RANK`` set by a launcher,
nothing else chosen). It is installed on ``import grpo_variants`` and is a no-op whenever CUDA is
available, so GPU runs never go through it.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
_INSTALLED = False


def install_cpu_distributed_shim() -> bool:
    """Patch accelerate's backend selection for CPU multi-process launches. Returns True if patched."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen_backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if distributed_type == DistributedType.NO and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return backend or "gloo", DistributedType.MULTI_CPU
        return chosen_backend, distributed_type

    PartialState._prepare_backend = _prepare_backend
    _INSTALLED = True
    logger.info("grpo-variants: CPU distributed shim installed (gloo, MULTI_CPU) for a CUDA-less launch")
    return True
