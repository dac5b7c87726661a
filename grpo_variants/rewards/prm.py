"""A model-based process reward model (PRM) as a plain step reward callable.

:class:`ModelStepReward` wraps any ``transformers`` model that scores text and returns a
:class:`~grpo_variants.rewards.steps.StepReward` per completion: the completion is cut into steps at a
delimiter, and step j is scored on the text ``prompt + completion[:end_j]`` (everything the policy wrote up
to the end of the step):

* a **causal LM** used as a PRM (Math-Shepherd style): with ``good_token`` (and ``bad_token``), the score is
  P(good) / (P(good) + P(bad)) of the next token after the step (``bad_token=None``: P(good) over the whole
  vocabulary);
* a **sequence classifier** (``AutoModelForSequenceClassification``, one label): sigmoid of its logit; with
  several labels, the softmax probability of label ``label``.

It is an ordinary step reward: pass it in ``reward_funcs`` (it gets the timeouts, error handling and NaN
checks of every reward; TRL's calling convention). It runs one forward pass per step, in batches of
``batch_size`` prefixes, under ``torch.no_grad`` on the model's device.
Example (illustrative)::

    prm = ModelStepReward("my-prm-model", delimiter="\\n", good_token="+", bad_token="-")
    trainer = GRPOVariantTrainer(model, reward_funcs=["math_accuracy", prm], args=config, ...)
"""

from __future__ import annotations

import torch

from grpo_variants.errors import ConfigError
from grpo_variants.rewards.steps import StepReward

__all__ = ["ModelStepReward"]


def _text(x) -> str:
    if isinstance(x, list):
        return "".join(m.get("content", "") for m in x if isinstance(m, dict))
    return "" if x is None else str(x)


class ModelStepReward:
    """Score every ``delimiter``-terminated step of a completion with a model (see the module docstring)."""

    returns_steps = True  # a step reward (grpo_variants.rewards.steps)
    step_delimiter = None  # ends are given explicitly

    def __init__(self, model, tokenizer=None, *, delimiter: str = "\n", good_token: str | None = None,
                 bad_token: str | None = None, label: int = 0, batch_size: int = 16, score_last: bool = True,
                 name: str = "model_prm"):
        from transformers import AutoTokenizer

        if isinstance(model, str):
            from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

            loader = AutoModelForCausalLM if good_token is not None else AutoModelForSequenceClassification
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = loader.from_pretrained(model)
        if tokenizer is None:
            raise ConfigError("ModelStepReward needs the model's tokenizer (tokenizer=...) when given a model object.")
        if not delimiter:
            raise ConfigError("ModelStepReward needs a non-empty step delimiter.")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.delimiter, self.label, self.batch_size, self.score_last = delimiter, label, batch_size, score_last
        self.good_id = self._token_id(good_token) if good_token is not None else None
        self.bad_id = self._token_id(bad_token) if bad_token is not None else None
        self.__name__ = name

    def _token_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"ModelStepReward: {token!r} is {len(ids)} tokens for this tokenizer; give a single token."
            )
        return ids[0]

    def step_ends(self, text: str) -> list[int]:
        """Where the steps of ``text`` end: after each delimiter, plus the end of a non-empty last part."""
        ends, start = [], 0
        while (at := text.find(self.delimiter, start)) >= 0:
            start = at + len(self.delimiter)
            ends.append(start)
        if self.score_last and text[start:].strip():
            ends.append(len(text))
        return ends

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> list[float]:
        """The model's score of each text (the PRM's judgement of the last step it ends with)."""
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start : start + self.batch_size]
            enc = self.tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(device)
            logits = self.model(**enc).logits
            if self.good_id is not None:  # causal LM: the next-token distribution after the step
                last = logits[:, -1, :].float()
                if self.bad_id is not None:
                    pair = torch.stack([last[:, self.good_id], last[:, self.bad_id]], dim=1)
                    scores += torch.softmax(pair, dim=1)[:, 0].tolist()
                else:
                    scores += torch.softmax(last, dim=1)[:, self.good_id].tolist()
            elif logits.size(-1) == 1:
                scores += torch.sigmoid(logits[:, 0].float()).tolist()
            else:
                scores += torch.softmax(logits.float(), dim=-1)[:, self.label].tolist()
        return scores

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[StepReward]:
        prompts = list(prompts) if prompts is not None else [""] * len(completions)
        texts, owners, ends_of = [], [], []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            text = _text(c)
            ends = self.step_ends(text)
            ends_of.append(ends)
            for e in ends:
                texts.append(_text(p) + text[:e])
                owners.append(i)
        scores = self.score_texts(texts) if texts else []
        per_completion: list[list[float]] = [[] for _ in completions]
        for i, s in zip(owners, scores, strict=True):
            per_completion[i].append(s)
        return [StepReward(tuple(e), tuple(s)) for e, s in zip(ends_of, per_completion, strict=True)]
