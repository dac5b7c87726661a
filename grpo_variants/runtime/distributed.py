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
from contextlib import contextmanager

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
    clear_stale_build_locks()
    logger.info("grpo-variants: CPU distributed shim installed (gloo, MULTI_CPU) for a CUDA-less launch")
    return True


# Seconds after which a JIT-build lock is taken as left behind by a killed process: an up-to-date extension
# (its .so built) loads in seconds, a first build of DeepSpeed's CPU op takes about a minute on 2 cores.
STALE_LOCK_BUILT_S = 120.0
STALE_LOCK_UNBUILT_S = 900.0


def clear_stale_build_locks(root: str | os.PathLike | None = None) -> list[str]:
    """Remove the JIT-build locks of DeepSpeed's C++ ops that a killed launch left behind; one warning each.

    A CPU ZeRO-3 launch loads DeepSpeed's ``shm_comm`` op through ``torch.utils.cpp_extension``, which guards the
    (re)build with a bare ``lock`` file in the op's build folder (no owner pid). A launch killed while it holds
    the lock leaves the file, and every later launch then waits on it forever, printing nothing. A lock is
    stale when it is older than any build: :data:`STALE_LOCK_BUILT_S` when the op's ``.so`` is already built,
    :data:`STALE_LOCK_UNBUILT_S` otherwise. Only this user's files are touched. Returns the removed paths.
    """
    import glob
    import time

    if root is None:
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    removed = []
    now = time.time()
    for lock in glob.glob(os.path.join(str(root), "*", "deepspeed_*", "lock")):
        try:
            st = os.stat(lock)
            built = bool(glob.glob(os.path.join(os.path.dirname(lock), "*.so")))
            limit = STALE_LOCK_BUILT_S if built else STALE_LOCK_UNBUILT_S
            age = now - st.st_mtime
            if st.st_uid != os.getuid() or age < limit:
                continue
            os.remove(lock)
        except OSError:  # gone meanwhile (another rank removed it), or not ours to remove
            continue
        removed.append(lock)
        logger.warning("grpo-variants: removed a stale DeepSpeed build lock %s (%.0f s old, left by a killed launch; "
                       "every launch would otherwise wait on it forever)", lock, age)
    return removed


# ------------------------------------------------------------------------------------------------
# Evaluating outside the trainer under ZeRO-3 (the toy kit's held-out accuracy)
# ------------------------------------------------------------------------------------------------
def is_zero3_partitioned(model) -> bool:
    """Whether ``model``'s parameters are DeepSpeed ZeRO-3 partitions (each rank holds a slice)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextmanager
def zero3_init_disabled():
    """Load / build a model whole even while a ZeRO-3 config is active.

    Once a ZeRO-3 ``TrainingArguments`` exists, transformers builds every ``from_pretrained`` /
    ``from_config`` model inside ``deepspeed.zero.Init`` (partitioned at birth, a collective call). A model
    loaded only to evaluate it, on one rank or on all, must stay whole: this lifts the ZeRO-3 config for the
    duration of the block and restores it after.
    """
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover
        yield
        return
    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def gathered_copy(model):
    """A whole (unpartitioned) copy of a ZeRO-3 partitioned causal LM, for generation outside the trainer.

    Collective: every rank must call it (``deepspeed.zero.GatheredParameters`` all-gathers the partitions),
    the same number of times. HF ``generate`` on the partitioned model itself fails ("'weight' must be 2-D")
    or, with ZeRO-3's forward hooks, needs every rank in lock-step; TRL gathers inside its own generation
    path (``unwrap_model_for_generation``), which takes the DeepSpeed engine. A copy needs only the module,
    and costs one whole model per rank: meant for the toy kit's held-out evaluation; evaluate a large model
    through the trainer (``eval_dataset`` + ``eval_strategy``: TRL's own gathered generation).
    """
    import deepspeed
    import torch

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtype = params[0].dtype if params else torch.float32
    device = params[0].device if params else torch.device("cpu")  # where this rank's partitions live
    with zero3_init_disabled():
        plain = type(model)._from_config(model.config, dtype=dtype)
    plain.load_state_dict(state)  # strict: every gathered tensor has its place, and nothing is left unset
    plain.to(device)
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()
    plain.generation_config = getattr(model, "generation_config", plain.generation_config)
    return plain.eval()
