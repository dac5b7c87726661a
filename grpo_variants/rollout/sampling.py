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

**Top-up size** (``dynamic_sampling_topup``). verl generates a whole generation batch per extra round
(``"full"``). ``"pass_rate"`` (the default) sizes every top-up from the running pass rate p (qualifying
/ generated groups, summed with ``dynamic_sampling_pass_rate_decay`` per round) to the d groups still
missing: n = ceil((d + z sqrt(d (1 - p))) / p) with z = ``dynamic_sampling_topup_margin`` standard
deviations of the binomial qualifying count (:func:`topup_groups`), at least
``dynamic_sampling_topup_min_groups``, at most ``dynamic_sampling_topup_max_groups`` (default and upper
bound: one generation batch), rounded up to a multiple of ``processes / gcd(num_generations,
processes)`` so that every process generates the same number of rows. The first round of a batch adds
its predicted top-up (n minus the loader's groups, when positive) to the loader's prompts in the same
generate call, so most batches need one call; a later round (the prediction fell short) is sized with
the lower of the running rate and this batch's. TRL's generation batch is fixed in its loader, so the
top-up's prompts come from the stream: each process draws its local chunk, the chunks are gathered
(``gather_object``; every process sees the same global rows) and the needed rows, appended to the
loader's when merged into the first call, are split evenly over the processes before
``super()``'s rollout; the rest of that chunk's prompts is skipped (never generated). The decayed
counts are part of the checkpoint; ``dynamic_sampling/{topup_groups,running_pass_rate}`` are logged.

**Surplus groups** (qualifying groups of the last round beyond the batch): the paper and verl cut
them. ``dynamic_sampling_surplus="carry"`` (the default) keeps them, in order, and puts them first
in the next optimisation batch, so a round's qualifying groups are all trained and the generation
rounds per optimisation batch approach 1 / pass-rate-amortised instead of ``ceil``-ing every step.
Staleness: a carried group was sampled by the policy of the previous optimisation batch (at most
one rollout older: the carry is always smaller than one batch, the first round's predicted top-up is
bounded so that it stays so even if every group qualifies). It carries its behaviour
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
  two non-NaN values and max > min). With step rewards (:mod:`grpo_variants.process`) and the metric
  ``"reward"`` / ``"task_reward"`` the test reads the token advantages instead: a group is kept when
  some trained token has a non-zero advantage (equal outcomes with different step scores carry signal).
* ``"band"`` (band-pass): a completion is correct when ``v > dynamic_sampling_correct_threshold``; keep
  the group when ``dynamic_sampling_band_low <= mean accuracy <= dynamic_sampling_band_high``.

Tokens generated for dropped groups still count as generated (``useful_token_fraction`` charges them;
the token ledger, :meth:`~grpo_variants.metrics.TrainerMetrics.token_ledger`, counts them as
``dropped_by_filter``, cut surplus as ``surplus_cut`` and the carry as ``carried_pending``).
Variants that rewrite the rollout themselves (iGRPO's two stages, µ-GRPO's stage buffer) do not
compose with it: they refuse ``dynamic_sampling=True`` at construction.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from datasets import IterableDataset
from trl.trainer.utils import RepeatSampler

from grpo_variants.config import DYNAMIC_SAMPLING_FILTERS
from grpo_variants.errors import ConfigError, DynamicSamplingError
from grpo_variants.rollout.batch import LEFT_PADDED, cat_rows, pad_value

__all__ = ["DynamicSamplingInfo", "DynamicSamplingMixin", "select_groups", "topup_groups"]


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


def topup_groups(
    deficit: int,
    pass_rate: float | None,
    *,
    margin: float = 1.0,
    min_groups: int = 1,
    max_groups: int,
    multiple: int = 1,
    already: int = 0,
) -> int:
    """Groups to generate so that about ``deficit`` of them qualify, given the running ``pass_rate`` (pure).

    n = ceil((d + z * sqrt(d * (1 - p))) / p) - ``already`` for d = ``deficit``, p = ``pass_rate``, z =
    ``margin``, where ``already`` groups are generated in the same call anyway (the loader's prompts of a
    batch's first round). The binomial count of qualifying groups among all of them then reaches d about as
    often as a normal variable stays above its mean minus z standard deviations (z = 1: ~84%; z = 0: ceil(d /
    p) in all, about half the time). n <= 0 gives 0; otherwise n is clamped to [``min_groups``,
    ``max_groups``] and rounded up to a multiple of ``multiple`` (every process generates the same number of
    rows), or down where that would pass ``max_groups``. No pass rate yet (or 0): ``max_groups`` when
    ``already`` is 0, else 0 (nothing to predict from). ``deficit <= 0``: 0.
    """
    if deficit <= 0:
        return 0
    if pass_rate is None or pass_rate <= 0.0:
        n = max_groups if already == 0 else 0
    else:
        p = min(float(pass_rate), 1.0)
        n = math.ceil((deficit + margin * math.sqrt(deficit * (1.0 - p))) / p - 1e-9) - already
    if n <= 0:
        return 0
    n = min(max(n, min_groups), max_groups)
    n = -(-n // multiple) * multiple
    if n > max_groups:
        n = max(multiple, max_groups // multiple * multiple)
    return n


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
    round_groups: list[int] = field(default_factory=list)  # groups generated by each round (first: the loader's
    # prompts plus the predicted top-up drawn into the same generate call)
    topup_groups: int = 0  # groups generated beyond the loader's generation batch (stream prompts), all rounds
    pass_rate_estimate: float | None = None  # running pass rate the first round was sized with (None: no history)


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
        self._ds_pass_counts = [0.0, 0.0]  # decayed (qualifying, generated) group counts: the running pass rate
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
            "dynamic_sampling_pass_counts": list(self._ds_pass_counts),
        }

    def _load_dynamic_sampling_state(self, state: dict) -> None:
        self._stream_epoch = int(state.get("dynamic_sampling_stream_epoch", 0))
        self._stream_chunk = int(state.get("dynamic_sampling_stream_chunk", 0))
        self._ds_rounds_total = int(state.get("dynamic_sampling_rounds_total", 0))
        self._ds_carried = state.get("dynamic_sampling_carried")
        self._ds_pass_counts = [float(v) for v in state.get("dynamic_sampling_pass_counts", (0.0, 0.0))]
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

    # ---- the running pass rate and the top-up size -------------------------------------------------
    @property
    def running_pass_rate(self) -> float | None:
        """Qualifying / generated groups, summed with ``dynamic_sampling_pass_rate_decay`` per round (None: none)."""
        qualified, generated = self._ds_pass_counts
        return qualified / generated if generated > 0 else None

    def _update_pass_rate(self, qualified: int, generated: int) -> None:
        decay = self.args.dynamic_sampling_pass_rate_decay
        q, n = self._ds_pass_counts
        self._ds_pass_counts = [decay * q + qualified, decay * n + generated]

    def _topup_multiple(self) -> int:
        """Top-up sizes are multiples of this: ``groups * num_generations`` rows split evenly over the processes."""
        processes = self.accelerator.num_processes
        return processes // math.gcd(self.num_generations, processes)

    def _topup_size(self, deficit: int, already: int = 0, batch_rate: float | None = None) -> int:
        """Groups a top-up for ``deficit`` missing groups generates (:func:`topup_groups` with the config's bounds).

        ``already``: groups the same generate call holds anyway (the first round's loader prompts): the first
        round then adds the top-up predicted for its expected shortfall instead of a second call making it up.
        ``batch_rate``: the pass rate of this batch's rounds so far; a later round is sized with the lower of it
        and the running rate, so that a sudden drop (a running rate built over many rounds moves slowly) does
        not spend the ``max_num_gen_batches`` rounds on top-ups that are too small.
        """
        args = self.args
        per_round = args.generation_batch_size // self.num_generations
        cap = min(args.dynamic_sampling_topup_max_groups or per_round, per_round)  # one stream draw holds per_round
        rate = self.running_pass_rate
        if batch_rate is not None and rate is not None:
            rate = min(rate, batch_rate)
        return topup_groups(deficit, rate, margin=args.dynamic_sampling_topup_margin,
                            min_groups=min(args.dynamic_sampling_topup_min_groups, cap), max_groups=cap,
                            multiple=self._topup_multiple(), already=already)

    def _round_batch(self, loader_rows: list | None, groups: int) -> list:
        """A round's local prompt rows: the loader's (``loader_rows``, or none) then ``groups`` stream groups.

        The rows are laid out globally (rank 0's local rows, then rank 1's, ...) and re-split evenly, so the
        groups stay contiguous even where one straddles two processes; the rest of the drawn stream chunk is
        skipped (never generated: no tokens are spent on it). ``groups == 0``: ``loader_rows`` unchanged.
        """
        if groups == 0:
            return loader_rows
        stream = self._draw_prompts()
        rows_needed = groups * self.num_generations
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return list(loader_rows or []) + list(stream[:rows_needed])
        from accelerate.utils import gather_object

        everything = (list(gather_object(list(loader_rows))) if loader_rows else []) \
            + list(gather_object(list(stream)))[:rows_needed]
        share = len(everything) // accelerator.num_processes
        start = accelerator.process_index * share
        return everything[start : start + share]

    def _global_row_tokens(self, output: dict) -> torch.Tensor:
        """Generated tokens of every row of a round (gathered over processes, CPU)."""
        tokens = output["generated_mask"].sum(dim=1)
        if self.accelerator.num_processes > 1:
            tokens = self.accelerator.gather(tokens.contiguous())
        return tokens.float().cpu()

    @torch.no_grad()
    def _dynamic_sampling_rollout(self, inputs):
        args = self.args
        group = self.num_generations
        local = len(inputs)
        needed = args.generation_batch_size // group
        band = (args.dynamic_sampling_band_low, args.dynamic_sampling_band_high)
        carry = args.dynamic_sampling_surplus == "carry"
        sized = args.dynamic_sampling_topup == "pass_rate"
        parts, group_ids = [], []
        carried_in = 0
        if self._ds_carried is not None:
            parts.append(self._ds_carried)
            carried_in = self._ds_carried["values"].size(0)
            group_ids.extend((-1, g) for g in range(carried_in))
            self._ds_carried = None
        generated = qualified = rounds = 0
        carried_out = None
        estimate = self.running_pass_rate
        per_round = needed  # the loader's generation batch, in groups
        extra = self._topup_size(needed - carried_in, already=per_round) if sized else 0
        # even if every group qualified, the surplus (carried_in + extra) stays below one batch: a carried group is
        # trained by the next optimisation batch, never later
        bound = max(needed - 1 - carried_in, 0)
        if extra > bound:
            multiple = self._topup_multiple()
            extra = bound // multiple * multiple
        batch = self._round_batch(inputs, extra)
        round_groups, topup = [], extra
        ledger = self._token_ledger
        while len(group_ids) < needed:
            rounds += 1
            self._rollout_nested = rounds > 1  # the base counts one rollout per optimisation batch
            try:
                output = self._scored_rollout(batch)
            finally:
                self._rollout_nested = False
            round_local = len(batch)
            values = self._filter_values()
            keep = select_groups(values, group, mode=args.dynamic_sampling_filter, band=band,
                                 correct_threshold=args.dynamic_sampling_correct_threshold)
            if getattr(self, "process_supervision", False) and args.dynamic_sampling_filter == "nonzero_std" \
                    and args.dynamic_sampling_metric in ("reward", "task_reward"):
                # step rewards: a group carries signal when some trained token has a non-zero advantage
                keep = self.token_signal_groups(output).to(keep.device)
            generated += keep.numel()
            qualified += int(keep.sum().item())
            round_groups.append(keep.numel())
            self._update_pass_rate(int(keep.sum().item()), keep.numel())
            passing = keep.nonzero().flatten().cpu()
            room = needed - len(group_ids)
            take, surplus = passing[:room], passing[room:] if carry else passing[:0]
            # token ledger: the dropped groups' tokens, and the qualifying groups cut (surplus "discard")
            row_tokens = self._global_row_tokens(output).view(-1, group).sum(dim=1)
            ledger["dropped_by_filter"] += int(row_tokens[~keep.cpu()].sum().item())
            if not carry:
                ledger["surplus_cut"] += int(row_tokens[passing[room:]].sum().item())
            if take.numel() + surplus.numel() > 0:
                # behaviour log-probs travel with carried groups; a batch mixing carried and fresh groups needs them
                # for every row (TRL computes none on an on-policy step)
                if (surplus.numel() > 0 or carried_in > 0) and output.get("old_per_token_logps") is None:
                    output["old_per_token_logps"] = self._behaviour_logps_for(output)
                rows = (passing[: take.numel() + surplus.numel()].unsqueeze(1) * group + torch.arange(group)).flatten()
                gathered = self._gather_rows(output, rows, round_local)
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
            if sized:
                size = self._topup_size(needed - len(group_ids), batch_rate=qualified / max(generated, 1))
                topup += size
                batch = self._round_batch(None, size)
            else:
                topup += needed
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
        if carry:  # which rows the previous batch generated (the token ledger splits their clipping out)
            full["carried_rows"] = torch.zeros(full["completion_ids"].size(0))
            full["carried_rows"][: carried_in * group] = 1.0
        if self.scale_rewards == "batch" and self.multi_objective_aggregation == "sum_then_normalize" \
                and not args.kl_in_reward:
            # batch-std advantages: the std of the optimisation batch, not of each generation round
            from grpo_variants.losses import batch_std_advantages

            full["advantages"] = batch_std_advantages(rewards_kept, group).to(full["advantages"].dtype)
        self.last_dynamic_sampling = DynamicSamplingInfo(
            rounds=rounds, groups_generated=generated, groups_kept=qualified, groups_needed=needed,
            group_ids=group_ids, values=values_kept, groups_carried_in=carried_in,
            groups_carried_out=0 if carried_out is None else carried_out["values"].size(0),
            round_groups=round_groups, topup_groups=topup, pass_rate_estimate=estimate,
        )
        self._on_dynamic_sampling_batch(full, self.last_dynamic_sampling)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/generation_rounds"].append(float(rounds))
        metrics["dynamic_sampling/groups_generated"].append(float(generated))
        metrics["dynamic_sampling/groups_kept"].append(float(qualified))
        metrics["dynamic_sampling/groups_carried"].append(float(carried_in))
        metrics["dynamic_sampling/topup_groups"].append(float(topup))
        metrics["dynamic_sampling/pass_rate"].append(qualified / max(generated, 1))
        metrics["dynamic_sampling/running_pass_rate"].append(self.running_pass_rate)
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
