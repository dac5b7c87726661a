"""The padding-free training forward (``padding_free=True``): TRL's one forward point, fed packed rows.

Every training-side forward TRL runs (the policy's log-probs and entropies under gradient in
``_compute_loss``, the reference model's log-probs, the old log-probs TRL recomputes in the rollout,
our KL-in-reward pass) goes through ``GRPOTrainer._get_per_token_logps_and_entropies``.
:class:`PaddingFreeMixin` overrides it: each chunk of rows (TRL's ``batch_size`` chunking) is packed by
:func:`grpo_variants.rollout.packing.pack`, the model runs once on the packed rows with restarting
``position_ids`` and no attention mask (transformers then builds a block-diagonal causal mask), and the
result is unpacked to TRL's ``(rows, logits_to_keep)`` layout. The LM head is TRL's own fused head
(``trl.trainer.utils.add_fused_lm_head``: temperature, soft-capping, logit scales, tied embeddings,
``cast_lm_head_to_fp32``, the ZeRO-3 gather of the head), fed only the hidden states of the scored
positions: a forward hook on the backbone selects them, and they are passed as pre-shifted labels.
TRL's padded path runs the head on every position on CPU (and on every non-ignored one on CUDA).

Where packing cannot be exact the trainer refuses at construction (:meth:`_check_padding_free`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from grpo_variants.errors import ConfigError
from grpo_variants.rollout.packing import pack, unpack

logger = logging.getLogger(__name__)

# attention implementations whose mask transformers builds from packed position_ids (or, for the flash
# kernels, whose varlen call reads them) when attention_mask is None
PACKED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                  "token_type_ids", "mm_token_type_ids", "image_position_ids")


def causal_lm(model):
    """The ``PreTrainedModel`` inside DDP / DeepSpeed / PEFT wrappers (the one TRL patched with its fused head)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, DeepSpeedEngine
        model = model.module
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model


@contextmanager
def scored_hidden_states(backbone: torch.nn.Module, index: torch.Tensor):
    """While active, ``backbone``'s ``last_hidden_state`` (P, L, H) is replaced by its rows ``index`` as (1, N, H)."""

    def hook(module, args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.reshape(-1, hidden.size(-1)).index_select(0, index).unsqueeze(0)
        return output

    handle = backbone.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def probe_packed_attention(model) -> float:
    """Largest |difference| between two short sequences' hidden states run packed and run alone, relative to
    their largest magnitude.

    A model whose attention ignores packed ``position_ids`` lets the second sequence attend to the first,
    which moves its hidden states far beyond rounding. Runs in eval mode (no dropout), restores the mode.
    """
    lm = causal_lm(model)
    backbone = lm.base_model
    vocab = lm.config.get_text_config().vocab_size
    param = next(lm.parameters())
    first = (torch.arange(5, device=param.device) * 7 + 3) % vocab
    second = (torch.arange(4, device=param.device) * 11 + 5) % vocab
    was_training = lm.training
    lm.eval()
    try:
        packed = backbone(
            input_ids=torch.cat([first, second]).unsqueeze(0),
            position_ids=torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0).to(param.device),
            use_cache=False,
        ).last_hidden_state[0]
        alone = torch.cat([backbone(input_ids=s.unsqueeze(0), use_cache=False).last_hidden_state[0]
                           for s in (first, second)])
    finally:
        lm.train(was_training)
    return ((packed.float() - alone.float()).abs().max() / alone.float().abs().max().clamp(min=1e-12)).item()


# Backbones whose packed forward the suite verifies equal to the padded one (tests/test_padding_free*.py: the toy
# Qwen2, SmolLM2's Llama): padding_free="auto" packs them under ZeRO-3 too, where no probe forward can run at start.
PACKING_VERIFIED_MODEL_TYPES = frozenset({"qwen2", "llama"})


class PaddingFreeMixin:
    """``_get_per_token_logps_and_entropies`` on packed rows when ``args.padding_free`` (TRL's otherwise)."""

    def _check_padding_free(self) -> None:
        """Resolve ``padding_free="auto"`` and refuse, for ``padding_free=True``, what packing cannot compute exactly.

        ``"auto"`` (the default): on where every check of :meth:`_refuse_unsafe_packing` passes (the model is
        verified at start to honour packed position_ids), off otherwise, quietly (a debug line says why). The
        behaviour line at start names a padding-free forward when it is on (``behaviour_changes``). The resolved
        value replaces ``args.padding_free``; ``args`` remembers it was "auto", so the same args object given to
        another trainer (a notebook) resolves again for that model, unless the user changed the field meanwhile.
        """
        args = self.args
        choice = getattr(args, "padding_free", False)
        if getattr(args, "_padding_free_auto", None) is not None and choice is args._padding_free_auto:
            choice = "auto"  # resolved by an earlier trainer from this args object and not changed since
        self.padding_free_auto = choice == "auto"
        if choice == "auto":
            try:
                self._refuse_unsafe_packing(auto=True)
            except ConfigError as err:
                resolved = False
                self.padding_free_reason = str(err).split(": ", 1)[-1].rstrip(".")
                logger.debug("padding_free='auto': off (TRL's padded forward): %s", self.padding_free_reason)
            else:
                resolved = True
                self.padding_free_reason = f"{causal_lm(self.model).config.model_type} honours packed position_ids"
            args.padding_free = resolved
            object.__setattr__(args, "_padding_free_auto", resolved)
            return
        object.__setattr__(args, "_padding_free_auto", None)
        self.padding_free_reason = None
        if choice:
            self._refuse_unsafe_packing()

    def _refuse_unsafe_packing(self, auto: bool = False) -> None:
        """Raise a ConfigError for what packing cannot compute exactly (``auto``: also for what is not verified)."""
        fix = "set padding_free=False"
        lm = causal_lm(self.model)
        config = lm.config
        if getattr(config, "vision_config", None) is not None or getattr(config, "text_config", None) is not None:
            raise ConfigError(f"padding_free=True packs text rows only; {type(lm).__name__} takes vision inputs: {fix}.")
        if getattr(self, "aux_loss_enabled", False):
            raise ConfigError(
                "padding_free=True does not compute the MoE router load-balancing loss (router_aux_loss_coef != 0 on "
                f"{config.model_type}): {fix} or router_aux_loss_coef=0."
            )
        peft_config = getattr(self.model, "peft_config", None)
        if isinstance(peft_config, dict) and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
            raise ConfigError(f"padding_free=True cannot pack prompt-learning PEFT (virtual tokens per row): {fix}.")
        attn = getattr(config, "_attn_implementation", None)
        if attn not in PACKED_ATTENTION:
            raise ConfigError(
                f"padding_free=True needs an attention implementation that honours packed position_ids "
                f"({', '.join(PACKED_ATTENTION)}); this model uses {attn!r}: load it with one of those or {fix}."
            )
        if not hasattr(lm, "base_model") or lm.base_model is lm:
            raise ConfigError(f"padding_free=True needs a causal LM with a separate backbone; {type(lm).__name__} "
                              f"has none: {fix}.")
        if any(hasattr(p, "ds_id") for p in lm.parameters()):  # ZeRO-3 partitioned: no forward before wrapping
            if auto and config.model_type not in PACKING_VERIFIED_MODEL_TYPES:
                raise ConfigError(
                    f"padding_free='auto': {config.model_type} is partitioned by ZeRO-3 before it can be probed and is "
                    f"not among the verified backbones ({', '.join(sorted(PACKING_VERIFIED_MODEL_TYPES))}): set "
                    "padding_free=True to pack it anyway.")
            return
        for name, ref in (("model", self.model), ("ref_model", getattr(self, "ref_model", None))):
            if ref is None:
                continue
            dtype = next(causal_lm(ref).parameters()).dtype
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # relative; leaking attention moves O(1)
            gap = probe_packed_attention(ref)
            if not gap <= tolerance:
                raise ConfigError(
                    f"padding_free=True: {config.model_type} ({attn} attention) lets packed sequences attend to each "
                    f"other ({name} hidden states differ by {gap:.3g} relative from running them alone): {fix}."
                )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        if not getattr(self.args, "padding_free", False):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **kwargs,
            )
        extra = [k for k in _VISION_KWARGS if kwargs.get(k) is not None]
        if extra or compute_aux_loss:
            raise ConfigError(f"padding_free=True cannot pack {extra or 'the MoE aux loss'}; set padding_free=False.")
        backbone = causal_lm(model).base_model
        pad_id = getattr(getattr(self, "_tokenizer", None), "pad_token_id", None) or 0  # tail slots: never scored
        budget = getattr(self.args, "padding_free_max_tokens", None)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            packed = pack(input_ids[rows], attention_mask[rows], logits_to_keep, budget=budget, pad_id=pad_id)
            self._packed_real_tokens = packed.real_tokens  # what a forward hook should count (MFU): no tail slots
            with self.accelerator.autocast(), scored_hidden_states(backbone, packed.score_index):
                outputs = model(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    shift_labels=packed.score_labels.unsqueeze(0),
                    fused_lm_head=True,
                )
            self._packed_real_tokens = None
            logps.append(unpack(outputs.log_probs, packed))
            if compute_entropy:
                entropies.append(unpack(outputs.entropy, packed))
            self._note_packing(packed, input_ids[rows].numel())
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _note_packing(self, packed, padded_slots: int) -> None:
        """Metrics: packed token slots / padded slots (the forward's compute share), per forward."""
        mode = "train" if getattr(self, "model", None) is not None and self.model.training else "eval"
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics[mode]["padding_free/slot_ratio"].append(packed.slots / max(padded_slots, 1))
