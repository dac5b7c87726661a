"""Dynamic sampling (DAPO, arXiv:2503.14476) as one component that every variant composes.

Turned on by ``dynamic_sampling=True`` on any :class:`~grpo_variants.GRPOVariantConfig` (``DAPOConfig``
sets it). The base trainer mixes in :class:`DynamicSamplingMixin`; when the option is on, its rollout
(``_generate_and_score_completions``) becomes a loop over TRL's own rollout (``_scored_rollout``, which
calls ``super()``), never a copy of it:

1. start from the qualifying groups carried over from the previous optimisation batch (below);
2. generate and score one round (the main loader's prompts first, then a second, resumable prompt
   stream); drop every group whose filter values carry no signal (:func:`select_groups`);
3. repeat until the batch holds ``generation_batch_size / num_generations`` groups; past
   ``max_num_gen_batches`` rounds (verl's cap, default 10, 0 = unlimited) a
   :class:`~grpo_variants.errors.DynamicSamplingError` says how many groups qualified.

**Surplus groups** (qualifying groups of the last round beyond the batch): the paper and verl cut
them. ``dynamic_sampling_surplus="carry"`` (the default) keeps them, in order, and puts them first
in the next optimisation batch, so a round's qualifying groups are all trained and the generation
rounds per optimisation batch approach 1 / pass-rate-amortised instead of ``ceil``-ing every step.
Staleness: a carried group was sampled by the policy of the previous optimisation batch (at most
one rollout older, since the carry is always smaller than one batch). It carries its behaviour
log-probs (``old_per_token_logps``; computed for it when the step is otherwise on-policy) and its
group-normalised advantage from its own round, so the importance ratio pi_theta / pi_behav of the
loss corrects for the staleness and the clip bounds it, exactly as for the later mini-batches of a
rollout with several updates. Its reference log-probs (KL) do not depend on the policy.
``"discard"`` restores the paper's cut (the first qualifying groups are kept).

Multi-process: the keep/drop decision is taken on the rewards gathered over all processes, so every
rank takes the same decision and makes the same number of generate calls (lock-step), even when one
group's completions sit on different ranks. Kept rows are gathered from every rank (padded across
processes on the sequence dimension), assembled and re-sliced contiguously, so each rank ends with
exactly its local batch size; ``num_items_in_batch`` is recomputed on the final batch. The carry is
the same on every rank; the stream position and the carried groups are part of the checkpoint
(``variant_state_dict``), so a resumed run continues exactly.

Filters (``dynamic_sampling_filter``) read a per-completion value ``v`` named by
``dynamic_sampling_metric``: ``"task_reward"`` (default: the weighted reward sum without DAPO's
auto-added overlong penalty, the paper's accuracy; equal to ``"reward"`` without it), ``"reward"``
(every reward function, what the advantage sees) or one reward function's name.

* ``"nonzero_std"`` (the paper): keep a group when its scorable values are not all equal (at least
  two non-NaN values and max > min).
* ``"band"`` (band-pass): a completion is correct when ``v > dynamic_sampling_correct_threshold``; keep
  the group when ``dynamic_sampling_band_low <= mean accuracy <= dynamic_sampling_band_high``.

Tokens generated for dropped groups still count as generated (``useful_token_fraction`` charges them).
Variants that rewrite the rollout themselves (iGRPO's two stages, µ-GRPO's stage buffer) do not
compose with it: they refuse ``dynamic_sampling=True`` at construction.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler

from grpo_variants.config import DYNAMIC_SAMPLING_FILTERS
from grpo_variants.errors import ConfigError, DynamicSamplingError
from grpo_variants.rollout_batch import LEFT_PADDED, cat_rows, pad_value

__all__ = ["DynamicSamplingInfo", "DynamicSamplingMixin", "select_groups"]


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
    groups_kept: int  # groups that passed the filter in this rollout's rounds (before the surplus cut / carry)
    groups_needed: int
    group_ids: list[tuple[int, int]]  # (round, group index within the round) of each group in the batch, in order;
    # carried groups have round -1 (generated by the previous rollout)
    values: torch.Tensor  # (groups_needed, num_generations) filter values of the batch's groups
    groups_carried_in: int = 0  # groups of this batch that the previous rollout generated
    groups_carried_out: int = 0  # surplus groups kept for the next batch


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


class DynamicSamplingMixin:
    """Dynamic sampling for :class:`~grpo_variants.GRPOVariantTrainer` (mixed into the base trainer).

    The trainer provides ``_scored_rollout(inputs)`` (one TRL rollout, scored) and
    ``weighted_rewards()``; see the module docstring for what the loop does.
    """

    def _init_dynamic_sampling(self, args, train_dataset) -> None:
        """Construction-time checks and state (called by the base ``__init__`` before TRL's)."""
        self._stream_loader = None
        self._stream_iter = None
        self._stream_epoch = 0
        self._stream_chunk = 0  # chunks (generation rounds) consumed in the current epoch
        self._ds_rounds_total = 0
        self._ds_carried: dict | None = None  # surplus groups of the last rollout (global rows, CPU)
        self.last_dynamic_sampling: DynamicSamplingInfo | None = None
        if not args.dynamic_sampling:
            return
        if isinstance(train_dataset, (IterableDataset, torch.utils.data.IterableDataset)):
            raise ConfigError(
                "dynamic_sampling=True draws extra prompts by index and needs a map-style train_dataset; got an "
                "IterableDataset. Materialise it (datasets.Dataset.from_list(list(ds))) or set dynamic_sampling=False."
            )

    def _check_dynamic_sampling_metric(self) -> None:
        metric = self.args.dynamic_sampling_metric
        if self.args.dynamic_sampling and metric not in ("reward", "task_reward") \
                and metric not in self.reward_func_names:
            raise ConfigError(
                f"dynamic_sampling_metric={metric!r} is neither 'task_reward', 'reward' nor a reward function name "
                f"({self.reward_func_names})."
            )

    # ---- resumable state ----------------------------------------------------------------------
    def _dynamic_sampling_state(self) -> dict:
        return {
            "dynamic_sampling_stream_epoch": self._stream_epoch,
            "dynamic_sampling_stream_chunk": self._stream_chunk,
            "dynamic_sampling_rounds_total": self._ds_rounds_total,
            "dynamic_sampling_carried": self._ds_carried,
        }

    def _load_dynamic_sampling_state(self, state: dict) -> None:
        self._stream_epoch = int(state.get("dynamic_sampling_stream_epoch", 0))
        self._stream_chunk = int(state.get("dynamic_sampling_stream_chunk", 0))
        self._ds_rounds_total = int(state.get("dynamic_sampling_rounds_total", 0))
        self._ds_carried = state.get("dynamic_sampling_carried")
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
                description="Training (dynamic sampling)",
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
    def _filter_values(self) -> torch.Tensor:
        """Per-completion values of the last round the filter reads (gathered over processes)."""
        metric = self.args.dynamic_sampling_metric
        per_func = self._last_rewards_per_func
        auto_penalty = getattr(self.args, "overlong_penalty", False)  # DAPO appends it as the last function
        if metric == "reward" or metric == "task_reward" and not auto_penalty:
            return self.weighted_rewards()
        if metric == "task_reward":
            per_func, weights = per_func[:, :-1], self.reward_weights[:-1].to(per_func.device)
            values = (per_func * weights.unsqueeze(0)).nansum(dim=1)
            values[torch.isnan(per_func).all(dim=1)] = torch.nan
            return values
        return per_func[:, self.reward_func_names.index(metric)]

    def _behaviour_logps_for(self, output: dict) -> torch.Tensor:
        """Behaviour log-probs of a round's local rows under the current (= sampling) policy.

        Only needed for groups carried out of an on-policy step, where TRL computes none. Every
        process calls it in the same round (the carry decision is global), so it is lock-step.
        """
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, ids, attention, output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )
        return logps

    @torch.no_grad()
    def _dynamic_sampling_rollout(self, inputs):
        args = self.args
        group = self.num_generations
        local = len(inputs)
        needed = args.generation_batch_size // group
        band = (args.dynamic_sampling_band_low, args.dynamic_sampling_band_high)
        carry = args.dynamic_sampling_surplus == "carry"
        parts, group_ids = [], []
        carried_in = 0
        if self._ds_carried is not None:
            parts.append(self._ds_carried)
            carried_in = self._ds_carried["values"].size(0)
            group_ids.extend((-1, g) for g in range(carried_in))
            self._ds_carried = None
        generated = qualified = rounds = 0
        carried_out = None
        batch = inputs
        while len(group_ids) < needed:
            rounds += 1
            self._rollout_nested = rounds > 1  # the base counts one rollout per optimisation batch
            try:
                output = self._scored_rollout(batch)
            finally:
                self._rollout_nested = False
            values = self._filter_values()
            keep = select_groups(values, group, mode=args.dynamic_sampling_filter, band=band,
                                 correct_threshold=args.dynamic_sampling_correct_threshold)
            generated += keep.numel()
            qualified += int(keep.sum().item())
            passing = keep.nonzero().flatten().cpu()
            room = needed - len(group_ids)
            take, surplus = passing[:room], passing[room:] if carry else passing[:0]
            if take.numel() + surplus.numel() > 0:
                # behaviour log-probs travel with carried groups; a batch mixing carried and fresh groups needs them
                # for every row (TRL computes none on an on-policy step)
                if (surplus.numel() > 0 or carried_in > 0) and output.get("old_per_token_logps") is None:
                    output["old_per_token_logps"] = self._behaviour_logps_for(output)
                rows = (passing[: take.numel() + surplus.numel()].unsqueeze(1) * group + torch.arange(group)).flatten()
                gathered = self._gather_rows(output, rows, local)
                gathered["values"] = values.detach().float().cpu()[rows].view(-1, group)
                gathered["rewards"] = self.weighted_rewards().detach().float().cpu()[rows]
                cut = lambda key: take.numel() * (1 if key == "values" else group)  # noqa: E731  (values: per group)
                parts.append({k: v[: cut(k)] for k, v in gathered.items()})
                if surplus.numel() > 0:
                    carried_out = {k: v[cut(k) :] for k, v in gathered.items()}
                group_ids.extend((rounds - 1, int(g)) for g in take)
            if len(group_ids) >= needed:
                break
            if args.max_num_gen_batches and rounds >= args.max_num_gen_batches:
                self._ds_rounds_total += rounds
                raise DynamicSamplingError(self._shortfall_message(rounds, generated, qualified, needed))
            batch = self._draw_prompts()
        self._ds_rounds_total += rounds
        self._ds_carried = carried_out
        parts = [p for p in parts if p["values"].size(0) > 0]
        if any("old_per_token_logps" in p for p in parts) and not all("old_per_token_logps" in p for p in parts):
            if carried_in:
                raise DynamicSamplingError("internal: carried and fresh groups disagree on behaviour log-probs")
            # an on-policy batch of fresh groups only: the log-probs computed for the surplus are not needed here
            parts = [{k: v for k, v in p.items() if k != "old_per_token_logps"} for p in parts]
        full = self._assemble(parts)
        values_kept, rewards_kept = full.pop("values"), full.pop("rewards")
        if self.scale_rewards == "batch" and self.multi_objective_aggregation == "sum_then_normalize" \
                and not args.kl_in_reward:
            # batch-std advantages: the std of the optimisation batch, not of each generation round
            from grpo_variants.losses import batch_std_advantages

            full["advantages"] = batch_std_advantages(rewards_kept, group).to(full["advantages"].dtype)
        self.last_dynamic_sampling = DynamicSamplingInfo(
            rounds=rounds, groups_generated=generated, groups_kept=qualified, groups_needed=needed,
            group_ids=group_ids, values=values_kept, groups_carried_in=carried_in,
            groups_carried_out=0 if carried_out is None else carried_out["values"].size(0),
        )
        self._on_dynamic_sampling_batch(full, self.last_dynamic_sampling)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/generation_rounds"].append(float(rounds))
        metrics["dynamic_sampling/groups_generated"].append(float(generated))
        metrics["dynamic_sampling/groups_kept"].append(float(qualified))
        metrics["dynamic_sampling/groups_carried"].append(float(carried_in))
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
            f"Dynamic sampling found only {qualified} qualifying groups of the {needed} this optimisation batch "
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
                    value = accelerator.pad_across_processes(
                        value.contiguous(), dim=1, pad_index=pad_value(key, pad_id), pad_first=key in LEFT_PADDED
                    )
                value = accelerator.gather(value.contiguous())
            out[key] = value[rows.to(value.device)].cpu()
        return out

    def _assemble(self, parts: list[dict]) -> dict:
        """Concatenate the kept rows of every part, each padded to the widest on dim 1 (:func:`cat_rows`)."""
        pad_id = self._tokenizer.pad_token_id
        needed_rows = self.args.generation_batch_size
        full = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            merged = torch.cat(tensors, dim=0) if key == "values" else cat_rows(tensors, key, pad_id)
            rows = needed_rows // self.num_generations if key == "values" else needed_rows
            full[key] = merged[:rows]
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
            if key in LEFT_PADDED:
                value = value[:, prompt_width - keep_prompt :]
            elif value.dim() >= 2 and value.size(1) == completion_width:
                value = value[:, :keep_completion]
            out[key] = value.to(device)
        out["num_items_in_batch"] = num_items.to(device)
        return out
