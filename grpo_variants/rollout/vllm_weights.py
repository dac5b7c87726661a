"""The engine side of an exact weight sync, shared by the colocated engine (:mod:`grpo_variants.rollout.vllm_engine`)
and the server's worker extension (:mod:`grpo_variants.rollout.vllm_server`): it imports nothing of ours, so
neither module imports the other for it."""

from __future__ import annotations

import torch

__all__ = ["reprocess_tied_layers"]


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
