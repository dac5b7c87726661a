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

How it wraps TRL (nothing of TRL's rollout is copied): ``_generate_and_score_completions`` builds
the draft requests for the unique prompts of the *global* generation batch (a group's G rows may
straddle processes), splits them evenly across processes so every process generates the same number
of drafts in lock-step (ZeRO-3 and vLLM need every rank to call generate), calls TRL's own
``_generate`` and ``_calculate_rewards`` for them, picks the best draft per prompt identically on
every rank, rewrites each local row's prompt and hands the rewritten rows to
``super()._generate_and_score_completions``: its output (stage-2 completions only) is what is trained.

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

import string
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError, DatasetError
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer

DEFAULT_DRAFT_TEMPLATE = (
    "{prompt}\n\n"
    "Here is a previous attempt at this problem:\n\n{draft}\n\n"
    "Using the attempt above as a draft, write an improved, complete solution."
)
TOY_DRAFT_TEMPLATE = "{prompt}({draft}){prompt}"  # toy kit: "37+45=" + "82" -> "37+45=(82)37+45="


# ------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested on their own)
# ------------------------------------------------------------------------------------------------
def validate_draft_template(template: str) -> None:
    """A template must be a format string whose only fields are ``{prompt}`` and ``{draft}`` (both)."""
    if not isinstance(template, str):
        raise ConfigError(f"draft_template must be a string, got {type(template).__name__}.")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ConfigError(
            f"draft_template {template!r} is not a valid format string ({err}). Write literal braces as '{{{{' "
            "and '}}}}'."
        ) from err
    if names != {"prompt", "draft"}:
        raise ConfigError(
            f"draft_template must contain exactly the fields {{prompt}} and {{draft}}; {template!r} has "
            f"{sorted(names) or 'none'}. Example: '{{prompt}}\\n\\nPrevious attempt:\\n{{draft}}\\n\\nImprove it.'"
        )


def draft_text(completion) -> str:
    """The text of a completion: a string, or the assistant contents of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        parts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):  # content blocks
                content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
            parts.append(content if isinstance(content, str) else str(content))
        return "".join(parts)
    return str(completion)


def render_draft_prompt(prompt, draft: str, template: str):
    """q' = template(q, d). A string prompt is formatted directly; a conversation gets its last user
    message's content rewritten (other messages untouched). Returns a new object, never mutates ``prompt``."""
    if isinstance(prompt, str):
        return template.format(prompt=prompt, draft=draft)
    if isinstance(prompt, list):
        for index in range(len(prompt) - 1, -1, -1):
            message = prompt[index]
            if isinstance(message, dict) and message.get("role") == "user":
                if not isinstance(message.get("content"), str):
                    raise DatasetError(
                        "iGRPO rewrites the last user message of a conversational prompt with draft_template, but "
                        "its content is not a plain string (multimodal content blocks are not supported)."
                    )
                rewritten = {**message, "content": template.format(prompt=message["content"], draft=draft)}
                return [*prompt[:index], rewritten, *prompt[index + 1 :]]
        raise DatasetError("iGRPO needs a user message in every conversational prompt to insert the draft into.")
    raise DatasetError(f"iGRPO cannot insert a draft into a prompt of type {type(prompt).__name__}.")


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


def draft_plan(num_prompts: int, num_drafts: int, num_processes: int, process_index: int) -> list[int]:
    """Which global prompt each of this process's draft requests belongs to.

    The global request list is prompt-major (prompt 0 x N, prompt 1 x N, ...) and is cut into
    ``num_processes`` equal consecutive slices, so every process generates the same number of drafts
    and the gathered order is the global order.
    """
    total = num_prompts * num_drafts
    if total % num_processes != 0:
        raise ConfigError(
            f"iGRPO N + G budget inconsistent: {num_prompts} prompts x num_drafts={num_drafts} = {total} draft "
            f"requests cannot be split evenly over {num_processes} processes. Choose num_drafts, "
            "per_device_train_batch_size or num_generations so that (generation_batch_size / num_generations) "
            "x num_drafts is divisible by the number of processes."
        )
    per_process = total // num_processes
    start = process_index * per_process
    return [request // num_drafts for request in range(start, start + per_process)]


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
class IGRPOTrainer(GRPOVariantTrainer):
    """iGRPO: two-stage rollout (drafts, then draft-conditioned refinements); see the module docstring."""

    config_class = IGRPOConfig

    def _check_args(self, args) -> None:
        super()._check_args(args)
        unique = args.generation_batch_size // args.num_generations
        draft_plan(unique, args.num_drafts, max(args.world_size, 1), 0)  # raises the budget ConfigError

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, value in (("tools", self.tools), ("environment_factory", self.environment_factories),
                            ("rollout_func", self.rollout_func)):
            if value:
                raise ConfigError(
                    f"iGRPO does not support {name}: drafts are plain single-turn generations scored by the reward "
                    "functions. Remove it or use another variant."
                )

    # ---- the two-stage rollout --------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: single-shot from the original prompt
            return super()._generate_and_score_completions(inputs)
        with self._timed("rollout"):
            rewritten, stats = self._draft_and_rewrite(inputs)
        output = super()._generate_and_score_completions(rewritten)
        refined = torch.nanmean(self.weighted_rewards()).item()
        metrics = self._metrics["train"]
        metrics["igrpo/draft_reward_mean"].append(stats["draft_mean"])
        metrics["igrpo/best_draft_reward_mean"].append(stats["best_mean"])
        metrics["igrpo/refined_reward_mean"].append(refined)
        metrics["igrpo/refinement_gain"].append(refined - stats["best_mean"])
        total_tokens = self._tokens_generated_round - stats["tokens_before"]
        metrics["igrpo/draft_token_fraction"].append(stats["draft_tokens"] / max(total_tokens, 1))
        return output

    @torch.no_grad()
    def _draft_and_rewrite(self, inputs):
        """Stage 1: generate and score N drafts per global prompt; return the rows with q' prompts."""
        args = self.args
        group, num_drafts = self.num_generations, args.num_drafts
        num_processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        if any("image" in row or "images" in row for row in inputs[:1]):
            raise DatasetError("iGRPO supports text prompts only: the dataset has an 'image'/'images' column.")

        all_rows = gather_object(list(inputs))  # the global generation batch, rank-major
        local = len(inputs)
        if len(all_rows) != local * num_processes or len(all_rows) % group != 0:
            raise ConfigError(
                f"iGRPO N + G budget inconsistent: the global generation batch has {len(all_rows)} rows "
                f"({local} on this process); it must hold whole groups of num_generations={group} rows, equally "
                "on every process."
            )
        unique_rows = all_rows[::group]
        for u, row in enumerate(unique_rows):  # TRL's sampler puts each group's G copies consecutively
            if any(other["prompt"] != row["prompt"] for other in all_rows[u * group : (u + 1) * group]):
                raise DatasetError(
                    f"iGRPO expects each group of num_generations={group} consecutive rows to share one prompt "
                    f"(TRL's RepeatSampler); group {u} does not. Was the train sampler replaced?"
                )

        # Draft requests for this process: an equal, consecutive share of the prompt-major global list.
        plan = draft_plan(len(unique_rows), num_drafts, num_processes, rank)
        draft_rows = [dict(unique_rows[u]) for u in plan]
        draft_prompts = [row["prompt"] for row in draft_rows]

        metrics = self._metrics["train"]
        sizes_before = {key: len(values) for key, values in metrics.items()}
        extra_before = {key: list(values) for key, values in self._pending_extra_logs.items()}
        pending_before = {key: list(values) for key, values in self._pending_metrics.items()}
        tokens_before = self._tokens_generated_round
        saved_group = self.num_generations
        self.num_generations = num_drafts  # vLLM server mode dedups prompts in blocks of num_generations
        try:
            _, completion_ids, _, completions, _, _, _, _ = self._generate(draft_prompts)
        finally:
            self.num_generations = saved_group
        draft_tokens = self._tokens_generated_round - tokens_before
        rewards_per_func = self._calculate_rewards(draft_rows, draft_prompts, completions, completion_ids)
        draft_rewards = self.weighted_rewards()  # (U * N,), gathered in global request order

        # TRL's completions/* metrics describe trained completions: move the drafts' entries aside.
        for key in list(metrics):
            if key.startswith("completions/") and len(metrics[key]) > sizes_before.get(key, 0):
                new = metrics[key][sizes_before.get(key, 0) :]
                del metrics[key][sizes_before.get(key, 0) :]
                metrics[f"igrpo/draft_{key}"].extend(new)
        # Reward-side logs of the drafts: extra columns would not match the stage-2 table; metrics are renamed.
        draft_pending = {k: v[len(pending_before.get(k, [])) :] for k, v in self._pending_metrics.items()}
        self._pending_extra_logs.clear()
        self._pending_extra_logs.update(extra_before)
        self._pending_metrics.clear()
        self._pending_metrics.update(pending_before)
        for key, values in draft_pending.items():
            if values:
                self._pending_metrics[f"igrpo/draft/{key}"].extend(values)

        all_drafts = gather_object([draft_text(c) for c in completions])
        best = select_best_drafts(draft_rewards, num_drafts)  # identical on every rank
        best_text = [all_drafts[u * num_drafts + int(best[u])] for u in range(len(unique_rows))]
        best_reward = draft_rewards.reshape(-1, num_drafts).gather(1, best.unsqueeze(1).to(draft_rewards.device))

        rewritten = []
        for j, row in enumerate(inputs):
            u = (rank * local + j) // group
            rewritten.append({**row, "prompt": render_draft_prompt(row["prompt"], best_text[u], args.draft_template)})
        self._last_draft_selection = {
            "drafts": all_drafts,
            "rewards_per_func": rewards_per_func,
            "best_index": best.tolist(),
            "best_draft": best_text,
        }
        stats = {
            "draft_mean": torch.nanmean(draft_rewards).item(),
            "best_mean": torch.nanmean(best_reward).item(),
            "draft_tokens": draft_tokens,
            "tokens_before": tokens_before,
        }
        return rewritten, stats
