"""Padding-free packed training (``padding_free=True``) vs TRL's padded forward: training-phase time and peak memory.

Per task, one real rollout is generated once (HF generate, the task's reward) and then the *training phase*
of that rollout is timed for both arms on exactly the same tensors, interleaved (ABBA order), ``--repeats``
times:

* the reference model's log-probs (no grad, beta > 0) and the recomputed old log-probs (no grad), TRL's
  ``_get_per_token_logps_and_entropies`` over the whole generation batch in chunks of the micro-batch size;
* the policy loss forward + backward of every micro-batch (``_compute_loss`` + ``backward``).

Padding changes nothing else (generation, rewards and the optimizer step are identical by construction), so the
end-to-end step speed-up is ``(rest + padded phase) / (rest + packed phase)``, ``rest`` = the rollout's measured
seconds outside log-prob forwards (generation, decoding, rewards, advantages) + one measured AdamW step;
reported per repeat, with its range.

Peak memory: a fresh subprocess per arm (and per ``--memory-repeats``) loads the model and the saved rollout,
resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``), runs the training phase once
and reports that high-water mark (``VmHWM``) above the resident set before the phase (on CUDA
``torch.cuda.max_memory_allocated`` instead). Tasks:

* ``chain``: the toy chain task (``grpo_variants.tasks.toy_reasoning``, warm-started toy policy, completions of
  3 to ~56 tokens);
* ``smollm2``: SmolLM2-135M-Instruct on ``word_problems`` with ``math_accuracy``, completion budget 160 tokens,
  temperature 1.0 (what the model writes: short boxed answers next to long explanations).

    python benchmarks/padding_free.py                      # both tasks (about 30 min on a shared 2-core CPU)
    python benchmarks/padding_free.py --quick              # pipeline check (chain task, 2 repeats, temp folder)

Writes benchmarks/results/padding_free.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bench  # noqa: E402,F401  (sets the offline environment first)

import torch  # noqa: E402

from grpo_variants import get_variant  # noqa: E402

TASKS = {
    # prompts x group = generation batch; micro-batch = per_device_train_batch_size
    "chain": dict(prompts=8, group=8, micro_batch=16, max_completion_length=56, label="toy chain task (1M-param toy)"),
    "smollm2": dict(prompts=4, group=4, micro_batch=8, max_completion_length=160,
                    label="SmolLM2-135M-Instruct word problems"),
}


def _task_inputs(task: str):
    """(model path, dataset, reward name) of a task."""
    if task == "chain":
        from grpo_variants.tasks import toy_reasoning

        kit = toy_reasoning.prepare(verbose=False)
        return kit.model_path, kit.train_dataset, "toy_chain_accuracy"
    from grpo_variants import word_problems
    from grpo_variants.tasks.models import smollm2

    return str(smollm2()), word_problems.make_dataset("train", 200, seed=0), "math_accuracy"


def build_trainer(task: str, output_dir: str, padding_free: bool = False):
    spec = TASKS[task]
    model, dataset, reward = _task_inputs(task)
    n = spec["prompts"] * spec["group"]
    grpo = get_variant("grpo")
    args = grpo.config_cls(
        output_dir=output_dir, per_device_train_batch_size=spec["micro_batch"], num_generations=spec["group"],
        steps_per_generation=n // spec["micro_batch"], max_completion_length=spec["max_completion_length"],
        temperature=1.0, beta=0.04, learning_rate=1e-5, max_steps=1, report_to="none", bf16=False,
        gradient_checkpointing=False, save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1,
        behaviour_logprobs="recompute", padding_free=padding_free,
    )
    trainer = grpo.trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer, dataset


def rollout(trainer, dataset, task: str) -> tuple[dict, float]:
    """One real rollout of the task's generation batch: (tensors, its seconds outside log-prob forward passes:
    generation, decoding, rewards, advantages; the reference forward it runs is part of the training phase)."""
    spec = TASKS[task]
    rows = [dataset[i] for i in range(spec["prompts"]) for _ in range(spec["group"])]
    torch.manual_seed(0)
    logprob_seconds = trainer._phase_time["logprobs"]
    start = time.perf_counter()
    out = trainer._generate_and_score_completions(rows)
    seconds = time.perf_counter() - start - (trainer._phase_time["logprobs"] - logprob_seconds)
    keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch")
    return {k: out[k].detach().cpu() for k in keep}, seconds


def train_phase(trainer, batch: dict, padding_free: bool) -> None:
    """Reference + old log-probs (no grad) over the batch, then loss forward + backward per micro-batch."""
    trainer.args.padding_free = padding_free
    device = trainer.accelerator.device
    batch = {k: v.to(device) for k, v in batch.items()}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    K, micro = batch["completion_ids"].size(1), trainer.args.per_device_train_batch_size
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, K, batch_size=micro)
        old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, K, batch_size=micro)
    trainer.model.zero_grad(set_to_none=True)
    for start in range(0, ids.size(0), micro):
        rows = slice(start, start + micro)
        inputs = {k: v[rows] for k, v in batch.items() if k != "num_items_in_batch"}
        inputs.update(old_per_token_logps=old[rows], ref_per_token_logps=ref[rows],
                      num_items_in_batch=batch["num_items_in_batch"])
        trainer._compute_loss(trainer.model, inputs).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def optimizer_step_seconds(trainer) -> float:
    """Seconds of one AdamW step over the trainable parameters (with gradients set), parameters restored after."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    optimizer.step()  # first step allocates the moments
    start = time.perf_counter()
    optimizer.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
            p.grad = None
    return seconds


def _status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (resident high-water mark) of this process, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_arm(task: str, batch_file: str, padding_free: bool) -> dict:
    """In a fresh process: peak memory of one training phase above the loaded-model baseline.

    The kernel's RSS high-water mark is reset (``/proc/self/clear_refs`` = 5) once the model and the batch are
    loaded, so the peak is the training phase's own, not the loading's.
    """
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = build_trainer(task, tmp)
        batch = torch.load(batch_file)
        cuda = trainer.accelerator.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base_rss = _status_mb("VmRSS")
        train_phase(trainer, batch, padding_free)
        peak_rss = _status_mb("VmHWM")
        out = {"baseline_rss_mb": base_rss, "peak_rss_mb": peak_rss, "peak_above_baseline_mb": peak_rss - base_rss}
        if cuda:
            out.update(cuda_peak_above_baseline_mb=torch.cuda.max_memory_allocated() / 2**20 - base)
    return out


def _range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": [round(v, 4) for v in values]}


def run_task(task: str, opts, workdir: Path) -> dict:
    trainer, dataset = build_trainer(task, str(workdir / task))
    batch, rollout_seconds = rollout(trainer, dataset, task)
    batch_file = workdir / f"{task}_batch.pt"
    torch.save(batch, batch_file)
    lengths = batch["completion_mask"].sum(1)
    prompt_lengths = batch["prompt_mask"].sum(1)
    real = int(lengths.sum() + prompt_lengths.sum())
    padded_slots = batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    print(f"[padding_free {task}] rollout {rollout_seconds:.1f} s; completion lengths {lengths.min()}-{lengths.max()} "
          f"(mean {lengths.float().mean():.1f}), prompts {prompt_lengths.min()}-{prompt_lengths.max()}; "
          f"{real} real tokens of {padded_slots} padded slots", flush=True)
    optimizer_seconds = optimizer_step_seconds(trainer)
    train_phase(trainer, batch, False)  # warm-up, both arms
    train_phase(trainer, batch, True)
    times = {False: [], True: []}
    cpu = {False: [], True: []}
    repeats = opts.repeats_smollm2 if task == "smollm2" else opts.repeats
    for r in range(repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        for arm in order:
            start, c0 = time.perf_counter(), time.process_time()
            train_phase(trainer, batch, arm)
            times[arm].append(time.perf_counter() - start)
            cpu[arm].append(time.process_time() - c0)
        print(f"[padding_free {task}] repeat {r + 1}: padded {times[False][-1]:.2f} s, packed {times[True][-1]:.2f} s",
              flush=True)
    memory = {False: [], True: []}
    for r in range(opts.memory_repeats):
        for arm in ((False, True) if r % 2 == 0 else (True, False)):
            cmd = [sys.executable, __file__, "--memory-arm", task, "--batch-file", str(batch_file)]
            if arm:
                cmd.append("--packed")
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            memory[arm].append(json.loads(result.stdout.strip().splitlines()[-1]))
    key = "cuda_peak_above_baseline_mb" if torch.cuda.is_available() else "peak_above_baseline_mb"
    mem = {arm: [m[key] for m in memory[arm]] for arm in memory}
    speedups = [p / q for p, q in zip(times[False], times[True], strict=True)]
    cpu_speedups = [p / q for p, q in zip(cpu[False], cpu[True], strict=True)]
    rest = rollout_seconds + optimizer_seconds  # the step outside the training-phase forwards: the same in both arms
    e2e = [(rest + p) / (rest + q) for p, q in zip(times[False], times[True], strict=True)]
    mem_ratio = [q / p for p, q in zip(mem[False], mem[True], strict=True)]
    return {
        "task": task,
        "label": TASKS[task]["label"],
        "completions": int(batch["completion_ids"].size(0)),
        "micro_batch": TASKS[task]["micro_batch"],
        "max_completion_length": TASKS[task]["max_completion_length"],
        "completion_length": {"min": int(lengths.min()), "max": int(lengths.max()),
                              "mean": round(float(lengths.float().mean()), 1)},
        "prompt_length": {"min": int(prompt_lengths.min()), "max": int(prompt_lengths.max())},
        "real_tokens": real,
        "padded_slots": padded_slots,
        "rollout_seconds_outside_forwards": round(rollout_seconds, 2),
        "optimizer_step_seconds": round(optimizer_seconds, 3),
        "train_phase_seconds": {"padded": _range(times[False]), "packed": _range(times[True])},
        "train_phase_cpu_seconds": {"padded": _range(cpu[False]), "packed": _range(cpu[True])},
        "peak_memory_mb": {"padded": _range(mem[False]), "packed": _range(mem[True]), "measure": key},
        "train_phase_speedup": _range(speedups),
        "train_phase_cpu_speedup": _range(cpu_speedups),
        "peak_memory_ratio": _range(mem_ratio),
        "end_to_end_speedup": _range(e2e),
    }


def write_markdown(path: Path, result: dict) -> None:
    def rng(d, fmt="{:.2f}"):
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"

    lines = [
        "# Padding-free packed training vs TRL's padded forward",
        "",
        f"Generated by `benchmarks/padding_free.py` on {result['created']} ({result['device']}, torch threads "
        f"{result['torch_threads']}, load average at start / end {result['load_start']} / {result['load_end']}; the "
        "machine was shared with other jobs). Same rollout tensors for both arms; training phase = reference + old "
        "log-probs (no grad) + loss forward/backward of every micro-batch; arms interleaved (ABBA), "
        "repeats per task in the table; medians with (min-max) over repeats. Peak memory: "
        f"{result['memory_measure']}, {result['options']['memory_repeats']} fresh process(es) per arm. End-to-end: "
        "the rollout's measured seconds outside the log-prob forwards (generation, rewards) + one measured AdamW "
        "step + the training phase; generation is unchanged by construction. Wall seconds on a loaded machine "
        "run 2-3x the CPU seconds: compare the CPU-s column too.",
        "",
        "| task | repeats | completions (lengths) | real tokens / padded slots | train phase s padded | packed | "
        "train-phase speed-up | CPU-s speed-up | peak MB padded | packed | peak memory ratio | end-to-end speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["tasks"]:
        cl = r["completion_length"]
        lines.append(
            f"| {r['label']} | {r['train_phase_speedup']['n']} | {r['completions']} ({cl['min']}-{cl['max']}, mean {cl['mean']}; budget "
            f"{r['max_completion_length']}) | {r['real_tokens']} / {r['padded_slots']} | "
            f"{rng(r['train_phase_seconds']['padded'])} | {rng(r['train_phase_seconds']['packed'])} | "
            f"**{rng(r['train_phase_speedup'])}x** | {rng(r['train_phase_cpu_speedup'])}x | "
            f"{rng(r['peak_memory_mb']['padded'], '{:.0f}')} | {rng(r['peak_memory_mb']['packed'], '{:.0f}')} | "
            f"**{rng(r['peak_memory_ratio'])}** | {rng(r['end_to_end_speedup'])}x |"
        )
    lines += ["", f"Command: `{result['command']}`.", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="chain,smollm2")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--repeats-smollm2", type=int, default=3, help="repeats on SmolLM2 (about 4 min each on CPU)")
    ap.add_argument("--memory-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="pipeline check: chain task, 2 repeats, 1 memory run")
    ap.add_argument("--memory-arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    torch.set_num_threads(opts.threads)
    if opts.quick:
        opts.tasks, opts.repeats, opts.memory_repeats = "chain", 2, 1
        opts.out = opts.out or tempfile.mkdtemp(prefix="padding-free-quick-")
    if opts.memory_arm:
        print(json.dumps(memory_arm(opts.memory_arm, opts.batch_file, opts.packed)))
        return 0
    result = dict(created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch_threads=torch.get_num_threads(),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
                  memory_measure=("torch.cuda.max_memory_allocated above the loaded model" if torch.cuda.is_available()
                                  else "peak resident set (VmHWM, reset after loading) above the loaded-model RSS"),
                  load_start=round(os.getloadavg()[0], 2), options={k: v for k, v in vars(opts).items()
                                                                    if k in ("tasks", "repeats", "repeats_smollm2", "memory_repeats",
                                                                             "threads")},
                  command="python benchmarks/padding_free.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                  tasks=[])
    out = Path(opts.out or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="padding-free-") as tmp:
        for task in [t for t in opts.tasks.split(",") if t]:
            record = run_task(task, opts, Path(tmp))
            result["tasks"].append(record)
            result["load_end"] = round(os.getloadavg()[0], 2)
            print(f"[padding_free {task}] train phase {record['train_phase_speedup']['median']:.2f}x, peak memory "
                  f"ratio {record['peak_memory_ratio']['median']:.2f}, end-to-end "
                  f"{record['end_to_end_speedup']['median']:.2f}x", flush=True)
            (out / "padding_free.json").write_text(json.dumps(result, indent=1))
            write_markdown(out / "padding_free.md", result)
    print((out / "padding_free.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
