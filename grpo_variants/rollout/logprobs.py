"""Behaviour log-probs recorded while HF ``generate`` samples, instead of a second forward pass.

Whenever generation and optimizer updates are misaligned (a µ-GRPO stage, ``steps_per_generation >
gradient_accumulation_steps``, ``num_iterations > 1``) TRL computes ``old_per_token_logps`` with one
more forward pass over every generated sequence. HF ``generate`` has already computed every logit
it sampled from, so the same numbers can be kept on the way:

    log pi_behav(y_t | x, y_<t) = log_softmax(logits_t / temperature)[y_t]

which is what TRL's fused LM head computes from a full forward (it divides by the same temperature;
logit scaling and soft-capping live in the model's own forward, used by both). Top-k / top-p / min-p
act after the logits and are ignored by both, as in TRL.

:class:`SampledLogprobRecorder` is a forward hook on the causal LM. Each call during ``generate``
yields the logits of the next token; its sampled token only becomes known when it is fed back at
the next call (``input_ids`` of a decoding step), so the hook keeps one ``(batch, vocab)`` log-softmax
at a time and gathers when the token arrives. The last sampled token never goes back through the
model; :meth:`SampledLogprobRecorder.finish` takes it from the returned completions.

In float32 the recorded values equal the recomputed ones up to the rounding of cached vs
uncached attention (tests: < 1e-5 on the toy model). In bf16 the two differ (train-inference
mismatch), so ``behaviour_logprobs='auto'`` recomputes there.
"""

from __future__ import annotations

import torch

__all__ = ["SampledLogprobRecorder"]


class SampledLogprobRecorder:
    """Forward hook (``register_forward_hook(recorder, with_kwargs=True)``) for one ``generate`` call."""

    def __init__(self, temperature: float):
        self.temperature = float(temperature)
        self.steps: list[torch.Tensor] = []  # log-prob of the token sampled at step k, (batch,)
        self.fed: list[torch.Tensor] = []  # the token fed back at step k + 1, i.e. sampled at step k, (batch,)
        self._pending: torch.Tensor | None = None  # log-softmax of the latest step, awaiting its token
        self.rows: int | None = None
        self.failure: str | None = None  # why the record cannot be used (then TRL recomputes)

    def __call__(self, module, args, kwargs, output):
        if self.failure is not None:
            return None
        logits = getattr(output, "logits", None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if logits is None or input_ids is None or logits.dim() != 3:
            self.failure = "the model's forward returned no logits or received no input_ids"
            return None
        if self._pending is None:  # prefill: the prompt
            if self.steps:
                self.failure = "a second prefill inside one generate call"
                return None
            self.rows = input_ids.size(0)
        else:  # a decoding step feeds back the token sampled from the previous logits
            if input_ids.size(0) != self.rows or input_ids.size(1) != 1:
                self.failure = f"unexpected decoding input of shape {tuple(input_ids.shape)}"
                return None
            token = input_ids[:, -1:].to(self._pending.device)
            self.steps.append(self._pending.gather(1, token).squeeze(1))
            self.fed.append(token.squeeze(1))
        self._pending = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)
        return None

    def finish(self, completion_ids: list[list[int]]) -> torch.Tensor | None:
        """``(rows, steps)`` log-probs of the sampled tokens, or None (see ``failure``).

        The completions must be the tokens generate sampled: every token that went back through the
        model is compared with them (a wrapper that rewrites completions after generation makes the
        record unusable, and TRL's forward pass is used instead).
        """
        if self.failure is None and (self._pending is None or self.rows != len(completion_ids)):
            self.failure = f"{self.rows} recorded rows for {len(completion_ids)} completions"
        if self.failure is None:
            self.failure = self._check_tokens(completion_ids)
        if self.failure is not None:
            self._pending = None
            return None
        last = len(self.steps)  # index of the final sampled token, never fed back
        tokens = [ids[last] if len(ids) > last else 0 for ids in completion_ids]
        index = torch.tensor(tokens, device=self._pending.device).unsqueeze(1)
        self.steps.append(self._pending.gather(1, index).squeeze(1))
        self._pending = None
        return torch.stack(self.steps, dim=1)

    def _check_tokens(self, completion_ids: list[list[int]]) -> str | None:
        longest = max((len(ids) for ids in completion_ids), default=0)
        if longest > len(self.steps) + 1:
            return f"completions longer ({longest}) than the {len(self.steps) + 1} generate steps"
        if not self.fed:
            return None
        fed = torch.stack(self.fed, dim=1).cpu()  # (rows, steps - 1)
        width = min(fed.size(1), longest)
        expected = torch.full((len(completion_ids), width), -1, dtype=fed.dtype)
        for row, ids in enumerate(completion_ids):
            head = ids[:width]
            expected[row, : len(head)] = torch.tensor(head, dtype=fed.dtype)
        known = expected >= 0
        if not torch.equal(fed[:, :width][known], expected[known]):
            return "the completions differ from the tokens generate sampled"
        return None
