"""Code-reward throughput: the sandbox pool in parallel vs one worker (serial), same sandbox.

64 small programs (passing, failing, and a few that sleep ~0.2 s) are scored with ``code_pass``'s
machinery (``CodeReward``: the test harness in :func:`run_in_sandbox`, all containment on). The
serial and parallel runs are interleaved and repeated in one process, alternating which goes
first, and the medians are compared. Timings are noisy on a shared machine: the ratio is the
result, not the absolute seconds.

    python benchmarks/code_reward_throughput.py [--reps 3] [--workers 4]

Writes benchmarks/results/code_reward.json and benchmarks/results/code_reward.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from grpo_variants.rewards.builtin import CodeReward
from grpo_variants.rewards.sandbox import sandbox_capabilities

N_PROGRAMS = 64
RESULTS = Path(__file__).resolve().parent / "results"


def make_batch(n: int = N_PROGRAMS) -> tuple[list[str], list[list[str]], list[float]]:
    """Completions, tests and the expected code_pass score of each."""
    completions, tests, expected = [], [], []
    for i in range(n):
        t = [f"assert f({i}) == {2 * i}", f"assert f({i + 1}) == {2 * i + 2}"]
        if i % 8 == 7:  # slow but correct
            body = "import time\ntime.sleep(0.2)\ndef f(x):\n    return 2 * x\n"
            exp = 1.0
        elif i % 4 == 1:  # wrong answer
            body = "def f(x):\n    return 2 * x + 1\n"
            exp = 0.0
        elif i % 8 == 3:  # crashes
            body = "def f(x):\n    return undefined_name * x\n"
            exp = 0.0
        else:
            body = "def f(x):\n    return x + x\n"
            exp = 1.0
        completions.append(f"Here is my solution.\n```python\n{body}```")
        tests.append(t)
        expected.append(exp)
    return completions, tests, expected


def time_once(reward: CodeReward, completions, tests) -> tuple[float, list]:
    t0 = time.perf_counter()
    scores = reward(prompts=["p"] * len(completions), completions=completions, tests=tests)
    return time.perf_counter() - t0, scores


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=max(2, 2 * (os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    caps = sandbox_capabilities()
    completions, tests, expected = make_batch()
    serial = CodeReward("all", max_workers=1, timeout=10.0)
    parallel = CodeReward("all", max_workers=args.workers, timeout=10.0)
    # Warm-up (probe, page cache), not timed.
    time_once(serial, completions[:4], tests[:4])
    time_once(parallel, completions[:4], tests[:4])

    serial_s, parallel_s = [], []
    for rep in range(args.reps):
        order = [("serial", serial), ("parallel", parallel)]
        if rep % 2:
            order.reverse()
        for label, reward in order:
            dt, scores = time_once(reward, completions, tests)
            if scores != expected:
                raise SystemExit(f"{label} run {rep}: scores differ from the expected ones: {scores}")
            (serial_s if label == "serial" else parallel_s).append(dt)
            print(f"rep {rep} {label:8s} {dt:6.2f} s")
    parallel.close()

    s_med, p_med = statistics.median(serial_s), statistics.median(parallel_s)
    result = {
        "programs": N_PROGRAMS,
        "parallel_workers": args.workers,
        "serial_seconds_median": round(s_med, 3),
        "parallel_seconds_median": round(p_med, 3),
        "speedup_ratio": round(s_med / p_med, 2),
        "repetitions": args.reps,
        "serial_seconds": [round(x, 3) for x in serial_s],
        "parallel_seconds": [round(x, 3) for x in parallel_s],
        "mix": {"passing": expected.count(1.0), "failing": expected.count(0.0), "slow_0.2s": N_PROGRAMS // 8},
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "containment": {k: caps[k] for k in ("uid_drop", "netns", "mountns", "pidns", "ipcns")},
        "note": "shared 2-core machine, timings noisy; compare the ratio",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code_reward.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# Code reward throughput (sandboxed `code_pass`)",
        "",
        f"{N_PROGRAMS} programs ({result['mix']['passing']} passing, {result['mix']['failing']} failing, "
        f"{result['mix']['slow_0.2s']} sleeping 0.2 s), {args.reps} interleaved repetitions, medians. "
        f"Machine: {os.cpu_count()} CPU cores (shared). Containment: "
        + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in result["containment"].items())
        + ".",
        "",
        "| mode | workers | median seconds | programs / s |",
        "|---|---|---|---|",
        f"| serial | 1 | {s_med:.2f} | {N_PROGRAMS / s_med:.1f} |",
        f"| parallel | {args.workers} | {p_med:.2f} | {N_PROGRAMS / p_med:.1f} |",
        "",
        f"**Speed-up: {result['speedup_ratio']}x** (serial median / parallel median).",
        "",
    ]
    (args.out / "code_reward.md").write_text("\n".join(md))
    print(json.dumps({k: result[k] for k in list(result)[:5]}))
    return result


if __name__ == "__main__":
    main()
