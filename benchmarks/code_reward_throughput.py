"""Code-reward throughput, before vs after a change of the sandbox, side by side in one run.

64 small programs (passing, failing, crashing, and a few that sleep 0.2 s) are scored with
``CodeReward("all")`` serially (one worker) and through the default pool (``max_workers=None``:
min(8, cores)), by two source trees: the current one ("after") and a checkout of ``--before-ref``
("before", extracted with ``git archive`` into a temporary directory). Each measurement runs in a
fresh interpreter with that tree first on ``sys.path``; before and after alternate, and within one
measurement serial and pool alternate which goes first. The result is the after/before ratio of the
medians (timings on a shared machine are noisy; the ratio is the result, not the seconds).

    python benchmarks/code_reward_throughput.py [--reps 3] [--before-ref d69f207] [--quick]

``d69f207`` is the last tree with the static planner (issue #37 replaced it by the tests running as Python
in a program-free process; the program answers calls).

Writes benchmarks/results/code_reward.json and benchmarks/results/code_reward.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
N_PROGRAMS = 64

# Runs in a fresh interpreter with one source tree on sys.path; prints one JSON line.
_WORKER = r"""
import json, sys, time
rep = int(sys.argv[1])
from grpo_variants.rewards.builtin import CodeReward
from grpo_variants.rewards.sandbox import sandbox_capabilities
import grpo_variants
completions, tests, expected = [], [], []
for i in range(64):
    t = ["assert f(%d) == %d" % (i, 2 * i), "assert f(%d) == %d" % (i + 1, 2 * i + 2)]
    if i % 8 == 7:
        body, exp = "import time\ntime.sleep(0.2)\ndef f(x):\n    return 2 * x\n", 1.0
    elif i % 4 == 1:
        body, exp = "def f(x):\n    return 2 * x + 1\n", 0.0
    elif i % 8 == 3:
        body, exp = "def f(x):\n    return undefined_name * x\n", 0.0
    else:
        body, exp = "def f(x):\n    return x + x\n", 1.0
    completions.append("Here is my solution.\n```python\n" + body + "```")
    tests.append(t)
    expected.append(exp)
caps = sandbox_capabilities()
serial, pool = CodeReward("all", max_workers=1), CodeReward("all")
serial(prompts=["p"] * 4, completions=completions[:4], tests=tests[:4])  # warm-up: probe, page cache
pool(prompts=["p"] * 4, completions=completions[:4], tests=tests[:4])
out = {"source": grpo_variants.__file__, "mode": caps.get("mode", "namespaces" if caps.get("mountns") else "process"),
       "pool_workers": pool.pool.max_workers}
order = [("serial", serial), ("pool", pool)]
if rep % 2:
    order.reverse()
import resource
def _cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
for name, reward in order:
    t0, c0 = time.perf_counter(), _cpu()
    scores = reward(prompts=["p"] * 64, completions=completions, tests=tests)
    out[name] = time.perf_counter() - t0
    out[name + "_cpu"] = _cpu() - c0  # this process and every reaped descendant (stub, bwrap, programs)
    if scores != expected:
        raise SystemExit("%s: scores differ from the expected ones: %s" % (name, scores))
pool.close()
print(json.dumps(out))
"""


def _checkout(ref: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _measure(tree: Path, rep: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    env.pop("GRPO_SANDBOX_DIR", None)
    out = subprocess.run([sys.executable, "-c", _WORKER, str(rep)], capture_output=True, text=True, env=env,
                         cwd=str(tree), timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"measurement with {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before-ref", default="d69f207", help="git ref of the 'before' tree (default: the last "
                    "commit with the static planner, before issue #37)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="one repetition, results printed, not written")
    args = ap.parse_args()
    if args.quick:
        args.reps = 1

    runs: dict[str, list[dict]] = {"before": [], "after": []}
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="code_reward_before_") as tmp:
        before = Path(tmp)
        _checkout(args.before_ref, before)
        for rep in range(args.reps):
            sides = [("before", before), ("after", ROOT)]
            if rep % 2:
                sides.reverse()
            for label, tree in sides:
                m = _measure(tree, rep)
                runs[label].append(m)
                print(f"rep {rep} {label:6s} serial {m['serial']:6.2f} s ({m['serial_cpu']:.2f} CPU s)   "
                      f"pool({m['pool_workers']}) {m['pool']:6.2f} s ({m['pool_cpu']:.2f} CPU s)", flush=True)

    def med(label: str, key: str) -> float:
        return statistics.median(m[key] for m in runs[label])

    result = {
        "programs": N_PROGRAMS,
        "before_ref": args.before_ref,
        "repetitions": args.reps,
        "pool_workers": runs["after"][0]["pool_workers"],
        "before": {"serial_seconds_median": round(med("before", "serial"), 3),
                   "pool_seconds_median": round(med("before", "pool"), 3),
                   "serial_seconds": [round(m["serial"], 3) for m in runs["before"]],
                   "pool_seconds": [round(m["pool"], 3) for m in runs["before"]],
                   "serial_cpu_seconds_median": round(med("before", "serial_cpu"), 3),
                   "pool_cpu_seconds_median": round(med("before", "pool_cpu"), 3),
                   "sandbox_mode": runs["before"][0]["mode"]},
        "after": {"serial_seconds_median": round(med("after", "serial"), 3),
                  "pool_seconds_median": round(med("after", "pool"), 3),
                  "serial_seconds": [round(m["serial"], 3) for m in runs["after"]],
                  "pool_seconds": [round(m["pool"], 3) for m in runs["after"]],
                  "serial_cpu_seconds_median": round(med("after", "serial_cpu"), 3),
                  "pool_cpu_seconds_median": round(med("after", "pool_cpu"), 3),
                  "sandbox_mode": runs["after"][0]["mode"]},
        "ratio_after_over_before": {
            "serial": round(med("after", "serial") / med("before", "serial"), 3),
            "pool": round(med("after", "pool") / med("before", "pool"), 3),
            "serial_cpu": round(med("after", "serial_cpu") / med("before", "serial_cpu"), 3),
            "pool_cpu": round(med("after", "pool_cpu") / med("before", "pool_cpu"), 3),
        },
        "pool_speedup": {"before": round(med("before", "serial") / med("before", "pool"), 2),
                         "after": round(med("after", "serial") / med("after", "pool"), 2)},
        "mix": {"passing": 40, "failing": 24, "slow_0.2s": N_PROGRAMS // 8},
        "cpu_count": os.cpu_count(),
        "load_average_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
        "python": platform.python_version(),
        "note": "time ratio after/before (below 1: faster); CPU seconds = the scoring process plus every reaped "
                "descendant; shared machine, timings noisy, compare the ratios",
    }
    if args.quick:
        print(json.dumps(result, indent=2))
        return result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "code_reward.json").write_text(json.dumps(result, indent=2) + "\n")
    r = result["ratio_after_over_before"]
    md = [
        "# Code reward throughput: before vs after a change of the judge/sandbox",
        "",
        f"{N_PROGRAMS} programs (40 passing, 24 failing or crashing, 8 sleeping 0.2 s) scored by "
        "`CodeReward(\"all\")`, "
        f"serially and through the default pool ({result['pool_workers']} workers), by the tree at "
        f"`{args.before_ref}` (before) and the current one (after), alternating, {args.reps} repetitions, medians. "
        f"{os.cpu_count()} CPU cores (shared; load average {result['load_average_before_after'][0][0]:.1f} before, "
        f"{result['load_average_before_after'][1][0]:.1f} after).",
        "",
        "| | before (s) | after (s) | after / before | CPU s before | CPU s after | CPU after / before |",
        "|---|---|---|---|---|---|---|",
        f"| serial | {result['before']['serial_seconds_median']:.2f} | {result['after']['serial_seconds_median']:.2f} "
        f"| {r['serial']:.2f} | {result['before']['serial_cpu_seconds_median']:.2f} "
        f"| {result['after']['serial_cpu_seconds_median']:.2f} | {r['serial_cpu']:.2f} |",
        f"| pool | {result['before']['pool_seconds_median']:.2f} | {result['after']['pool_seconds_median']:.2f} "
        f"| {r['pool']:.2f} | {result['before']['pool_cpu_seconds_median']:.2f} "
        f"| {result['after']['pool_cpu_seconds_median']:.2f} | {r['pool_cpu']:.2f} |",
        "",
        f"Sandbox: before `{result['before']['sandbox_mode']}`, after `{result['after']['sandbox_mode']}`.",
        "",
        "CPU seconds are this process plus every descendant reaped below it (RUSAGE_CHILDREN). A tree whose "
        "bubblewrap init was reparented to PID 1 (before #25) does not see its programs' CPU there: one "
        "program burning 1 CPU s showed 0.02 s before #25 and 1.04 s after, so compare wall time across that "
        "change, and CPU seconds only between trees that both have the stub as subreaper.",
        "",
    ]
    (args.out / "code_reward.md").write_text("\n".join(md))
    print(json.dumps(result["ratio_after_over_before"]))
    return result


if __name__ == "__main__":
    main()
