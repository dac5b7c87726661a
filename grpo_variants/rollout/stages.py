"""Stage rollouts (µ-GRPO, arXiv:2605.17570) as one component that every variant composes.

Turned on by ``stage_prompts`` (with ``updates_per_stage``) on any
:class:`~grpo_variants.GRPOVariantConfig`; ``MuGRPOConfig`` sets them (1,024 prompts, µ = 1,024).
A *stage* is one large rollout reused for µ optimizer updates:

1. freeze the policy as the behaviour policy;
2. sample ``num_generations`` completions for each of ``stage_prompts`` prompts, in
   ``generation_chunk_prompts`` chunks per process (one TRL rollout call each, concatenated by
   :func:`grpo_variants.rollout.batch.concat_rollouts`), and store every response with its
   group-normalised advantage, its behaviour log-probs and ``policy_version`` (the global step that
   produced it);
3. release what generation held (``release_generation_memory``: colocated vLLM asleep, CUDA cache);
4. run µ = ``updates_per_stage`` updates on mini-batches of the buffer.

The stage is mapped onto TRL's own buffering, which generates one batch, splits it into
``steps_per_generation`` micro-batches and reuses them ``num_iterations`` times, computing the
behaviour log-probs whenever generation and optimizer steps are not aligned. The config derives
those three fields from the stage (:func:`derive_stage`): completions per update =
per_device_train_batch_size x gradient_accumulation_steps x world_size; mini-batches per pass =
stage_prompts x num_generations / completions per update; num_iterations = µ / mini-batches per pass;
steps_per_generation = mini-batches per pass x gradient_accumulation_steps. The mini-batches of a
stage are drawn by one shuffle of the buffer and visited in that order on every pass (TRL's order),
so every stored response is trained on exactly ``num_iterations`` times. µ = 1 is the on-policy rollout.

The trainer's rollout (``_generate_and_score_completions``) becomes :meth:`StageRolloutMixin._stage_rollout`,
a loop of TRL's own rollout over the chunks (``_scored_rollout``, never a copy of it). Logged per stage
under ``<stage_metric_prefix>/`` (``stages``; µ-GRPO: ``mu_grpo``): ``stage``, ``stage_generation_s``,
``stage_update_s`` (the previous stage's updates), ``stage_tokens``, ``stage_sequences_per_s``; per update:
``staleness`` (global step minus the policy version of the update's rows). ``trainer.stage_log`` keeps one
record per stage.

A checkpoint taken mid-stage resumes mid-stage: the base checkpoint (:mod:`grpo_variants.reliability`)
stores TRL's micro-step counter and the buffered stage, so the same buffer is used in the same remaining
mini-batch order; the stage counters and log are part of ``variant_state_dict``.

Dynamic sampling does not compose with stages (both rewrite the rollout): the trainer refuses the pair.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import warnings

import torch

from grpo_variants.errors import ConfigError, DatasetError, GRPOVariantsError
from grpo_variants.rollout.batch import concat_rollouts

__all__ = ["StageRolloutMixin", "derive_stage", "take_over_batch_fields"]

logger = logging.getLogger(__name__)

# The TRL fields a stage derives (the user leaves them unset).
DERIVED_FIELDS = ("steps_per_generation", "generation_batch_size", "num_iterations")


def _nearby_multiples(value: int, unit: int, count: int = 3) -> list[int]:
    """Up to ``count`` positive multiples of ``unit`` closest to ``value``."""
    base = max(unit, (value // unit) * unit)
    candidates = {base, base + unit, max(unit, base - unit), base + 2 * unit}
    return sorted(sorted(candidates, key=lambda x: (abs(x - value), x))[:count])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------------------
# The config side (called by GRPOVariantConfig.__post_init__)
# ------------------------------------------------------------------------------------------------
def take_over_batch_fields(config) -> dict | None:
    """Before TRL's ``__post_init__``: clear the fields the stage derives; return what the user gave.

    None when no stage is configured (``stage_prompts`` unset); then the other stage fields must be unset too.
    """
    if config.stage_prompts is None:
        given = [name for name in ("updates_per_stage", "num_stages", "generation_chunk_prompts")
                 if getattr(config, name) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} size a stage rollout, but stage_prompts is not set. Set stage_prompts (prompts "
                "per stage) and updates_per_stage (µ), or leave them all unset."
            )
        return None
    if config.updates_per_stage is None:
        raise ConfigError(
            f"stage_prompts={config.stage_prompts} turns on stage rollouts and needs updates_per_stage (µ: optimizer "
            "updates per stage, a multiple of the mini-batches per pass over the stage)."
        )
    if config.mini_batches_per_rollout is not None:
        raise ConfigError(
            "mini_batches_per_rollout and stage_prompts both set the updates per rollout; a stage derives them from "
            "stage_prompts and updates_per_stage. Set only one."
        )
    requested = {name: getattr(config, name) for name in DERIVED_FIELDS}
    config.steps_per_generation = None
    config.generation_batch_size = None
    config.num_iterations = 1
    return requested


def derive_stage(config, requested: dict) -> None:
    """After TRL's ``__post_init__``: size the stage to a short run, then set TRL's batch fields from it."""
    _size_stage_to_run(config)
    label = config.variant or "stage"
    G = config.num_generations
    if config.updates_per_stage < 1:
        raise ConfigError(f"updates_per_stage (µ) must be >= 1; got {config.updates_per_stage}.")
    if config.stage_prompts < 1:
        raise ConfigError(f"stage_prompts must be >= 1; got {config.stage_prompts}.")
    world = config.world_size
    per_update = config.per_device_train_batch_size * config.gradient_accumulation_steps * world
    stage_completions = config.stage_prompts * G
    unit = per_update // math.gcd(per_update, G)  # stage_prompts must be a multiple of this
    if stage_completions < per_update:
        raise ConfigError(
            f"{label}: stage smaller than one mini-batch: stage_prompts ({config.stage_prompts}) x num_generations "
            f"({G}) = {stage_completions} completions, but one update takes per_device_train_batch_size "
            f"({config.per_device_train_batch_size}) x gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}) x world_size ({world}) = {per_update}. Use stage_prompts in "
            f"{_nearby_multiples(config.stage_prompts, unit)} or a smaller per_device_train_batch_size."
        )
    if stage_completions % per_update != 0:
        raise ConfigError(
            f"{label}: stage not divisible into mini-batches: stage_prompts ({config.stage_prompts}) x "
            f"num_generations ({G}) = {stage_completions} completions is not a multiple of the {per_update} "
            f"completions per update (per_device_train_batch_size x gradient_accumulation_steps x world_size). Use "
            f"stage_prompts in {_nearby_multiples(config.stage_prompts, unit)}."
        )
    mini_batches = stage_completions // per_update
    if config.updates_per_stage % mini_batches != 0:
        raise ConfigError(
            f"updates_per_stage (µ = {config.updates_per_stage}) must be a multiple of the {mini_batches} "
            f"mini-batches per pass over the stage (stage_prompts x num_generations / completions per update), so "
            f"that every stored response is used equally often. Use updates_per_stage in "
            f"{_nearby_multiples(config.updates_per_stage, mini_batches)}, or change stage_prompts."
        )
    derived = {
        "num_iterations": config.updates_per_stage // mini_batches,
        "steps_per_generation": mini_batches * config.gradient_accumulation_steps,
        "generation_batch_size": stage_completions,
    }
    for name, value in requested.items():
        if value is not None and not (name == "num_iterations" and value == 1) and value != derived[name]:
            raise ConfigError(
                f"{label}: the stage derives {name} ({name}={derived[name]} for stage_prompts="
                f"{config.stage_prompts}, updates_per_stage={config.updates_per_stage}); {name}={value} was given. "
                "Leave it unset and size the stage with stage_prompts / updates_per_stage."
            )
    config.num_iterations = derived["num_iterations"]
    config.steps_per_generation = derived["steps_per_generation"]
    config.generation_batch_size = derived["generation_batch_size"]
    config.mini_batches_per_pass = mini_batches

    if config.num_stages is not None:
        if config.num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1; got {config.num_stages}.")
        total = config.num_stages * config.updates_per_stage
        if config.max_steps > 0 and config.max_steps != total:
            raise ConfigError(
                f"num_stages ({config.num_stages}) x updates_per_stage ({config.updates_per_stage}) = {total} "
                f"optimizer steps, but max_steps={config.max_steps}. Set only one of them."
            )
        config.max_steps = total
    _check_chunks(config, stage_completions, world)


def _check_chunks(config, stage_completions: int, world: int) -> None:
    G = config.num_generations
    local = stage_completions // world if stage_completions % world == 0 else None
    if config.generation_chunk_prompts is None:
        return
    chunk = config.generation_chunk_prompts * G
    if config.generation_chunk_prompts < 1 or local is None or local % chunk != 0:
        valid = _divisors(local // G) if local is not None and local % G == 0 else []
        raise ConfigError(
            f"generation_chunk_prompts ({config.generation_chunk_prompts}) must divide the prompts each process "
            f"generates per stage (stage_prompts / world_size = {config.stage_prompts}/{world}"
            + ("" if local is None or local % G else f" = {local // G}")
            + "). "
            + (f"Valid values: {valid[-6:]}." if valid else "Leave it None (one generation call per stage).")
        )
    chunks = local // chunk
    batch_level = config.scale_rewards == "batch" or config.multi_objective_aggregation == "normalize_then_sum"
    if chunks > 1 and batch_level:
        raise ConfigError(
            "generation_chunk_prompts splits the stage into several scoring calls, but scale_rewards='batch' "
            "/ multi_objective_aggregation='normalize_then_sum' normalise over the whole batch. Use "
            "scale_rewards='group' or leave generation_chunk_prompts=None."
        )
    if chunks > 1 and config.use_vllm and config.vllm_enable_sleep_mode:
        warnings.warn(
            "generation_chunk_prompts with vLLM sleep mode re-pushes the weights for every chunk (TRL puts "
            "vLLM to sleep after each generate call); leave generation_chunk_prompts=None with vLLM.",
            stacklevel=4,
        )


def _size_stage_to_run(config) -> None:
    """A run shorter than one default stage (a smoke run, ``max_steps=2``) gets a stage sized to it.

    With µ-GRPO's defaults (1024 prompts, µ = 1024) a 2-step run would generate a whole stage (over 8k
    completions) for 2 updates. When both stage fields are at their config class's defaults and
    ``max_steps`` is below µ, µ becomes ``max_steps`` and the stage keeps the default's reuse (updates per
    pass) as far as whole mini-batches allow; a warning says so. Explicit stage fields are never changed.
    """
    defaults = type(config).__dataclass_fields__
    default_mu, default_prompts = defaults["updates_per_stage"].default, defaults["stage_prompts"].default
    steps = config.max_steps
    if not (0 < steps < config.updates_per_stage) or config.num_stages is not None:
        return
    if (config.updates_per_stage, config.stage_prompts) != (default_mu, default_prompts):
        return
    G = config.num_generations
    per_update = config.per_device_train_batch_size * config.gradient_accumulation_steps * config.world_size
    passes = max(1, (default_prompts * G // per_update))  # mini-batches per pass of the default stage
    target = max(1, math.ceil(steps * passes / default_mu))
    for mini_batches in sorted((d for d in _divisors(steps) if d <= target), reverse=True):
        if (mini_batches * per_update) % G == 0:
            break
    else:
        return  # no whole-group stage fits: keep the default and let derive_stage explain
    config.updates_per_stage = steps
    config.stage_prompts = mini_batches * per_update // G
    logger.warning(
        "%s: max_steps=%d is shorter than one default stage (%d prompts, µ=%d); sizing the stage to the run: "
        "stage_prompts=%d, updates_per_stage=%d (set them to override).",
        config.variant or "stage", steps, default_prompts, default_mu, config.stage_prompts, config.updates_per_stage,
    )


# ------------------------------------------------------------------------------------------------
# The trainer side
# ------------------------------------------------------------------------------------------------
class StageRolloutMixin:
    """Stage rollouts for :class:`~grpo_variants.GRPOVariantTrainer` (mixed into the base trainer).

    The trainer provides ``_scored_rollout(inputs)`` (one TRL rollout, scored); see the module docstring.
    """

    stage_metric_prefix = "stages"  # metric and checkpoint namespace (µ-GRPO: "mu_grpo")

    def _init_stages(self) -> None:
        """State of the stage bookkeeping (called by the base ``__init__`` before TRL's)."""
        self._stage_index = 0  # stages generated so far
        self._stage_rollout_end: float | None = None
        self.stage_log: list[dict] = []  # one record per stage (timings, tokens, throughput)

    @property
    def stages_enabled(self) -> bool:
        return getattr(self.args, "stage_prompts", None) is not None

    def _check_stage_dataset(self) -> None:
        """A stage samples ``stage_prompts`` distinct prompts: the train dataset must hold that many."""
        if not self.stages_enabled:
            return
        try:
            size = len(self.train_dataset)
        except TypeError:  # IterableDataset
            return
        if size < self.args.stage_prompts:
            raise DatasetError(
                f"train_dataset has {size} prompts, fewer than stage_prompts ({self.args.stage_prompts}): a stage "
                "samples stage_prompts distinct prompts. Lower stage_prompts or use a larger dataset."
            )

    # ---- the stage rollout ------------------------------------------------------------------------
    def _stage_rollout(self, inputs):
        """One stage: TRL's rollout once per generation chunk, concatenated, with the stage bookkeeping."""
        start = time.perf_counter()
        update_s = None if self._stage_rollout_end is None else start - self._stage_rollout_end
        G = self.num_generations
        chunk = len(inputs) if self.args.generation_chunk_prompts is None else self.args.generation_chunk_prompts * G
        nested = getattr(self, "_rollout_nested", False)
        parts = []
        try:
            for i, begin in enumerate(range(0, len(inputs), chunk)):
                self._rollout_nested = nested or i > 0  # the base counts one rollout per stage
                parts.append(self._scored_rollout(inputs[begin : begin + chunk]))
        finally:
            self._rollout_nested = nested
        output = parts[0] if len(parts) == 1 else concat_rollouts(
            parts, self._tokenizer.pad_token_id, fix="leave generation_chunk_prompts=None"
        )
        if self.args.updates_per_stage > 1 and output.get("old_per_token_logps") is None:
            raise GRPOVariantsError(  # guards the TRL behaviour the stage relies on
                "stage rollout: TRL did not return behaviour log-probs (old_per_token_logps) for a stage with "
                "updates_per_stage > 1."
            )
        rows = output["advantages"].shape[0]
        output["policy_version"] = torch.full(
            (rows,), self.state.global_step, dtype=torch.long, device=output["advantages"].device
        )
        if self.args.release_generation_memory:
            self._release_generation_memory()
        generation_s = time.perf_counter() - start
        self._stage_rollout_end = time.perf_counter()
        self._stage_index += 1
        sequences = rows * self.accelerator.num_processes
        record = {
            "stage": self._stage_index,
            "global_step": self.state.global_step,
            "generation_s": generation_s,
            "update_s_previous": update_s,
            "tokens": float(self._tokens_generated_round),
            "sequences": sequences,
            "sequences_per_s": sequences / max(generation_s, 1e-9),
            "chunks": len(parts),
        }
        self.stage_log.append(record)
        metrics, prefix = self._metrics["train"], self.stage_metric_prefix
        metrics[f"{prefix}/stage"].append(float(self._stage_index))
        metrics[f"{prefix}/stage_generation_s"].append(generation_s)
        if update_s is not None:
            metrics[f"{prefix}/stage_update_s"].append(update_s)
        metrics[f"{prefix}/stage_tokens"].append(record["tokens"])
        metrics[f"{prefix}/stage_sequences_per_s"].append(record["sequences_per_s"])
        return output

    def _release_generation_memory(self) -> None:
        """Free what generation held before the stage's updates: colocated vLLM asleep, gc, CUDA cache."""
        engine = getattr(self, "vllm_generation", None) if self.use_vllm else None
        if (
            engine is not None
            and getattr(engine, "mode", None) == "colocate"
            and getattr(engine, "enable_sleep_mode", False)
            and not getattr(engine, "_llm_weights_sleeping", True)
        ):
            engine.llm.sleep(level=2)  # level 2 drops weights and KV cache; TRL re-pushes weights before generating
            engine._llm_weights_sleeping = True
        if torch.cuda.is_available():  # on CPU reference counting already freed the generation tensors; a full
            gc.collect()  # gc pass (~0.2 s in a transformers process) would buy nothing there
            torch.cuda.empty_cache()

    # ---- per-update metric --------------------------------------------------------------------------
    def _log_stage_staleness(self, inputs) -> None:
        """Staleness of a training micro-batch: global step minus the policy version of its rows (the loss calls it)."""
        if self.model.training and "policy_version" in inputs:
            version = inputs["policy_version"].float().mean()
            self._metrics["train"][f"{self.stage_metric_prefix}/staleness"].append(
                float(self.state.global_step) - version.item()
            )

    # ---- resumable state --------------------------------------------------------------------------
    # The base checkpoint already carries TRL's micro-step counter ``_step`` and the buffered stage
    # ``_buffered_inputs`` (on CPU): a mid-stage resume continues the same stage with the same remaining
    # mini-batch order. Only the stage bookkeeping is added here.
    def _stage_state(self) -> dict:
        if not self.stages_enabled:
            return {}
        return {self.stage_metric_prefix: {"stage_index": self._stage_index,
                                           "stage_log": [dict(r) for r in self.stage_log]}}

    def _load_stage_state(self, state: dict) -> None:
        saved = state.get(self.stage_metric_prefix)
        if not saved:
            return
        self._stage_index = int(saved.get("stage_index", 0))
        self.stage_log = [dict(r) for r in saved.get("stage_log", [])]
        self._stage_rollout_end = None  # the interrupted stage's update time is not measurable
