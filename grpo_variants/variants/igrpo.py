"""iGRPO — Iterative GRPO with self-feedback (Hatamizadeh et al., NVIDIA, 2026, arXiv:2602.09000).

What it computes (``docs/algorithms.md``, "iGRPO"), for every prompt q of a rollout:

* Stage 1 (no gradient): sample ``num_drafts`` = N drafts from pi_old(.|q), score them with the
  *same* reward functions and weights used for training, and keep the best draft d (highest total
  weighted reward; ties -> the first draft; a draft every reward function left unscored ranks last).
* Stage 2: rewrite the prompt to q' = ``draft_template.format(prompt=q, draft=d)`` and sample
  ``num_generations`` = G refinements from pi_old(.|q'). Only these are trained: group-std advantage
  (0 when the group's std is 0), token ratio and KL under q', clip 0.2, seq-mean-token-mean.
  Drafts never reach the loss.
* Inference and evaluation stay single-shot from q: in eval mode the trainer is plain GRPO
  (``toy.evaluate`` is single-shot too).

Budget: N + G completions per prompt (paper: 4 + 4, matching plain GRPO with G = 8).
Paper defaults: beta = 0, lr 1e-6 with a cosine schedule, temperature 0.7 (both stages).

The two stages are the two-stage rollout component, :mod:`grpo_variants.rollout.two_stage` (drafts for the
unique prompts of the global batch, split evenly over processes and generated in lock-step, scored with
TRL's own ``_generate`` / ``_calculate_rewards``, then TRL's rollout on the rewritten rows; nothing of
TRL's rollout is copied), with its template helpers (:func:`~grpo_variants.rollout.two_stage.render_draft_prompt`,
:func:`~grpo_variants.rollout.two_stage.validate_draft_template`). This file adds the paper's choices: which draft
is kept (:func:`select_best_drafts`), the template, the defaults and the metrics below.

Templates. String prompts: ``draft_template.format(prompt=q, draft=d)``. Conversational prompts:
the content of the *last user message* is rewritten with the same template (the other messages are
kept). The default, :data:`DEFAULT_DRAFT_TEMPLATE`, appends the draft to the question and asks for
an improved solution (the paper appends the best draft to the original prompt; its exact wording is
not reproduced here). :data:`TOY_DRAFT_TEMPLATE` is for the toy arithmetic kit, whose character
vocabulary has no letters (and whose saved tokenizer drops spaces): it brackets the draft and
repeats the question, so q' still ends with "a+b=". The toy warm start never saw any context before
the question: its greedy accuracy falls from ~33% on q to 2-4% on every q' we tried (even with the
gold answer as the draft), so the toy run exercises the mechanics, not the paper's gains.

Logged (train): ``igrpo/draft_reward_mean`` (all drafts), ``igrpo/best_draft_reward_mean``,
``igrpo/refined_reward_mean`` (stage 2), ``igrpo/refinement_gain`` (refined - best draft) and
``igrpo/draft_token_fraction`` (draft tokens / all generated tokens of the rollout). TRL's
``completions/*`` metrics describe the trained (stage-2) completions; the drafts' are logged as
``igrpo/draft_completions/*``. Draft tokens count as generated tokens, so ``useful_token_fraction``
charges them (about N / (N + G) of the budget never receives gradient). After each training rollout
``trainer._last_draft_selection`` holds the gathered drafts, their per-function rewards and the chosen
indices and texts, for inspection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer
from grpo_variants.rollout.two_stage import (  # noqa: F401  (draft_plan, draft_text: importable from here)
    Drafts,
    TwoStageRolloutMixin,
    draft_plan,
    draft_text,
    render_draft_prompt,
    validate_draft_template,
)

__all__ = ["DEFAULT_DRAFT_TEMPLATE", "TOY_DRAFT_TEMPLATE", "IGRPOConfig", "IGRPOTrainer", "draft_plan",
           "draft_text", "render_draft_prompt", "select_best_drafts", "validate_draft_template"]

DEFAULT_DRAFT_TEMPLATE = (
    "{prompt}\n\n"
    "Here is a previous attempt at this problem:\n\n{draft}\n\n"
    "Using the attempt above as a draft, write an improved, complete solution."
)
TOY_DRAFT_TEMPLATE = "{prompt}({draft}){prompt}"  # toy kit: "37+45=" + "82" -> "37+45=(82)37+45="


# ------------------------------------------------------------------------------------------------
# The paper's selection rule (pure, unit-tested); the template helpers live in grpo_variants.rollout.two_stage
# ------------------------------------------------------------------------------------------------
def select_best_drafts(rewards: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """Index of the best draft of each prompt.

    ``rewards`` holds the total weighted reward of every draft, prompt-major ((U * N,) or (U, N)).
    Highest reward wins; ties go to the first draft; NaN (unscored) ranks below every number; a prompt
    whose drafts are all unscored gets draft 0.
    """
    grouped = rewards.detach().float().reshape(-1, num_drafts)
    grouped = torch.where(torch.isnan(grouped), torch.full_like(grouped, -torch.inf), grouped)
    best = grouped.max(dim=1, keepdim=True).values
    is_best = grouped == best  # all True for an all -inf row -> first index
    return is_best.int().argmax(dim=1)  # argmax of a 0/1 tensor: the first maximal position


# ------------------------------------------------------------------------------------------------
# Config and trainer
# ------------------------------------------------------------------------------------------------
@dataclass
class IGRPOConfig(GRPOVariantConfig):
    """The iGRPO defaults: 4 drafts + 4 trained refinements, beta 0, lr 1e-6 cosine, temperature 0.7."""

    variant: str | None = field(default="igrpo")
    num_drafts: int = field(
        default=4,
        metadata={"help": "N: drafts per prompt in stage 1 (scored, never trained). The trained group is G = "
                  "num_generations; the rollout budget is N + G completions per prompt."},
    )
    num_generations: int | None = field(default=4, metadata={"help": "G: trained refinements per prompt."})
    draft_template: str = field(
        default=DEFAULT_DRAFT_TEMPLATE,
        metadata={"help": "Format string of the refinement prompt q' with the fields {prompt} and {draft}. "
                  "Conversational prompts: applied to the last user message's content."},
    )
    loss_type: str = field(default="grpo")
    aggregation: str | None = field(default="seq_mean_token_mean")
    scale_rewards: str = field(default="group")
    epsilon: float = field(default=0.2)
    beta: float = field(default=0.0)
    use_bias_correction_kl: bool = field(default=False)  # plain k3 when beta > 0 (as in GRPO)
    learning_rate: float = field(default=1e-6)
    lr_scheduler_type: str = field(default="cosine")
    temperature: float = field(default=0.7)

    def _validate_variant_fields(self) -> None:
        super()._validate_variant_fields()
        if not isinstance(self.num_drafts, int) or self.num_drafts < 1:
            raise ConfigError(
                f"iGRPO N + G budget inconsistent: num_drafts={self.num_drafts!r} must be an integer >= 1 (the "
                "drafts per prompt of stage 1; plain GRPO is the 'grpo' variant)."
            )
        validate_draft_template(self.draft_template)

    @property
    def completions_per_prompt(self) -> int:
        """N + G: completions generated per prompt and rollout."""
        return self.num_drafts + self.num_generations


@register_variant(
    "igrpo",
    description="iGRPO: N scored drafts, best draft inserted into the prompt, GRPO on G refinements (4 + 4)",
    paper="arXiv:2602.09000",
)
class IGRPOTrainer(TwoStageRolloutMixin, GRPOVariantTrainer):
    """iGRPO: two-stage rollout (drafts, then draft-conditioned refinements); see the module docstring."""

    config_class = IGRPOConfig
    draft_metric_prefix = "igrpo"  # the drafts' TRL metrics go under igrpo/draft_completions/* (two_stage)

    def _rewrite_prompts(self, inputs: list[dict], drafts: Drafts) -> list[dict]:
        """The paper's rewrite: the best draft of each prompt inserted into it, q' = template(q, d)."""
        N = drafts.num_drafts
        best = select_best_drafts(drafts.rewards, N)  # identical on every rank
        best_text = [drafts.texts[u * N + int(best[u])] for u in range(len(drafts.unique_rows))]
        rewritten = []
        for j, row in enumerate(inputs):
            draft = best_text[self.prompt_index(j, len(inputs))]
            rewritten.append({**row, "prompt": render_draft_prompt(row["prompt"], draft, self.args.draft_template)})
        self._last_draft_selection = {
            "drafts": drafts.texts,
            "rewards_per_func": drafts.rewards_per_func,
            "best_index": best.tolist(),
            "best_draft": best_text,
        }
        return rewritten

    def _after_second_stage(self, output: dict, drafts: Drafts) -> None:
        best = torch.tensor(self._last_draft_selection["best_index"], device=drafts.rewards.device)
        best_mean = torch.nanmean(drafts.rewards.reshape(-1, drafts.num_drafts).gather(1, best.unsqueeze(1))).item()
        refined = torch.nanmean(self.weighted_rewards()).item()
        metrics = self._metrics["train"]
        metrics["igrpo/draft_reward_mean"].append(torch.nanmean(drafts.rewards).item())
        metrics["igrpo/best_draft_reward_mean"].append(best_mean)
        metrics["igrpo/refined_reward_mean"].append(refined)
        metrics["igrpo/refinement_gain"].append(refined - best_mean)
        total_tokens = self._tokens_generated_round - drafts.tokens_before
        metrics["igrpo/draft_token_fraction"].append(drafts.tokens / max(total_tokens, 1))
