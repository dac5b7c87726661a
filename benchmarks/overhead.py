"""Overhead of GRPOVariantTrainer over stock ``trl.GRPOTrainer``, side by side in one run.

For every variant TRL itself can express (GRPO, BNPO, Dr.GRPO, DAPO without dynamic sampling,
GSPO), both trainers get the *same* config values, model, data, reward and seed; ours composes
the loss from :mod:`grpo_variants.losses` and wraps rewards/rollouts, TRL runs its own code.

Step time: the two trainers run **interleaved in one process**: each trains in its own thread
and they hand over to each other every ``--steps-per-block`` optimizer steps (only one runs at a
time; each trainer's RNG state is saved and restored at every hand-over, so each sees exactly the
random stream it would see alone). The machine's background load therefore hits both alike. A
step's time is measured from one ``on_step_begin`` to the next (generation, reward, log-probs,
backward, optimizer step and logging); each trainer's first step (warm-up) and last step are left
out. Reported: ``step_time_ratio`` = median(ours) / median(TRL), with the spread of the ratios of
adjacent blocks.

Peak memory:
* CUDA: in the same interleaved run, ``torch.cuda.max_memory_allocated`` during each block minus
  the memory allocated when the block starts (so the other trainer's resident weights cancel);
  ratio of the medians.
* CPU: tensors are not visible to ``tracemalloc`` and a process's peak RSS never goes down, so
  each measurement runs in a **fresh subprocess** (ours and TRL alternated, ``--memory-reps``
  times each): peak RSS during ``train()`` (psutil, sampled every millisecond by a thread) minus
  the RSS when training starts. Ratio of the medians. On the toy model these deltas are tens of
  MB, so the ratio is coarse (allocator arenas dominate).

Also reported per variant: model forward passes per step for both trainers (ours must not add
any; where TRL runs a forward pass for the old log-probs, ours records them during generation,
``behaviour_logprobs``), and whether both trainers produced the same mean reward at every step (they should: same
seed, same loss).

    python benchmarks/overhead.py            # full run: 10 blocks x 5 steps per trainer, 3 memory runs (~10 min)
    python benchmarks/overhead.py --quick    # end-to-end check: 2 blocks x 3 steps, 1 memory run (~3 min)

Writes benchmarks/results/overhead.json (one record per variant), overhead.md and overhead.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("GRPO_VARIANTS_CACHE", str(REPO / ".cache" / "grpo_variants"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo_variants.lab import TOY_CONFIG  # noqa: E402  (after the environment above)

# Variant -> config values TRL 1.16 understands, given identically to both trainers.
TRL_SETTINGS: dict[str, dict] = {
    "grpo": dict(loss_type="grpo", scale_rewards="group", beta=0.04),
    "bnpo": dict(loss_type="bnpo", scale_rewards="group", beta=0.0),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none", beta=0.0),
    "dapo": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, mask_truncated_completions=True),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
                 steps_per_generation=2),
}

# The lab's toy recipe (grpo_variants.lab.TOY_CONFIG) with a 64-completion step and a fixed seed.
BASE = {**TOY_CONFIG, "per_device_train_batch_size": 64, "seed": 0}


def config_values(variant: str, output_dir: str, **overrides) -> dict:
    values = dict(BASE)
    values.update(TRL_SETTINGS[variant])
    values.update(overrides)
    values["output_dir"] = output_dir
    return values


def build_trainer(kind: str, variant: str, model_path: str, dataset, output_dir: str, **overrides):
    """``kind`` "ours" -> GRPOVariantTrainer(GRPOVariantConfig(...)); "trl" -> trl.GRPOTrainer(GRPOConfig(...))."""
    from trl import GRPOConfig, GRPOTrainer

    from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, toy

    values = config_values(variant, output_dir, **overrides)
    if kind == "ours":
        trainer = GRPOVariantTrainer(model=model_path, reward_funcs=toy.toy_accuracy, args=GRPOVariantConfig(**values),
                                     train_dataset=dataset)
    elif kind == "trl":
        trainer = GRPOTrainer(model=model_path, reward_funcs=toy.toy_accuracy, args=GRPOConfig(**values),
                              train_dataset=dataset)
    else:
        raise ValueError(kind)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


# ------------------------------------------------------------------------------------------------
# Forward-pass counting (also used by tests/test_lab.py)
# ------------------------------------------------------------------------------------------------
class ForwardCounter:
    """Count forward calls of a trainer's policy (and reference model) by kind.

    ``generate``: forwards inside ``model.generate``; ``grad``: forwards with autograd on (the loss);
    ``scoring``: other policy forwards (old log-probs); ``ref``: reference-model forwards;
    ``generate_calls``: calls of ``model.generate``.
    """

    def __init__(self, trainer):
        import torch  # noqa: F401

        self.counts = {"generate": 0, "grad": 0, "scoring": 0, "ref": 0, "generate_calls": 0}
        self._in_generate = False
        self._handles = []
        model = trainer.model
        original = model.generate

        def generate(*args, **kwargs):
            self.counts["generate_calls"] += 1
            self._in_generate = True
            try:
                return original(*args, **kwargs)
            finally:
                self._in_generate = False

        model.generate = generate
        self._model, self._original = model, original
        self._handles.append(model.register_forward_pre_hook(self._policy_hook))
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            self._handles.append(ref.register_forward_pre_hook(self._ref_hook))

    def _policy_hook(self, module, args):
        import torch

        if self._in_generate:
            self.counts["generate"] += 1
        elif torch.is_grad_enabled():
            self.counts["grad"] += 1
        else:
            self.counts["scoring"] += 1

    def _ref_hook(self, module, args):
        self.counts["ref"] += 1

    def remove(self):
        for h in self._handles:
            h.remove()
        self._model.generate = self._original


# ------------------------------------------------------------------------------------------------
# Interleaved timing
# ------------------------------------------------------------------------------------------------
def _rng_state():
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class _Baton:
    """Strict alternation between named threads."""

    def __init__(self, first: str):
        self.cond = threading.Condition()
        self.holder = first
        self.done: set[str] = set()
        self.error: BaseException | None = None

    def wait_for(self, me: str):
        with self.cond:
            while self.holder != me and self.error is None:
                self.cond.wait(timeout=1.0)
            if self.error is not None:
                raise RuntimeError("the other trainer failed") from self.error

    def pass_to(self, other: str):
        with self.cond:
            if other not in self.done:
                self.holder = other
            self.cond.notify_all()


def _make_block_callback(name, other, baton, block, record):
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    class Block(TrainerCallback):
        def __init__(self):
            self.rng = None
            self.last_begin = None
            self.in_block = 0
            self.block_index = 0
            self.block_start_mem = 0

        def _hand_over(self):
            self.rng = _rng_state()
            baton.pass_to(other)
            baton.wait_for(name)
            _set_rng_state(self.rng)

        def _block_memory_start(self):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.block_start_mem = torch.cuda.memory_allocated()

        def _block_memory_end(self):
            if cuda:
                torch.cuda.synchronize()
                record["peak_mem"].append(torch.cuda.max_memory_allocated() - self.block_start_mem)

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.last_begin is not None:
                record["steps"].append((self.block_index, state.global_step, now - self.last_begin))
            if self.in_block == block:
                self._block_memory_end()
                self._hand_over()
                self.in_block = 0
                self.block_index += 1
            if self.in_block == 0:
                self._block_memory_start()
            self.in_block += 1
            self.last_begin = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                record["rewards"].append(logs["reward"])

        def on_train_end(self, args, state, control, **kwargs):
            self._block_memory_end()

    return Block()


def interleaved(variant: str, model_path: str, dataset, workdir: Path, steps_per_block: int, blocks: int) -> dict:
    """Train ours and TRL's trainer for ``blocks`` x ``steps_per_block`` steps each, alternating blocks."""
    import torch
    from transformers import set_seed

    total = steps_per_block * blocks
    trainers = {}
    counters = {}
    for kind in ("ours", "trl"):
        trainers[kind] = build_trainer(kind, variant, model_path, dataset, str(workdir / kind), max_steps=total)
        counters[kind] = ForwardCounter(trainers[kind])
    set_seed(BASE["seed"])
    start_state = _rng_state()
    baton = _Baton("ours")
    records = {k: {"steps": [], "peak_mem": [], "rewards": []} for k in trainers}
    for kind, other in (("ours", "trl"), ("trl", "ours")):
        trainers[kind].add_callback(_make_block_callback(kind, other, baton, steps_per_block, records[kind]))

    def run(kind, other):
        try:
            baton.wait_for(kind)
            _set_rng_state(start_state)
            trainers[kind].train()
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            with baton.cond:
                baton.error = err
                baton.cond.notify_all()
        finally:
            with baton.cond:
                baton.done.add(kind)
            baton.pass_to(other)

    threads = [threading.Thread(target=run, args=(k, o), name=f"overhead-{k}") for k, o in
               (("ours", "trl"), ("trl", "ours"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if baton.error is not None:
        raise baton.error

    def step_times(kind):
        # drop the first step (warm-up); the last step has no following on_step_begin and is never recorded
        return [dt for (_, step, dt) in records[kind]["steps"] if step > 1]

    ours, trl = step_times("ours"), step_times("trl")
    block_ratios = []
    for b in range(blocks):
        o = [dt for (blk, step, dt) in records["ours"]["steps"] if blk == b and step > 1]
        t = [dt for (blk, step, dt) in records["trl"]["steps"] if blk == b and step > 1]
        if o and t:
            block_ratios.append(statistics.mean(o) / statistics.mean(t))
    params = {k: dict(tr.model.named_parameters()) for k, tr in trainers.items()}
    max_diff = max((params["ours"][n] - params["trl"][n]).abs().max().item() for n in params["ours"])
    result = {
        "variant": variant,
        "trl_settings": TRL_SETTINGS[variant],
        "steps_per_trainer": total,
        "steps_per_block": steps_per_block,
        "blocks": blocks,
        "ours_step_s_median": statistics.median(ours),
        "trl_step_s_median": statistics.median(trl),
        "step_time_ratio": statistics.median(ours) / statistics.median(trl),
        "step_time_ratio_mean": statistics.mean(ours) / statistics.mean(trl),
        "block_ratio_min": min(block_ratios) if block_ratios else None,
        "block_ratio_max": max(block_ratios) if block_ratios else None,
        "forwards_per_step_ours": {k: v / total for k, v in counters["ours"].counts.items()},
        "forwards_per_step_trl": {k: v / total for k, v in counters["trl"].counts.items()},
        "same_rewards_every_step": records["ours"]["rewards"] == records["trl"]["rewards"],
        "max_abs_param_diff_after": max_diff,
    }
    if torch.cuda.is_available():
        mem_o = statistics.median(records["ours"]["peak_mem"])
        mem_t = statistics.median(records["trl"]["peak_mem"])
        result.update(peak_memory_method="cuda max_memory_allocated per block, minus allocated at block start",
                      ours_peak_mem_mb=mem_o / 2**20, trl_peak_mem_mb=mem_t / 2**20,
                      peak_memory_ratio=mem_o / max(mem_t, 1))
    for c in counters.values():
        c.remove()
    del trainers
    gc.collect()
    return result


# ------------------------------------------------------------------------------------------------
# CPU peak memory: one fresh subprocess per measurement
# ------------------------------------------------------------------------------------------------
def memory_worker(kind: str, variant: str, steps: int, threads: int) -> dict:
    import psutil
    import torch
    from transformers import TrainerCallback

    from grpo_variants.tasks import toy

    torch.set_num_threads(threads)
    kit = toy.prepare(task="addition", verbose=False)
    dataset = kit.train_dataset.select(range(2048))
    import tempfile

    workdir = tempfile.mkdtemp(prefix=f"overhead-mem-{kind}-")
    trainer = build_trainer(kind, variant, kit.model_path, dataset, workdir, max_steps=steps)
    proc = psutil.Process()
    state = {"baseline": None, "peak": 0, "stop": False}

    def sample():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.001)

    class Start(TrainerCallback):
        def on_train_begin(self, args, st, control, **kwargs):
            gc.collect()
            state["baseline"] = proc.memory_info().rss
            state["peak"] = state["baseline"]

    trainer.add_callback(Start())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer.train()
    state["stop"] = True
    sampler.join()
    return {"kind": kind, "variant": variant, "peak_rss_delta_mb": (state["peak"] - state["baseline"]) / 2**20,
            "baseline_rss_mb": state["baseline"] / 2**20}


def cpu_memory(variant: str, reps: int, steps: int, threads: int) -> dict:
    deltas = {"ours": [], "trl": []}
    for _ in range(reps):
        for kind in ("ours", "trl"):
            cmd = [sys.executable, __file__, "--_memory-worker", kind, variant, str(steps), str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=str(REPO))
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not line:
                raise RuntimeError(f"memory worker failed ({kind}, {variant}):\n{out.stderr[-3000:]}")
            deltas[kind].append(json.loads(line[-1])["peak_rss_delta_mb"])
    mo, mt = statistics.median(deltas["ours"]), statistics.median(deltas["trl"])
    return {
        "peak_memory_method": "fresh subprocess per run: peak RSS during train() (psutil, 1 ms sampling) minus RSS "
                              "at train start; median over reps",
        "ours_peak_mem_mb": mo,
        "trl_peak_mem_mb": mt,
        "peak_memory_ratio": mo / mt if mt > 0 else None,
        "memory_deltas_mb": deltas,
        "memory_steps": steps,
    }


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def write_report(records: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    lines = [
        "# Overhead of GRPOVariantTrainer vs trl.GRPOTrainer",
        "",
        f"{meta['created']} · {meta['device']} · torch {meta['torch']} · trl {meta['trl']} · "
        f"{'**quick check: pipeline verified, numbers not meaningful**' if meta['quick'] else 'full run'} · {meta['steps_per_block']} steps per block x "
        f"{meta['blocks']} blocks per trainer, interleaved; per-step batch {BASE['per_device_train_batch_size']} "
        f"completions ({BASE['num_generations']} per prompt, up to {BASE['max_completion_length']} tokens), toy policy"
        + (f"; load average {meta['load_average_start']} at start, {meta['load_average_end']} at end."
           if meta.get("load_average_start") is not None else "."),
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        "Ratios are ours / TRL (1.00 = identical; target within 3%). Step time: median over steps (block-ratio "
        "range in brackets). Memory: " + meta["memory_method"] + ".",
        "",
        "| variant | TRL settings | step time ours (s) | step time TRL (s) | step_time_ratio | peak mem ours (MB) | "
        "peak mem TRL (MB) | peak_memory_ratio | no extra forward pass: ours (TRL) per step | same rewards every step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        settings = ", ".join(f"{k}={v}" for k, v in r["trl_settings"].items())
        fo, ft = r["forwards_per_step_ours"], r["forwards_per_step_trl"]
        no_extra = all(fo[k] <= ft[k] for k in ("grad", "scoring", "ref", "generate_calls"))
        spread = f" [{r['block_ratio_min']:.3f}–{r['block_ratio_max']:.3f}]" if r.get("block_ratio_min") else ""
        pm = r.get("peak_memory_ratio")
        mem = (f"{r['ours_peak_mem_mb']:.1f} | {r['trl_peak_mem_mb']:.1f} | {pm:.2f}" if pm is not None
               else "– | – | –")
        lines.append(
            f"| {r['variant']} | {settings} | {r['ours_step_s_median']:.3f} | {r['trl_step_s_median']:.3f} | "
            f"{r['step_time_ratio']:.3f}{spread} | {mem} | "
            f"{'yes' if no_extra else 'NO'}: {fo['grad']:.1f} loss + {fo['scoring']:.1f} ({ft['scoring']:.1f}) old-logp + "
            f"{fo['ref']:.1f} ref | "
            f"{'yes' if r['same_rewards_every_step'] else 'no'} |"
        )
    lines += [
        "",
        "Rerun: `python benchmarks/overhead.py` (full) or `python benchmarks/overhead.py --quick`.",
        "On a shared or busy machine the step-time ratio is noisy even interleaved; the block-ratio range shows "
        "how much. The toy model is the worst case for relative overhead: per-step Python work (metrics, reward "
        "wrapping) is a larger share of a 1M-parameter model's step than of a real model's.",
    ]
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.6))
        names = [r["variant"] for r in records]
        x = range(len(names))
        ax.bar([i - 0.18 for i in x], [r["step_time_ratio"] for r in records], width=0.36, label="step time ratio")
        ax.bar([i + 0.18 for i in x], [r.get("peak_memory_ratio") or 0 for r in records], width=0.36,
               label="peak memory ratio")
        for i, r in enumerate(records):
            if r.get("block_ratio_min"):
                ax.plot([i - 0.18, i - 0.18], [r["block_ratio_min"], r["block_ratio_max"]], color="k", lw=1)
        ax.axhline(1.0, color="gray", lw=1)
        ax.axhspan(0.97, 1.03, color="green", alpha=0.1, label="±3%")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ours / TRL")
        ax.set_title("GRPOVariantTrainer overhead vs trl.GRPOTrainer (interleaved)")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=110)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps per variant: checks the pipeline end to end")
    parser.add_argument("--variants", default=",".join(TRL_SETTINGS))
    parser.add_argument("--steps-per-block", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--memory-reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--_memory-worker", nargs=4, metavar=("KIND", "VARIANT", "STEPS", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._memory_worker:
        kind, variant, steps, threads = args._memory_worker
        print(json.dumps(memory_worker(kind, variant, int(steps), int(threads))), flush=True)
        return 0

    import tempfile

    import torch
    import trl

    from grpo_variants.tasks import toy

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    steps_per_block = args.steps_per_block or (3 if args.quick else 5)
    blocks = args.blocks or (2 if args.quick else 10)
    memory_reps = args.memory_reps or (1 if args.quick else 3)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in TRL_SETTINGS:
            parser.error(f"unknown variant {v!r}; choose from {list(TRL_SETTINGS)}")
    kit = toy.prepare(task="addition", verbose=False)
    dataset = kit.train_dataset.select(range(2048))
    cuda = torch.cuda.is_available()
    meta = {
        "created": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores, {threads} torch threads)",
        "torch": torch.__version__,
        "trl": trl.__version__,
        "quick": args.quick,
        "steps_per_block": steps_per_block,
        "blocks": blocks,
        "memory_method": ("CUDA peak allocated per block, minus allocated at block start" if cuda else
                          f"peak RSS delta during train() in a fresh subprocess (psutil), median of {memory_reps} "
                          "runs per trainer"),
        "config": BASE,
        "load_average_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    records = []
    started = time.perf_counter()
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix=f"overhead-{variant}-") as tmp:
            rec = interleaved(variant, kit.model_path, dataset, Path(tmp), steps_per_block, blocks)
        if not cuda:
            rec.update(cpu_memory(variant, memory_reps, steps=max(3, steps_per_block), threads=threads))
        records.append(rec)
        print(f"[overhead] {variant:>8}: step_time_ratio {rec['step_time_ratio']:.3f} "
              f"(ours {rec['ours_step_s_median']:.3f} s, TRL {rec['trl_step_s_median']:.3f} s), "
              f"peak_memory_ratio {rec.get('peak_memory_ratio') or float('nan'):.2f}, "
              f"same rewards: {rec['same_rewards_every_step']}", flush=True)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["load_average_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    write_report(records, meta, Path(args.out))
    print(f"wrote {Path(args.out) / 'overhead.json'}, overhead.md, overhead.png in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
