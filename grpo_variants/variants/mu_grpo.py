"""µ-GRPO — stage-based off-policy GRPO (Tian, Xie and Wei, "How Off-Policy Can GRPO Be? µ-GRPO for
Efficient LLM Reinforcement Learning", arXiv:2605.17570, May 2026; no public code).

µ = optimizer updates per rollout refresh. Training is a few large *stages* (the paper: 4 stages x
µ = 1,024 updates instead of 1,024 refreshes). A stage (``docs/algorithms.md``, "µ-GRPO"):

1. freeze the policy as the behaviour policy pi_behav;
2. sample G completions for each of ``stage_prompts`` prompts (in ``generation_chunk_prompts``
   chunks sized for memory), and store every response with its group-normalised advantage, its
   token-level behaviour log-probs and the policy version (global step) that produced it;
3. release the rollout engine's memory (gc, CUDA cache, colocated vLLM to sleep);
4. run µ optimizer updates on mini-batches of the stage buffer with r = pi_theta / pi_behav
   taken from the stored log-probs, using

   * relaxed clipping: ratio bounds [mu_clip_lower, mu_clip_upper] = [0, 5] (eps_low = 1,
     eps_high = 4); ``relaxed_clip=False`` keeps ``epsilon`` / ``epsilon_high`` ([0.8, 1.2]);
   * the negative-advantage veto (``veto_scope``, default H_kappa, threshold 1e-4), recomputed at
     every update from the current policy (the base trainer's loss applies it).

Beyond the paper (off by default): ``adaptive_clip_target`` replaces the fixed bounds by a trust region
that follows the measured staleness (:func:`grpo_variants.losses.adaptive_clip_bounds`): at every update
the bounds are chosen from the current policy's token ratios against the stage's behaviour log-probs so
that a target fraction of the negative- (positive-) advantage tokens is low- (high-) clipped, clamped
between PPO's [0.8, 1.2] and µ-GRPO's [0, 5] by default; logged as ``adaptive_clip/low`` and
``adaptive_clip/high``. With several processes each sets its bounds from its own micro-batch.

µ = 1 is exactly on-policy GRPO (ratio 1: no clipping, no veto trigger).

The stage is mapped onto TRL's own buffering, which already generates one batch, splits it into
``steps_per_generation`` micro-batches and reuses them ``num_iterations`` times, computing the
behaviour log-probs (``old_per_token_logps``) whenever generation and optimizer steps are not
aligned. The config derives those fields from the stage, the trainer wraps TRL's rollout (one
``super()`` call per chunk) and adds the stage bookkeeping. Mini-batches of a stage are drawn by
one shuffle of the buffer and visited in that order on every pass (TRL's order).

A checkpoint taken mid-stage resumes mid-stage: the base checkpoint (``grpo_variants.reliability``)
stores TRL's micro-step counter and the buffered stage, so the same buffer is used in the same
remaining mini-batch order; :meth:`MuGRPOTrainer.variant_state_dict` adds the stage counters.

What the mapping does not cost: the behaviour log-probs are recorded while HF generate samples
(``behaviour_logprobs``, :mod:`grpo_variants.rollout_logprobs`; no second forward pass over the
stage in float32), and the training loader fetches and moves a stage's prompt rows once instead of at
every update (``GRPOVariantTrainer.get_train_dataloader``). With vLLM, TRL computes the behaviour
log-probs itself (one forward pass per sequence, as it does for on-policy GRPO with vLLM).

Choices where the paper is silent (``docs/algorithms.md``): veto threshold 1e-4; loss aggregation GRPO's
seq-mean-token-mean; no KL term (beta = 0).
"""

from __future__ import annotations

import gc
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError, DatasetError, GRPOVariantsError
from grpo_variants.losses import adaptive_clip_bounds, relaxed_clip_eps
from grpo_variants.registry import register_variant
from grpo_variants.rollout_batch import concat_rollouts
from grpo_variants.trainer import GRPOVariantTrainer

__all__ = ["MuGRPOConfig", "MuGRPOTrainer"]

logger = logging.getLogger(__name__)

def _nearby_multiples(value: int, unit: int, count: int = 3) -> list[int]:
    """Up to ``count`` positive multiples of ``unit`` closest to ``value``."""
    base = max(unit, (value // unit) * unit)
    candidates = {base, base + unit, max(unit, base - unit), base + 2 * unit}
    return sorted(sorted(candidates, key=lambda x: (abs(x - value), x))[:count])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class MuGRPOConfig(GRPOVariantConfig):
    """µ-GRPO: stage size, updates per stage (µ), relaxed clipping and the negative-advantage veto.

    ``steps_per_generation``, ``generation_batch_size`` and ``num_iterations`` are derived from the
    stage (leave them unset): completions per update = per_device_train_batch_size x
    gradient_accumulation_steps x world_size; mini-batches per pass = stage_prompts x num_generations /
    completions per update; num_iterations = µ / mini-batches per pass; steps_per_generation =
    mini-batches per pass x gradient_accumulation_steps.
    """

    variant: str | None = field(default="mu_grpo")
    loss_type: str = field(default="grpo")
    scale_rewards: str = field(default="group")
    beta: float = field(default=0.0)
    learning_rate: float = field(default=1e-6)
    epsilon: float | None = field(
        default=None,
        metadata={"help": "Lower clip width. With relaxed_clip=True it is derived from mu_clip_lower (leave unset); "
                  "otherwise defaults to 0.2."},
    )
    veto_scope: str | None = field(
        default="H_kappa",
        metadata={"help": "Negative-advantage veto scope: T | S_kappa | H_kappa (paper) | S_seq | None (off)."},
    )
    # ---- stages ---------------------------------------------------------------------------------
    updates_per_stage: int = field(
        default=1024, metadata={"help": "µ: optimizer updates per stage (per rollout refresh). 1 = on-policy GRPO."}
    )
    stage_prompts: int = field(
        default=1024,
        metadata={"help": "Prompts sampled per stage (all processes together); each gets num_generations completions."},
    )
    num_stages: int | None = field(
        default=None, metadata={"help": "If set, max_steps = num_stages x updates_per_stage (the paper: 4)."}
    )
    generation_chunk_prompts: int | None = field(
        default=None,
        metadata={
            "help": "Prompts per generation call on each process (memory bound for HF generate); None = the whole "
            "local stage in one call (recommended with vLLM, whose scheduler batches internally)."
        },
    )
    release_generation_memory: bool = field(
        default=True,
        metadata={"help": "After a stage's rollout: keep colocated vLLM asleep; with CUDA, gc + empty the cache."},
    )
    # ---- relaxed clipping -------------------------------------------------------------------------
    relaxed_clip: bool = field(
        default=True,
        metadata={
            "help": "Clip the ratio to [mu_clip_lower, mu_clip_upper] (paper: [0, 5]); False: epsilon/epsilon_high."
        },
    )
    mu_clip_lower: float = field(default=0.0, metadata={"help": "Relaxed clipping lower ratio bound (0 <= . < 1)."})
    mu_clip_upper: float = field(default=5.0, metadata={"help": "Relaxed clipping upper ratio bound (> 1)."})
    # ---- adaptive trust region (beyond the paper; off by default) -----------------------------------
    adaptive_clip_target: float | None = field(
        default=None,
        metadata={
            "help": "If set (in (0, 0.5)), the clip bounds are re-chosen at every update from the current policy's "
            "ratios so that this fraction of the A<0 tokens is low-clipped and of the A>0 tokens high-clipped "
            "(losses.adaptive_clip_bounds), within the ranges below; None = the fixed bounds."
        },
    )
    adaptive_clip_lower_min: float = field(default=0.0, metadata={"help": "Widest adaptive lower ratio bound."})
    adaptive_clip_lower_max: float = field(default=0.8, metadata={"help": "Tightest adaptive lower ratio bound."})
    adaptive_clip_upper_min: float = field(default=1.2, metadata={"help": "Tightest adaptive upper ratio bound."})
    adaptive_clip_upper_max: float = field(default=5.0, metadata={"help": "Widest adaptive upper ratio bound."})

    def __post_init__(self):
        if isinstance(self.veto_scope, str) and self.veto_scope.strip().lower() in ("none", "null", "off", ""):
            self.veto_scope = None  # command lines spell "no veto" as a string
        self._set_clip_widths()
        # The stage derives these; keep what the user passed to compare after TRL's own derivation.
        requested = {
            "steps_per_generation": self.steps_per_generation,
            "generation_batch_size": self.generation_batch_size,
            "num_iterations": self.num_iterations,
        }
        self.steps_per_generation = None
        self.generation_batch_size = None
        self.num_iterations = 1
        self._check_adaptive_clip()
        super().__post_init__()
        self._size_stage_to_run()
        self._derive_stage(requested)
        if self.adaptive_clip_target is not None:
            if self.resolved_ratio_level != "token":
                raise ConfigError(
                    f"adaptive_clip_target sets token clip bounds from token ratios, but the ratio level is "
                    f"{self.resolved_ratio_level!r} (importance_sampling_level). Use importance_sampling_level='token' "
                    "or adaptive_clip_target=None."
                )
            if self.delta is not None and not self.delta > self.adaptive_clip_upper_max:
                raise ConfigError(
                    f"delta ({self.delta}) must exceed adaptive_clip_upper_max ({self.adaptive_clip_upper_max}), the "
                    "widest upper clip bound the adaptive trust region may choose. Raise delta or lower the maximum."
                )
            logger.warning(
                "µ-GRPO: adaptive_clip_target=%g replaces the fixed clip bounds: lower in [%g, %g], upper in [%g, %g], "
                "re-chosen at every update from the current ratios.",
                self.adaptive_clip_target, self.adaptive_clip_lower_min, self.adaptive_clip_lower_max,
                self.adaptive_clip_upper_min, self.adaptive_clip_upper_max,
            )

    @property
    def adaptive_clip_ranges(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(lower_range, upper_range) for :func:`grpo_variants.losses.adaptive_clip_bounds`."""
        return ((self.adaptive_clip_lower_min, self.adaptive_clip_lower_max),
                (self.adaptive_clip_upper_min, self.adaptive_clip_upper_max))

    def _check_adaptive_clip(self) -> None:
        target = self.adaptive_clip_target
        if target is None:
            return
        if not (isinstance(target, (int, float)) and 0.0 < target < 0.5):
            raise ConfigError(
                f"adaptive_clip_target must be None (off) or a clipped-token fraction in (0, 0.5), e.g. 0.02; "
                f"got {target!r}."
            )
        lo_min, lo_max = self.adaptive_clip_lower_min, self.adaptive_clip_lower_max
        up_min, up_max = self.adaptive_clip_upper_min, self.adaptive_clip_upper_max
        if not 0.0 <= lo_min <= lo_max < 1.0:
            raise ConfigError(
                f"adaptive clip lower range must satisfy 0 <= adaptive_clip_lower_min <= adaptive_clip_lower_max < 1; "
                f"got [{lo_min}, {lo_max}] (e.g. [0, 0.8])."
            )
        if not 1.0 < up_min <= up_max:
            raise ConfigError(
                f"adaptive clip upper range must satisfy 1 < adaptive_clip_upper_min <= adaptive_clip_upper_max; "
                f"got [{up_min}, {up_max}] (e.g. [1.2, 5])."
            )

    def _size_stage_to_run(self) -> None:
        """A run shorter than one default stage (a smoke run, ``max_steps=2``) gets a stage sized to it.

        With the defaults (1024 prompts, µ = 1024) a 2-step run would generate a whole stage (over 8k
        completions) for 2 updates. When both stage fields are at their defaults and ``max_steps`` is
        below µ, µ becomes ``max_steps`` and the stage keeps the default's reuse (updates per pass) as
        far as whole mini-batches allow; a warning says so. Explicit stage fields are never changed.
        """
        default_mu = type(self).__dataclass_fields__["updates_per_stage"].default
        default_prompts = type(self).__dataclass_fields__["stage_prompts"].default
        steps = self.max_steps
        if not (0 < steps < self.updates_per_stage) or self.num_stages is not None:
            return
        if (self.updates_per_stage, self.stage_prompts) != (default_mu, default_prompts):
            return
        G = self.num_generations
        per_update = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        passes = max(1, (default_prompts * G // per_update))  # mini-batches per pass of the default stage
        target = max(1, math.ceil(steps * passes / default_mu))
        for mini_batches in sorted((d for d in _divisors(steps) if d <= target), reverse=True):
            if (mini_batches * per_update) % G == 0:
                break
        else:
            return  # no whole-group stage fits: keep the default and let _derive_stage explain
        self.updates_per_stage = steps
        self.stage_prompts = mini_batches * per_update // G
        logger.warning(
            "µ-GRPO: max_steps=%d is shorter than one default stage (%d prompts, µ=%d); sizing the stage to the run: "
            "stage_prompts=%d, updates_per_stage=%d (set them to override).",
            steps, default_prompts, default_mu, self.stage_prompts, self.updates_per_stage,
        )

    def _set_clip_widths(self) -> None:
        if self.relaxed_clip:
            eps_low, eps_high = relaxed_clip_eps(self.mu_clip_lower, self.mu_clip_upper)
            given = (("epsilon", self.epsilon, eps_low), ("epsilon_high", self.epsilon_high, eps_high))
            for name, value, derived in given:
                if value is not None and not math.isclose(value, derived):
                    raise ConfigError(
                        f"relaxed_clip=True derives {name}={derived} from the ratio bounds [mu_clip_lower, "
                        f"mu_clip_upper] = [{self.mu_clip_lower}, {self.mu_clip_upper}], but {name}={value} was "
                        "given. Set the bounds instead, or relaxed_clip=False to use epsilon/epsilon_high."
                    )
            self.epsilon, self.epsilon_high = eps_low, eps_high
        elif self.epsilon is None:
            self.epsilon = 0.2

    def _derive_stage(self, requested: dict) -> None:
        G = self.num_generations
        if self.updates_per_stage < 1:
            raise ConfigError(f"updates_per_stage (µ) must be >= 1; got {self.updates_per_stage}.")
        if self.stage_prompts < 1:
            raise ConfigError(f"stage_prompts must be >= 1; got {self.stage_prompts}.")
        world = self.world_size
        per_update = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        stage_completions = self.stage_prompts * G
        unit = per_update // math.gcd(per_update, G)  # stage_prompts must be a multiple of this
        if stage_completions < per_update:
            raise ConfigError(
                f"µ-GRPO stage smaller than one mini-batch: stage_prompts ({self.stage_prompts}) x num_generations "
                f"({G}) = {stage_completions} completions, but one update takes per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) x gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) x world_size ({world}) = {per_update}. Use stage_prompts in "
                f"{_nearby_multiples(self.stage_prompts, unit)} or a smaller per_device_train_batch_size."
            )
        if stage_completions % per_update != 0:
            raise ConfigError(
                f"µ-GRPO stage not divisible into mini-batches: stage_prompts ({self.stage_prompts}) x num_generations "
                f"({G}) = {stage_completions} completions is not a multiple of the {per_update} completions per update "
                f"(per_device_train_batch_size x gradient_accumulation_steps x world_size). Use stage_prompts in "
                f"{_nearby_multiples(self.stage_prompts, unit)}."
            )
        mini_batches = stage_completions // per_update
        if self.updates_per_stage % mini_batches != 0:
            raise ConfigError(
                f"updates_per_stage (µ = {self.updates_per_stage}) must be a multiple of the {mini_batches} "
                f"mini-batches per pass over the stage (stage_prompts x num_generations / completions per update), so "
                f"that every stored response is used equally often. Use updates_per_stage in "
                f"{_nearby_multiples(self.updates_per_stage, mini_batches)}, or change stage_prompts."
            )
        derived = {
            "num_iterations": self.updates_per_stage // mini_batches,
            "steps_per_generation": mini_batches * self.gradient_accumulation_steps,
            "generation_batch_size": stage_completions,
        }
        for name, value in requested.items():
            if value is not None and not (name == "num_iterations" and value == 1) and value != derived[name]:
                raise ConfigError(
                    f"µ-GRPO derives {name} from the stage ({name}={derived[name]} for stage_prompts="
                    f"{self.stage_prompts}, updates_per_stage={self.updates_per_stage}); {name}={value} was given. "
                    "Leave it unset and size the stage with stage_prompts / updates_per_stage."
                )
        self.num_iterations = derived["num_iterations"]
        self.steps_per_generation = derived["steps_per_generation"]
        self.generation_batch_size = derived["generation_batch_size"]
        self.mini_batches_per_pass = mini_batches

        if self.num_stages is not None:
            if self.num_stages < 1:
                raise ConfigError(f"num_stages must be >= 1; got {self.num_stages}.")
            total = self.num_stages * self.updates_per_stage
            if self.max_steps > 0 and self.max_steps != total:
                raise ConfigError(
                    f"num_stages ({self.num_stages}) x updates_per_stage ({self.updates_per_stage}) = {total} "
                    f"optimizer steps, but max_steps={self.max_steps}. Set only one of them."
                )
            self.max_steps = total

        local = stage_completions // world if stage_completions % world == 0 else None
        if self.generation_chunk_prompts is not None:
            chunk = self.generation_chunk_prompts * G
            if self.generation_chunk_prompts < 1 or local is None or local % chunk != 0:
                local_prompts = (local or 0) // G
                valid = _divisors(local_prompts) if local is not None and local % G == 0 else []
                raise ConfigError(
                    f"generation_chunk_prompts ({self.generation_chunk_prompts}) must divide the prompts each process "
                    f"generates per stage (stage_prompts / world_size = {self.stage_prompts}/{world}"
                    + ("" if local is None or local % G else f" = {local // G}")
                    + "). "
                    + (f"Valid values: {valid[-6:]}." if valid else "Leave it None (one generation call per stage).")
                )
            chunks = local // chunk
            batch_level = self.scale_rewards == "batch" or self.multi_objective_aggregation == "normalize_then_sum"
            if chunks > 1 and batch_level:
                raise ConfigError(
                    "generation_chunk_prompts splits the stage into several scoring calls, but scale_rewards='batch' "
                    "/ multi_objective_aggregation='normalize_then_sum' normalise over the whole batch. Use "
                    "scale_rewards='group' or leave generation_chunk_prompts=None."
                )
            if chunks > 1 and self.use_vllm and self.vllm_enable_sleep_mode:
                warnings.warn(
                    "generation_chunk_prompts with vLLM sleep mode re-pushes the weights for every chunk (TRL puts "
                    "vLLM to sleep after each generate call); leave generation_chunk_prompts=None with vLLM.",
                    stacklevel=3,
                )

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """The ratio interval [1 - epsilon, 1 + epsilon_high] in force."""
        return 1.0 - self.epsilon, 1.0 + self.epsilon_high


@register_variant(
    "mu_grpo",
    description="µ-GRPO: few large off-policy stages (µ updates each), relaxed clip [0,5], negative-advantage veto",
    paper="arXiv:2605.17570",
)
class MuGRPOTrainer(GRPOVariantTrainer):
    """µ-GRPO; see the module docstring. Wraps TRL's rollout per chunk and keeps the stage bookkeeping."""

    config_class = MuGRPOConfig

    def __init__(self, *args, **kwargs):
        self._stage_index = 0  # stages generated so far
        self._stage_rollout_end: float | None = None
        self.stage_log: list[dict] = []  # one record per stage (timings, tokens, throughput)
        super().__init__(*args, **kwargs)
        try:
            size = len(self.train_dataset)
        except TypeError:  # IterableDataset
            size = None
        if size is not None and size < self.args.stage_prompts:
            raise DatasetError(
                f"train_dataset has {size} prompts, fewer than stage_prompts ({self.args.stage_prompts}): a stage "
                "samples stage_prompts distinct prompts. Lower stage_prompts or use a larger dataset."
            )

    # ---- the stage rollout ------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        start = time.perf_counter()
        update_s = None if self._stage_rollout_end is None else start - self._stage_rollout_end
        G = self.num_generations
        chunk = len(inputs) if self.args.generation_chunk_prompts is None else self.args.generation_chunk_prompts * G
        nested = getattr(self, "_rollout_nested", False)
        parts = []
        try:
            for i, begin in enumerate(range(0, len(inputs), chunk)):
                self._rollout_nested = nested or i > 0  # the base counts one rollout per stage
                parts.append(super()._generate_and_score_completions(inputs[begin : begin + chunk]))
        finally:
            self._rollout_nested = nested
        output = parts[0] if len(parts) == 1 else concat_rollouts(
            parts, self._tokenizer.pad_token_id, fix="leave generation_chunk_prompts=None"
        )
        if self.args.updates_per_stage > 1 and output.get("old_per_token_logps") is None:
            raise GRPOVariantsError(  # guards the TRL behaviour the stage relies on
                "µ-GRPO: TRL did not return behaviour log-probs (old_per_token_logps) for a stage with µ > 1."
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
        metrics = self._metrics["train"]
        metrics["mu_grpo/stage"].append(float(self._stage_index))
        metrics["mu_grpo/stage_generation_s"].append(generation_s)
        if update_s is not None:
            metrics["mu_grpo/stage_update_s"].append(update_s)
        metrics["mu_grpo/stage_tokens"].append(record["tokens"])
        metrics["mu_grpo/stage_sequences_per_s"].append(record["sequences_per_s"])
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

    # ---- adaptive trust region ----------------------------------------------------------------------
    # Per update (per micro-batch), not per stage: at a stage's first update the policy IS the behaviour
    # policy (every ratio is 1), so bounds set once per stage would see no staleness; the ratios drift with
    # every update of the stage, and the current forward pass already has them (no extra forward). The base
    # loss reads ``self.loss_spec`` before its forward pass; the bounds are set on that same spec object right
    # after the forward (in _get_per_token_logps_and_entropies) and restored once the loss is computed.
    def _compute_loss(self, model, inputs):
        if self.args.adaptive_clip_target is None or self.loss_spec is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        spec = self.loss_spec
        saved = (spec.eps_low, spec.eps_high)
        self._adaptive_clip_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._adaptive_clip_inputs = None
            spec.eps_low, spec.eps_high = saved

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        inputs = getattr(self, "_adaptive_clip_inputs", None)
        if inputs is None:
            return out
        self._adaptive_clip_inputs = None  # the loss's own forward pass only
        logps = out[0].detach()
        old = inputs.get("old_per_token_logps")
        ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        lower_range, upper_range = self.args.adaptive_clip_ranges
        bounds = adaptive_clip_bounds(ratio, inputs["advantages"], mask, self.args.adaptive_clip_target,
                                      lower_range, upper_range)
        self.loss_spec.eps_low, self.loss_spec.eps_high = 1.0 - bounds.lower, bounds.upper - 1.0
        metrics = self._metrics["train"]
        metrics["adaptive_clip/low"].append(bounds.lower)
        metrics["adaptive_clip/high"].append(bounds.upper)
        return out

    # ---- per-update metrics -----------------------------------------------------------------------
    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        super()._log_loss_metrics(mode, stats, entropies, mask, inputs)
        if mode != "train" or "policy_version" not in inputs:
            return
        metrics = self._metrics[mode]
        version = inputs["policy_version"].float().mean()
        metrics["mu_grpo/staleness"].append(float(self.state.global_step) - version.item())
        advantages = inputs["advantages"]
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        negative = mask.float() * (adv < 0).float()
        ratio = stats["ratio"].float().expand_as(negative)
        totals = torch.stack([(ratio * negative).sum(), negative.sum()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        if totals[1].item() > 0:
            metrics["mu_grpo/neg_adv_ratio_mean"].append((totals[0] / totals[1]).item())
        if self.loss_spec is not None and self.loss_spec.veto_scope is None and ratio.shape == negative.shape:
            # With the veto off: the share of trained tokens that WOULD be triggers (A < 0, r < veto_threshold).
            would = negative * (ratio < self.args.veto_threshold).float()
            counts = self.accelerator.reduce(torch.stack([would.sum(), mask.float().sum()]), reduction="sum")
            metrics["veto/would_trigger_fraction"].append((counts[0] / counts[1].clamp(min=1.0)).item())

    # ---- resumable state --------------------------------------------------------------------------
    # The base checkpoint (grpo_variants.reliability) already carries TRL's micro-step counter ``_step``
    # and the buffered stage ``_buffered_inputs`` (on CPU): a mid-stage resume continues the same stage
    # with the same remaining mini-batch order. Only the stage bookkeeping is added here.
    def variant_state_dict(self) -> dict:
        state = super().variant_state_dict()
        state["mu_grpo"] = {"stage_index": self._stage_index, "stage_log": [dict(r) for r in self.stage_log]}
        return state

    def load_variant_state_dict(self, state: dict) -> None:
        super().load_variant_state_dict(state)
        mu = state.get("mu_grpo")
        if not mu:
            return
        self._stage_index = int(mu.get("stage_index", 0))
        self.stage_log = [dict(r) for r in mu.get("stage_log", [])]
        self._stage_rollout_end = None  # the interrupted stage's update time is not measurable
