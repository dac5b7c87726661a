"""Run every benchmark script in sequence (``make bench``).

    python benchmarks/run_all.py            # full runs (quiet machine; see benchmarks/README.md for times)
    python benchmarks/run_all.py --quick    # every script's --quick check
    python benchmarks/run_all.py --only overhead,variants
    python benchmarks/run_all.py --readme   # only refresh the results section of benchmarks/README.md

Scripts run in the order of ORDER, then any other ``benchmarks/*.py`` (not starting with "_"), each
in its own process so that one failure does not stop the rest. Results land in
benchmarks/results/; a summary of what ran, how long it took and what failed is printed and
written to benchmarks/results/run_all.json. The exit status is non-zero when any script failed.
Finally the results section of benchmarks/README.md (between the ``results:start`` / ``results:end``
markers) is rebuilt from benchmarks/results/*.md, so the README always shows the latest tables and plots.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "gpu_check.py",  # without CUDA: skipped (full) or its --cpu-smoke check (--quick)
    "overhead.py",
    "variants.py",
    "reasoning.py",
    "process_rewards.py",
    "dapo_vs_grpo.py",
    "mu_grpo_speedup.py",
    "code_reward_throughput.py",
]


# results/<name>.md files shown in the README, in this order (others follow alphabetically)
RESULTS_ORDER = ["overhead", "variants", "lab_comparison", "reasoning", "reasoning_grpo", "process_rewards", "dapo",
                 "mu_grpo", "mu_grpo_mu20", "mu_grpo_real_speed", "padding_free", "code_reward", "gpu_check"]
RESULT_SOURCES = {
    "overhead": "overhead.py",
    "variants": "variants.py",
    "lab_comparison": "variants.py",
    "reasoning": "reasoning.py",
    "reasoning_grpo": "reasoning.py",
    "process_rewards": "process_rewards.py",
    "process_rewards_kl_target_0.05": "process_rewards.py",
    "process_rewards_kl_target_0.05_h8": "process_rewards.py",
    "process_rewards_kl_long": "process_rewards.py",
    "dapo": "dapo_vs_grpo.py",
    "mu_grpo": "mu_grpo_speedup.py",
    "mu_grpo_mu20": "mu_grpo_speedup.py",
    "mu_grpo_real_speed": "mu_grpo_real_speed.py",
    "padding_free": "padding_free.py",
    "code_reward": "code_reward_throughput.py",
    "gpu_check": "gpu_check.py",
}
START, END = "<!-- results:start -->", "<!-- results:end -->"


def results_section() -> str:
    """The README's results section, built from benchmarks/results/*.md."""
    results = HERE / "results"
    found = {p.stem: p for p in results.glob("*.md")} if results.exists() else {}
    names = [n for n in RESULTS_ORDER] + sorted(set(found) - set(RESULTS_ORDER))
    parts = []
    for name in names:
        path = found.get(name)
        if path is None:
            source = RESULT_SOURCES.get(name, f"{name}.py")
            parts.append(f"### {name}\n\n_Not run yet (placeholder): `python benchmarks/{source}` writes "
                         f"results/{name}.md._")
            continue
        text = path.read_text().strip()
        text = re.sub(r"^(#{1,4}) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", text, flags=re.M)
        text = re.sub(r"\]\((?!https?:|results/)([^)]+\.(?:png|json|md))\)", r"](results/\1)", text)
        png = results / f"{name}.png"
        if png.exists() and f"results/{png.name}" not in text:
            text += f"\n\n![{name}](results/{png.name})"
        parts.append(text)
    return "\n\n".join(parts)


def update_readme() -> Path:
    readme = HERE / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n\n{results_section()}\n\n{END}{tail}")
    return readme


def scripts() -> list[Path]:
    found = {p.name: p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != Path(__file__).name}
    ordered = [found.pop(name) for name in ORDER if name in found]
    return ordered + [found[name] for name in sorted(found)]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script that accepts it")
    parser.add_argument("--only", default=None, help="comma-separated script names (with or without .py)")
    parser.add_argument("--list", action="store_true", help="print the scripts that would run, and exit")
    parser.add_argument("--readme", action="store_true", help="only rebuild the README's results section")
    args = parser.parse_args(argv)
    if args.readme:
        print("updated", update_readme())
        return 0

    todo = scripts()
    if args.only:
        wanted = {n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()}
        unknown = wanted - {p.stem for p in todo}
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; available: {[p.stem for p in todo]}")
        todo = [p for p in todo if p.stem in wanted]
    missing = [name for name in ORDER if not (HERE / name).exists()]
    if args.list:
        for p in todo:
            print(p.name)
        if missing:
            print("not present:", ", ".join(missing))
        return 0

    report = []
    cuda = _cuda_available()
    for script in todo:
        cmd = [sys.executable, str(script)]
        if script.name == "gpu_check.py" and not cuda:
            if not args.quick:
                print(f"\n=== {script.name}: skipped (no CUDA device; --quick runs its --cpu-smoke check) ===")
                report.append({"script": script.name, "returncode": 0, "seconds": 0.0, "args": [], "skipped": "no CUDA"})
                continue
            cmd.append("--cpu-smoke")
        elif args.quick and "--quick" in script.read_text():
            cmd.append("--quick")
        print(f"\n=== {script.name} {' '.join(cmd[2:])} ===", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd, cwd=str(HERE.parent))
        seconds = time.perf_counter() - start
        report.append({"script": script.name, "returncode": rc, "seconds": round(seconds, 1), "args": cmd[2:]})
        print(f"=== {script.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s ===", flush=True)

    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "run_all.json").write_text(json.dumps(
        {"created": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, "runs": report, "not_present": missing},
        indent=1))
    print("\nsummary:")
    for r in report:
        status = "skipped" if r.get("skipped") else ("ok" if r["returncode"] == 0 else "FAILED")
        print(f"  {r['script']:28s} {status:7s} {r['seconds']:7.0f} s" + (f"  ({r['skipped']})" if r.get("skipped") else ""))
    if missing:
        print("  not present:", ", ".join(missing))
    print("updated", update_readme())
    return 1 if any(r["returncode"] != 0 for r in report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
