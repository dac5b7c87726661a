"""Two-stage rollouts (iGRPO's draft -> rewrite, arXiv:2602.09000) as a component a variant composes.

A trainer that mixes in :class:`TwoStageRolloutMixin` (before :class:`~grpo_variants.GRPOVariantTrainer`)
and whose config has ``num_drafts`` gets, at every training rollout:

1. **Drafts** (no gradient): ``num_drafts`` = N completions for every unique prompt of the *global*
   generation batch (a group's G rows may straddle processes). The prompt-major request list is cut
   into equal consecutive shares (:func:`draft_plan`), so every process generates the same number of
   drafts in lock-step (ZeRO-3 and vLLM need every rank to call generate). They are generated and
   scored by TRL's own ``_generate`` and ``_calculate_rewards``, with the training reward functions and
   weights; the result (:class:`Drafts`: texts, rewards, in global order) is identical on every rank.
2. **The rewrite**: the variant's :meth:`~TwoStageRolloutMixin._rewrite_prompts` builds each local row's
   new prompt from the drafts of its prompt (iGRPO: the best draft inserted into the prompt).
3. **The trained stage**: ``super()._generate_and_score_completions`` (TRL's rollout) on the rewritten
   rows; its output is what is trained. Drafts never reach the loss.

A rewrite by template: :func:`render_draft_prompt` formats a string prompt with ``template.format(prompt=q,
draft=d)`` and rewrites the last user message of a conversational one; :func:`validate_draft_template`
checks a template at construction (exactly the fields ``{prompt}`` and ``{draft}``).

Evaluation stays single-shot (in eval mode the rollout is the base trainer's). Bookkeeping: TRL's
``completions/*`` metrics describe the trained completions, so the drafts' entries are moved under
``<draft_metric_prefix>/draft_completions/*`` and their reward-side logs under ``<prefix>/draft/*``
(iGRPO: ``igrpo``). Draft tokens count as generated (``useful_token_fraction`` charges them). Custom
rollouts (tools, environments, ``rollout_func``), stage rollouts and dynamic sampling do not compose with
it and are refused at construction.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from grpo_variants.errors import ConfigError, DatasetError

__all__ = ["Drafts", "TwoStageRolloutMixin", "draft_plan", "draft_text", "render_draft_prompt",
           "validate_draft_template"]


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
                        "the two-stage rollout rewrites the last user message of a conversational prompt with "
                        "draft_template, but its content is not a plain string (multimodal content blocks are not "
                        "supported)."
                    )
                rewritten = {**message, "content": template.format(prompt=message["content"], draft=draft)}
                return [*prompt[:index], rewritten, *prompt[index + 1 :]]
        raise DatasetError("a draft template needs a user message in every conversational prompt to insert the draft "
                           "into.")
    raise DatasetError(f"cannot insert a draft into a prompt of type {type(prompt).__name__}.")


def draft_plan(num_prompts: int, num_drafts: int, num_processes: int, process_index: int) -> list[int]:
    """Which global prompt each of this process's draft requests belongs to.

    The global request list is prompt-major (prompt 0 x N, prompt 1 x N, ...) and is cut into
    ``num_processes`` equal consecutive slices, so every process generates the same number of drafts
    and the gathered order is the global order.
    """
    total = num_prompts * num_drafts
    if total % num_processes != 0:
        raise ConfigError(
            f"two-stage rollout N + G budget inconsistent: {num_prompts} prompts x num_drafts={num_drafts} = {total} "
            f"draft requests cannot be split evenly over {num_processes} processes. Choose num_drafts, "
            "per_device_train_batch_size or num_generations so that (generation_batch_size / num_generations) "
            "x num_drafts is divisible by the number of processes."
        )
    per_process = total // num_processes
    start = process_index * per_process
    return [request // num_drafts for request in range(start, start + per_process)]


@dataclass
class Drafts:
    """The scored drafts of one rollout, gathered over processes (identical on every rank)."""

    unique_rows: list[dict]  # one dataset row per prompt group of the global batch, in global order
    texts: list[str]  # every draft's text, prompt-major: prompt u's drafts are texts[u * N : (u + 1) * N]
    rewards: torch.Tensor  # (U * N,) total weighted reward of each draft (NaN: unscored), same order
    rewards_per_func: torch.Tensor  # (U * N, reward functions)
    num_drafts: int
    tokens: int  # draft tokens generated, all processes
    tokens_before: int  # tokens the rollout had generated before the drafts


class TwoStageRolloutMixin:
    """Drafts, a prompt rewrite, then TRL's rollout on the rewritten rows; see the module docstring.

    The variant implements :meth:`_rewrite_prompts` and may extend :meth:`_after_second_stage`.
    """

    draft_metric_prefix = "two_stage"

    def _check_args(self, args) -> None:
        super()._check_args(args)
        if not isinstance(getattr(args, "num_drafts", None), int):
            raise ConfigError(
                f"{type(self).__name__} runs a two-stage rollout and needs a config with an integer num_drafts (drafts "
                f"per prompt); {type(args).__name__} has num_drafts={getattr(args, 'num_drafts', None)!r}."
            )
        if getattr(args, "stage_prompts", None) is not None:
            raise ConfigError(
                f"{type(self).__name__} runs a two-stage (draft -> rewrite) rollout, which does not compose with "
                f"stage rollouts: unset stage_prompts ({args.stage_prompts})."
            )
        unique = args.generation_batch_size // args.num_generations
        draft_plan(unique, args.num_drafts, max(args.world_size, 1), 0)  # raises the budget ConfigError

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, value in (("tools", self.tools), ("environment_factory", self.environment_factories),
                            ("rollout_func", self.rollout_func)):
            if value:
                raise ConfigError(
                    f"{type(self).__name__} does not support {name}: its drafts are plain single-turn generations "
                    "scored by the reward functions. Remove it or use another variant."
                )

    # ---- the hooks a variant implements -------------------------------------------------------------
    def _rewrite_prompts(self, inputs: list[dict], drafts: Drafts) -> list[dict]:
        """The local rows with their prompts rewritten from the drafts (row j of this process belongs to
        global prompt ``(process_index * len(inputs) + j) // num_generations``)."""
        raise NotImplementedError

    def _after_second_stage(self, output: dict, drafts: Drafts) -> None:
        """Called with the trained stage's rollout output (its rewards are ``self.weighted_rewards()``)."""

    # ---- the rollout ----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: single-shot from the original prompt
            return super()._generate_and_score_completions(inputs)
        with self._timed("rollout"), torch.no_grad():
            drafts = self._draft_stage(inputs)
            rewritten = self._rewrite_prompts(inputs, drafts)
        output = super()._generate_and_score_completions(rewritten)
        self._after_second_stage(output, drafts)
        return output

    def prompt_index(self, local_row: int, local_rows: int) -> int:
        """The global prompt (index into ``Drafts.unique_rows``) of this process's row ``local_row``."""
        return (self.accelerator.process_index * local_rows + local_row) // self.num_generations

    def _draft_stage(self, inputs) -> Drafts:
        """Stage 1: generate and score N drafts per global prompt, in lock-step on every process."""
        group, num_drafts = self.num_generations, self.args.num_drafts
        num_processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        if any("image" in row or "images" in row for row in inputs[:1]):
            raise DatasetError(
                f"{type(self).__name__} supports text prompts only: the dataset has an 'image'/'images' column."
            )

        all_rows = gather_object(list(inputs))  # the global generation batch, rank-major
        local = len(inputs)
        if len(all_rows) != local * num_processes or len(all_rows) % group != 0:
            raise ConfigError(
                f"two-stage rollout N + G budget inconsistent: the global generation batch has {len(all_rows)} rows "
                f"({local} on this process); it must hold whole groups of num_generations={group} rows, equally "
                "on every process."
            )
        unique_rows = all_rows[::group]
        for u, row in enumerate(unique_rows):  # TRL's sampler puts each group's G copies consecutively
            if any(other["prompt"] != row["prompt"] for other in all_rows[u * group : (u + 1) * group]):
                raise DatasetError(
                    f"the two-stage rollout expects each group of num_generations={group} consecutive rows to share "
                    f"one prompt (TRL's RepeatSampler); group {u} does not. Was the train sampler replaced?"
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
        self._set_drafts_metrics_aside(sizes_before, extra_before, pending_before)
        return Drafts(
            unique_rows=unique_rows,
            texts=gather_object([draft_text(c) for c in completions]),
            rewards=draft_rewards,
            rewards_per_func=rewards_per_func,
            num_drafts=num_drafts,
            tokens=draft_tokens,
            tokens_before=tokens_before,
        )

    def _set_drafts_metrics_aside(self, sizes_before: dict, extra_before: dict, pending_before: dict) -> None:
        """TRL's completions/* metrics (and the accuracy rewards' right_fraction) describe trained completions: move
        the drafts' entries aside."""
        metrics, prefix = self._metrics["train"], self.draft_metric_prefix
        for key in list(metrics):
            describes_completions = key.startswith("completions/") or key.endswith("/right_fraction")
            if describes_completions and len(metrics[key]) > sizes_before.get(key, 0):
                new = metrics[key][sizes_before.get(key, 0) :]
                del metrics[key][sizes_before.get(key, 0) :]
                metrics[f"{prefix}/draft_{key}"].extend(new)
        # Reward-side logs of the drafts: extra columns would not match the trained stage's table; metrics renamed.
        draft_pending = {k: v[len(pending_before.get(k, [])) :] for k, v in self._pending_metrics.items()}
        self._pending_extra_logs.clear()
        self._pending_extra_logs.update(extra_before)
        self._pending_metrics.clear()
        self._pending_metrics.update(pending_before)
        for key, values in draft_pending.items():
            if values:
                self._pending_metrics[f"{prefix}/draft/{key}"].extend(values)
