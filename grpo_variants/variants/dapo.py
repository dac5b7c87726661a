"""DAPO — Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025, arXiv:2503.14476).

What it computes (``docs/algorithms.md``, "DAPO"):

* **Clip-Higher**: eps_low = 0.2, eps_high = 0.28, plus the dual clip of verl's DAPO reference
  recipe (``clip_ratio_c = 10``: for A < 0 the per-token loss is bounded by -c A; None disables it).
* **Token-level loss**: token-mean over the whole optimisation batch (all processes, all
  accumulation micro-steps), TRL's ``loss_type="dapo"``.
* **Dynamic sampling**: over-sample, drop every group whose rewards are all equal (accuracy 0 or 1),
  draw more prompts and generate again until the batch holds ``generation_batch_size /
  num_generations`` groups; surplus qualifying groups are cut (the first ones are kept). Past
  ``max_num_gen_batches`` rounds (verl's cap, default 10, 0 = unlimited) a
  :class:`~grpo_variants.errors.DynamicSamplingError` says how many groups qualified.
* **Overlong reward shaping** (eq. 13), added to the correctness reward: with ``overlong_penalty``
  on, a reward named ``overlong_penalty`` is appended automatically with L_max =
  ``max_completion_length`` and L_cache = ``overlong_buffer_len``.
* **Overlong filtering**: truncated completions get no gradient (``mask_truncated_completions``).
* No KL term (beta = 0); rule reward +1 / -1 (pass e.g. ``math_accuracy_pm1``; the recipe does).

Dynamic sampling wraps TRL's rollout (``super()._generate_and_score_completions``) instead of copying
it. The keep/drop decision is taken on the rewards gathered over all processes, so every rank takes
the same decision and makes the same number of generate calls (lock-step), even when one group's
completions sit on different ranks. Kept rows are gathered from every rank (padded across processes
on the sequence dimension), cut to the required number of groups and re-sliced contiguously, so each
rank ends with exactly its local batch size; ``num_items_in_batch`` is recomputed on the final batch.
Extra prompts come from a second, resumable stream over the training set (TRL's ``RepeatSampler``
semantics, seed ``args.seed + 1``); its position is part of :meth:`DAPOTrainer.variant_state_dict`.
Tokens generated for dropped groups still count as generated (``useful_token_fraction`` charges them).

Filters (``dynamic_sampling_filter``) read a per-completion value ``v`` named by
``dynamic_sampling_metric``:

* ``"task_reward"`` (default): the weighted sum of the reward functions *except* the auto-added
  overlong penalty, i.e. the correctness reward the paper filters on ("accuracy equal to 1 or 0";
  verl's ``filter_groups.metric=acc``). A group whose answers are all wrong but differ in length
  is dropped, as in the paper. Equal to ``"reward"`` when ``overlong_penalty`` is off.
* ``"reward"``: the weighted sum of every reward function, what the advantage sees (a group is
  then kept whenever its advantage is not zero).
* the name of one reward function: that function's values alone.

* ``"nonzero_std"`` (the paper): keep a group when its scorable values are not all equal (at least
  two non-NaN values and max > min). This is exactly "the group's advantage is not zero".
* ``"band"`` (band-pass): the accuracy of a completion is 1 when ``v > dynamic_sampling_correct_threshold``
  (default 0.0: +1/-1 and 1/0 rewards both count +1 / 1 as correct), else 0; a group's mean accuracy
  is correct / scorable completions (NaN values are ignored); keep the group when
  ``dynamic_sampling_band_low <= mean accuracy <= dynamic_sampling_band_high`` (both inclusive).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch
from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError, DynamicSamplingError
from grpo_variants.registry import register_variant
from grpo_variants.trainer import GRPOVariantTrainer, resolve_reward_funcs

__all__ = ["DAPOConfig", "DAPOTrainer", "DynamicSamplingInfo", "select_groups", "OVERLONG_REWARD_NAME"]

OVERLONG_REWARD_NAME = "overlong_penalty"
DYNAMIC_SAMPLING_FILTERS = ("nonzero_std", "band")
# L_cache / L_max in the paper (4,096 / 20,480): the default buffer when overlong_buffer_len is None.
_PAPER_BUFFER_RATIO = 4096 / 20480


@dataclass
class DAPOConfig(GRPOVariantConfig):
    """The DAPO defaults (paper + verl's reference recipe), plus dynamic sampling and overlong shaping."""

    variant: str | None = field(default="dapo")
    loss_type: str = field(default="dapo")  # token-mean over the whole optimisation batch
    scale_rewards: str = field(default="group")
    epsilon: float = field(default=0.2)
    epsilon_high: float | None = field(default=0.28)
    clip_ratio_c: float | None = field(
        default=10.0,
        metadata={"help": "Dual-clip bound c of verl's DAPO recipe: for A<0 the loss is at most -c*A. None: off."},
    )
    beta: float = field(default=0.0)
    mask_truncated_completions: bool = field(default=True)  # overlong filtering
    learning_rate: float = field(default=1e-6)
    # ---- dynamic sampling --------------------------------------------------------------------
    dynamic_sampling: bool = field(
        default=True,
        metadata={"help": "Drop groups that carry no signal and re-sample until the batch is full (DAPO)."},
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
        metadata={"help": "Per-completion value the filter reads: 'task_reward' (weighted sum without the "
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
    # ---- overlong reward shaping (eq. 13) ---------------------------------------------------
    overlong_penalty: bool = field(
        default=True,
        metadata={"help": "Append DAPO's soft overlong punishment (reward 'overlong_penalty', L_max = "
                  "max_completion_length)."},
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata={"help": "L_cache, the soft buffer in tokens. None: 20%% of max_completion_length (the paper's "
                  "4,096 of 20,480)."},
    )

    def _validate_variant_fields(self) -> None:
        super()._validate_variant_fields()
        if self.dynamic_sampling_filter not in DYNAMIC_SAMPLING_FILTERS:
            raise ConfigError(
                f"dynamic_sampling_filter={self.dynamic_sampling_filter!r} is not valid; choose one of "
                f"{list(DYNAMIC_SAMPLING_FILTERS)}."
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
        if self.overlong_penalty:
            if self.max_completion_length is None:
                raise ConfigError("overlong_penalty=True needs max_completion_length (it is L_max of eq. 13).")
            buffer = self.resolved_overlong_buffer_len
            if not 0 < buffer <= self.max_completion_length:
                raise ConfigError(
                    f"overlong_buffer_len ({buffer}) must lie in [1, max_completion_length="
                    f"{self.max_completion_length}]; the paper uses 4,096 with max_completion_length 20,480."
                )

    @property
    def resolved_overlong_buffer_len(self) -> int:
        """L_cache in force: ``overlong_buffer_len`` or 20%% of ``max_completion_length`` (at least 1)."""
        if self.overlong_buffer_len is not None:
            return int(self.overlong_buffer_len)
        return max(1, round(_PAPER_BUFFER_RATIO * self.max_completion_length))


# ------------------------------------------------------------------------------------------------
# The group filter (pure)
# ------------------------------------------------------------------------------------------------
def select_groups(
    values: torch.Tensor,
    group_size: int,
    *,
    mode: str = "nonzero_std",
    band: tuple[float, float] = (0.0, 1.0),
    correct_threshold: float = 0.0,
) -> torch.Tensor:
    """Which groups qualify for training: a bool tensor with one entry per group.

    ``values`` is flat (num_groups * group_size,), consecutive groups, NaN for unscorable
    completions. ``mode="nonzero_std"``: at least two scorable values and not all equal.
    ``mode="band"``: mean accuracy (share of scorable completions with value > ``correct_threshold``)
    within ``band`` (inclusive); a group with no scorable value never qualifies.
    """
    if values.dim() != 1 or values.numel() % group_size != 0:
        raise ValueError(f"values must be flat with a multiple of group_size={group_size} entries, got {values.shape}")
    grouped = values.detach().float().view(-1, group_size)
    scorable = ~torch.isnan(grouped)
    count = scorable.sum(dim=1)
    if mode == "nonzero_std":
        high = torch.where(scorable, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)
        low = torch.where(scorable, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)
        return (count >= 2) & (high > low)
    if mode == "band":
        correct = (scorable & (grouped > correct_threshold)).sum(dim=1)
        accuracy = correct.float() / count.clamp(min=1).float()
        lo, hi = band
        return (count > 0) & (accuracy >= lo - 1e-9) & (accuracy <= hi + 1e-9)
    raise ValueError(f"unknown dynamic sampling filter {mode!r}; choose one of {list(DYNAMIC_SAMPLING_FILTERS)}")


@dataclass
class DynamicSamplingInfo:
    """What the last training rollout's dynamic sampling did (identical on every process)."""

    rounds: int
    groups_generated: int
    groups_kept: int  # groups that passed the filter (before the surplus cut)
    groups_needed: int
    group_ids: list[tuple[int, int]]  # (round, group index within the round) of each group in the batch, in order
    values: torch.Tensor  # (groups_needed, num_generations) filter values of the batch's groups


class _PromptStream(RepeatSampler):
    """TRL's ``RepeatSampler`` (``repeat_count=1``) that is resumable in O(1).

    Epoch ``e`` is a permutation seeded by ``(seed, e)`` instead of a generator advanced across
    epochs, and ``skip_chunks`` starts an epoch part-way, so a position (epoch, chunk) restores the
    stream exactly without replaying it.
    """

    def __init__(self, data_source, mini_repeat_count: int, batch_size: int, shuffle: bool, seed: int):
        super().__init__(data_source, mini_repeat_count, batch_size=batch_size, repeat_count=1, shuffle=shuffle,
                         seed=seed)
        self.stream_seed = int(seed)
        self.epoch = 0
        self.skip_chunks = 0

    def set_epoch(self, epoch: int) -> None:  # called by accelerate's DataLoaderShard at each iter()
        self.epoch = int(epoch)

    def __iter__(self):
        if self.shuffle:
            self.generator.manual_seed((self.stream_seed * 1_000_003 + self.epoch) % (2**63 - 1))
        skip, self.skip_chunks = self.skip_chunks * self.batch_size * self.mini_repeat_count, 0
        return itertools.islice(super().__iter__(), skip, None)


# Rollout fields and how they are padded on the sequence dimension when rows are gathered.
_LEFT_PADDED = ("prompt_ids", "prompt_mask")


@register_variant(
    "dapo",
    description="DAPO: clip-higher 0.2/0.28, dual-clip 10, token-mean, dynamic sampling, overlong shaping/filtering",
    paper="arXiv:2503.14476",
)
class DAPOTrainer(GRPOVariantTrainer):
    """DAPO; see the module docstring. Overrides the rollout only (dynamic sampling)."""

    config_class = DAPOConfig

    def __init__(self, model, reward_funcs=None, args: DAPOConfig | None = None, train_dataset=None, *posargs,
                 **kwargs):
        args = self._coerce_args(args, model)
        reward_funcs, args = self._with_overlong_penalty(reward_funcs, args)
        if args.dynamic_sampling and isinstance(train_dataset, (IterableDataset, torch.utils.data.IterableDataset)):
            raise ConfigError(
                "dynamic_sampling=True draws extra prompts by index and needs a map-style train_dataset; got an "
                "IterableDataset. Materialise it (datasets.Dataset.from_list(list(ds))) or set dynamic_sampling=False."
            )
        self._stream_loader = None
        self._stream_iter = None
        self._stream_epoch = 0
        self._stream_chunk = 0  # chunks (generation rounds) consumed in the current epoch
        self._ds_rounds_total = 0
        self.last_dynamic_sampling: DynamicSamplingInfo | None = None
        super().__init__(model, reward_funcs, args, train_dataset, *posargs, **kwargs)
        metric = self.args.dynamic_sampling_metric
        if metric not in ("reward", "task_reward") and metric not in self.reward_func_names:
            raise ConfigError(
                f"dynamic_sampling_metric={metric!r} is neither 'task_reward', 'reward' nor a reward function name "
                f"({self.reward_func_names})."
            )

    # ---- overlong reward shaping -------------------------------------------------------------
    @staticmethod
    def _with_overlong_penalty(reward_funcs, args):
        """Append eq. 13's penalty (L_max = max_completion_length) to the rewards when configured."""
        if not args.overlong_penalty:
            return reward_funcs, args
        from grpo_variants.rewards.builtin import OverlongPenalty, make_overlong_penalty

        funcs = resolve_reward_funcs(reward_funcs)
        if any(isinstance(getattr(f, "__wrapped__", f), OverlongPenalty) for f in funcs):
            raise ConfigError(
                "An overlong-penalty reward is already among reward_funcs and overlong_penalty=True would add it "
                "a second time: remove it from reward_funcs or set overlong_penalty=False."
            )
        if args.reward_weights is not None:
            if len(args.reward_weights) != len(funcs):
                raise ConfigError(
                    f"reward_weights has {len(args.reward_weights)} values but there are {len(funcs)} reward "
                    f"functions: give one weight per function (the overlong penalty, weight 1.0, is appended "
                    "automatically)."
                )
            args = copy.copy(args)  # do not mutate the caller's config
            args.reward_weights = [*args.reward_weights, 1.0]
        penalty = make_overlong_penalty(
            args.max_completion_length, args.resolved_overlong_buffer_len, name=OVERLONG_REWARD_NAME
        )
        return [*funcs, penalty], args

    # ---- resumable state ----------------------------------------------------------------------
    def variant_state_dict(self) -> dict:
        state = super().variant_state_dict()
        state.update(
            dapo_stream_epoch=self._stream_epoch,
            dapo_stream_chunk=self._stream_chunk,
            dapo_generation_rounds_total=self._ds_rounds_total,
        )
        return state

    def load_variant_state_dict(self, state: dict) -> None:
        super().load_variant_state_dict(state)
        self._stream_epoch = int(state.get("dapo_stream_epoch", 0))
        self._stream_chunk = int(state.get("dapo_stream_chunk", 0))
        self._ds_rounds_total = int(state.get("dapo_generation_rounds_total", 0))
        self._stream_iter = None  # re-opened at the restored position on the next draw

    # ---- the extra-prompt stream ----------------------------------------------------------------
    def _draw_prompts(self) -> list[dict]:
        """The next local generation batch of the extra-prompt stream (same layout as the main loader's).

        Runs under ``fork_rng``: opening a DataLoader iterator draws from the global torch RNG, which
        would make a resumed run (which re-opens the stream at another moment) sample differently.
        """
        with torch.random.fork_rng(devices=[]):
            return self._next_stream_batch()

    def _next_stream_batch(self) -> list[dict]:
        groups_per_round = self.args.generation_batch_size // self.num_generations
        if self._stream_loader is None:
            if len(self.train_dataset) < groups_per_round:
                raise DynamicSamplingError(
                    f"train_dataset has {len(self.train_dataset)} prompts, fewer than the {groups_per_round} one "
                    "generation round needs: dynamic sampling cannot draw more. Use more prompts or a smaller "
                    "generation_batch_size."
                )
            sampler = _PromptStream(
                self.train_dataset, self.num_generations, groups_per_round, self.shuffle_dataset, self.args.seed + 1
            )
            self._stream_loader = self._get_dataloader(
                dataset=self.train_dataset,
                description="Training (DAPO dynamic sampling)",
                batch_size=self._train_batch_size * self.args.steps_per_generation,
                sampler_fn=lambda _dataset: sampler,
                is_training=True,
            )
            self._stream_sampler = sampler
        for _ in range(2):
            if self._stream_iter is None:
                self._stream_sampler.skip_chunks = self._stream_chunk
                self._stream_loader.set_epoch(self._stream_epoch)
                self._stream_iter = iter(self._stream_loader)
            try:
                batch = next(self._stream_iter)
            except StopIteration:  # epoch exhausted: the next one is a fresh permutation
                self._stream_epoch += 1
                self._stream_chunk = 0
                self._stream_iter = None
                continue
            self._stream_chunk += 1
            return batch
        raise DynamicSamplingError("the dynamic sampling prompt stream yielded nothing for a whole epoch.")

    # ---- the rollout ------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self.args.dynamic_sampling):
            return super()._generate_and_score_completions(inputs)
        return self._dynamic_sampling_rollout(inputs)

    def _filter_values(self) -> torch.Tensor:
        """Per-completion values of the last round the filter reads (gathered over processes)."""
        metric = self.args.dynamic_sampling_metric
        per_func = self._last_rewards_per_func
        if metric == "reward" or metric == "task_reward" and not self.args.overlong_penalty:
            return self.weighted_rewards()
        if metric == "task_reward":  # the overlong penalty is the last reward function (appended in __init__)
            per_func, weights = per_func[:, :-1], self.reward_weights[:-1].to(per_func.device)
            values = (per_func * weights.unsqueeze(0)).nansum(dim=1)
            values[torch.isnan(per_func).all(dim=1)] = torch.nan
            return values
        return per_func[:, self.reward_func_names.index(metric)]

    @torch.no_grad()
    def _dynamic_sampling_rollout(self, inputs):
        args = self.args
        group = self.num_generations
        local = len(inputs)
        needed = args.generation_batch_size // group
        band = (args.dynamic_sampling_band_low, args.dynamic_sampling_band_high)
        parts, values_kept, rewards_kept, group_ids = [], [], [], []
        generated = qualified = rounds = 0
        batch = inputs
        while True:
            rounds += 1
            self._rollout_nested = rounds > 1  # the base counts one rollout per optimisation batch
            try:
                output = super()._generate_and_score_completions(batch)
            finally:
                self._rollout_nested = False
            values = self._filter_values()
            keep = select_groups(values, group, mode=args.dynamic_sampling_filter, band=band,
                                 correct_threshold=args.dynamic_sampling_correct_threshold)
            generated += keep.numel()
            qualified += int(keep.sum().item())
            take = keep.nonzero().flatten()[: needed - len(group_ids)].cpu()  # surplus: keep the first ones
            if take.numel() > 0:
                rows = (take.unsqueeze(1) * group + torch.arange(group)).flatten()
                parts.append(self._gather_rows(output, rows, local))
                values_kept.append(values.detach().float().cpu()[rows].view(-1, group))
                rewards_kept.append(self.weighted_rewards().detach().float().cpu()[rows])
                group_ids.extend((rounds - 1, int(g)) for g in take)
            if len(group_ids) >= needed:
                break
            if args.max_num_gen_batches and rounds >= args.max_num_gen_batches:
                self._ds_rounds_total += rounds
                raise DynamicSamplingError(self._shortfall_message(rounds, generated, qualified, needed))
            batch = self._draw_prompts()
        self._ds_rounds_total += rounds
        full = self._assemble(parts)
        if self.scale_rewards == "batch" and self.multi_objective_aggregation == "sum_then_normalize" \
                and not args.kl_in_reward:
            # batch-std advantages: the std of the optimisation batch, not of each generation round
            from grpo_variants.losses import batch_std_advantages

            full["advantages"] = batch_std_advantages(torch.cat(rewards_kept), group).to(full["advantages"].dtype)
        self.last_dynamic_sampling = DynamicSamplingInfo(
            rounds=rounds, groups_generated=generated, groups_kept=qualified, groups_needed=needed,
            group_ids=group_ids, values=torch.cat(values_kept),
        )
        self._on_dynamic_sampling_batch(full, self.last_dynamic_sampling)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/generation_rounds"].append(float(rounds))
        metrics["dynamic_sampling/groups_generated"].append(float(generated))
        metrics["dynamic_sampling/groups_kept"].append(float(qualified))
        metrics["dynamic_sampling/pass_rate"].append(qualified / max(generated, 1))
        return self._local_slice(full, local)

    def _on_dynamic_sampling_batch(self, batch: dict, info: DynamicSamplingInfo) -> None:
        """Hook: the assembled global batch (CPU, identical on every process) before it is re-sliced."""

    def _shortfall_message(self, rounds: int, generated: int, qualified: int, needed: int) -> str:
        args = self.args
        what = (
            "the other groups had identical values (accuracy 0 or 1 on every completion)"
            if args.dynamic_sampling_filter == "nonzero_std"
            else f"the other groups' mean accuracy was outside [{args.dynamic_sampling_band_low}, "
                 f"{args.dynamic_sampling_band_high}]"
        )
        return (
            f"DAPO dynamic sampling found only {qualified} qualifying groups of the {needed} this optimisation batch "
            f"needs after max_num_gen_batches={args.max_num_gen_batches} generation rounds ({rounds} rounds, "
            f"{generated} groups generated, pass rate {qualified / max(generated, 1):.1%}; filter "
            f"{args.dynamic_sampling_filter!r} on {args.dynamic_sampling_metric!r}): {what}. Fixes: raise "
            "max_num_gen_batches (0 = no cap); train on prompts the policy solves sometimes but not always "
            "(easier data if every answer is wrong, harder if every answer is right); use the band-pass filter "
            "(dynamic_sampling_filter='band' with dynamic_sampling_band_low/high) or another "
            "dynamic_sampling_metric; or set dynamic_sampling=False."
        )

    def _gather_rows(self, output: dict, rows: torch.Tensor, local: int) -> dict:
        """Rows ``rows`` (global indices) of a round's output, gathered from every process, on CPU."""
        accelerator = self.accelerator
        pad_id = self._tokenizer.pad_token_id
        out = {}
        for key, value in output.items():
            if key == "num_items_in_batch" or value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != local:
                raise DynamicSamplingError(
                    f"dynamic sampling cannot re-batch the rollout field {key!r} (not a per-row tensor); it supports "
                    "text rollouts (no images). Set dynamic_sampling=False for this dataset."
                )
            if accelerator.num_processes > 1:
                if value.dim() >= 2:
                    pad_index = pad_id if key in ("prompt_ids", "completion_ids") else 1 if key == "tool_mask" else 0
                    value = accelerator.pad_across_processes(
                        value.contiguous(), dim=1, pad_index=pad_index, pad_first=key in _LEFT_PADDED
                    )
                value = accelerator.gather(value.contiguous())
            out[key] = value[rows.to(value.device)].cpu()
        return out

    def _assemble(self, parts: list[dict]) -> dict:
        """Concatenate the kept rows of every round (padding each round to the widest on dim 1)."""
        pad_id = self._tokenizer.pad_token_id
        needed_rows = self.args.generation_batch_size
        full = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            if tensors[0].dim() >= 2:
                width = max(t.size(1) for t in tensors)
                pad_value = pad_id if key in ("prompt_ids", "completion_ids") else 1 if key == "tool_mask" else 0
                padded = []
                for t in tensors:
                    extra = width - t.size(1)
                    if extra:
                        filler = t.new_full((t.size(0), extra, *t.shape[2:]), pad_value)
                        t = torch.cat([filler, t] if key in _LEFT_PADDED else [t, filler], dim=1)
                    padded.append(t)
                tensors = padded
            full[key] = torch.cat(tensors, dim=0)[:needed_rows]
        return full

    def _local_slice(self, full: dict, local: int) -> dict:
        """This process's contiguous share of the final batch, trimmed of all-padding columns, on device."""
        device = self.accelerator.device
        loss_mask = full["completion_mask"] if "tool_mask" not in full else full["completion_mask"] * full["tool_mask"]
        num_items = loss_mask.sum()  # global: every process holds the whole final batch
        start = self.accelerator.process_index * local
        out = {key: value[start : start + local] for key, value in full.items()}
        # trim columns that are padding in every local row (left for prompts, right for completions)
        multiple = self.pad_to_multiple_of or 1
        prompt_width = out["prompt_mask"].size(1)
        used = out["prompt_mask"].any(dim=0).nonzero()
        keep_prompt = prompt_width - int(used[0]) if used.numel() else 1
        keep_prompt = min(prompt_width, -(-keep_prompt // multiple) * multiple)
        completion_width = out["completion_ids"].size(1)
        marker = out.get("generated_mask", out["completion_mask"])
        used = marker.any(dim=0).nonzero()
        keep_completion = int(used[-1]) + 1 if used.numel() else 1
        keep_completion = min(completion_width, -(-keep_completion // multiple) * multiple)
        for key, value in out.items():
            if key in _LEFT_PADDED:
                value = value[:, prompt_width - keep_prompt :]
            elif value.dim() >= 2 and value.size(1) == completion_width:
                value = value[:, :keep_completion]
            out[key] = value.to(device)
        out["num_items_in_batch"] = num_items.to(device)
        return out
