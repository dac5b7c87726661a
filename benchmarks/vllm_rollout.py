"""Rollout speed on CPU, side by side in one process: vLLM's CPU engine vs HF ``generate`` on SmolLM2-135M.

Runs in the engine environment (``make setup-vllm``; ``.venv-vllm/bin/python benchmarks/vllm_rollout.py``);
elsewhere it says so and exits 0. The same 16 completions of the same chat prompt, exactly ``--tokens`` new
tokens each (EOS ignored, so every arm generates the same number of tokens), sampled at temperature 1:

* HF ``generate`` in float32 on ``torch`` threads = the machine's cores (2 here);
* vLLM eager engines (``vllm_enforce_eager=True``, what the tests use) in float32 and bfloat16, on the core
  vLLM's CPU backend binds by default (it leaves the others to the trainer).

Reports tokens/s, wall and process-CPU seconds per arm, the engines' start times and the load average before
and after (the machine is shared: compare the arms with each other, not with another run).
Writes benchmarks/results/vllm_rollout.json and .md. The committed run: OMP_NUM_THREADS=2, eager engines; the
bfloat16 eager engine is slower than float32 on this CPU (no native bfloat16 matrix units), vLLM's compiled
engine (the default, ~45 s to start) is not in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def write_markdown(results: dict, path: Path) -> None:
    """benchmarks/results/vllm_rollout.md: the table of one run (the README's results section shows it)."""
    lines = ["# vLLM vs HF generate on CPU (SmolLM2-135M)", "",
             (f"{results['completions']} completions x {results['new_tokens_each']} new tokens, one process, side by "
             f"side; load average before {results['load_average_before'][0]:.1f}, after "
             f"{results['load_average_after'][0]:.1f} ({results['cores']} cores, OMP_NUM_THREADS="
             f"{results.get('omp_num_threads')})."),
             "",
             "| arm | tokens/s | wall s | process CPU s | engine start s | vs HF |", "|---|---|---|---|---|---|"]
    for name, arm in results["arms"].items():
        start = f"{arm['engine_start_s']:.1f}" if "engine_start_s" in arm else "-"
        lines.append(f"| {name} | {arm['tokens_per_s']:.1f} | {arm['wall_s']:.1f} | {arm['process_cpu_s']:.1f} | "
                     f"{start} | {results['speedup_vs_hf_float32'][name]:.2f}x |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 tokens per completion instead of 128")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--out", default=str(HERE / "results" / "vllm_rollout.json"))
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("skipped: vLLM is not installed in this environment; run `make setup-vllm`, then "
              "`.venv-vllm/bin/python benchmarks/vllm_rollout.py` (docs/vllm.md)")
        return 0
    tokens = args.tokens or (32 if args.quick else 128)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from grpo_variants.rollout.vllm_engine import engine_dtype, start_engine
    from grpo_variants.tasks.models import smollm2

    path = str(smollm2(verbose=False))
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Explain step by step."}],
                                     tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    n = args.completions
    load_before = os.getloadavg()
    results = {"model": "SmolLM2-135M-Instruct", "completions": n, "new_tokens_each": tokens,
               "prompt_tokens": len(prompt_ids), "cores": os.cpu_count(), "arms": {}}

    # HF generate, float32, torch on every core
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids] * n)
    torch.manual_seed(0)
    with torch.no_grad():
        out, wall, cpu = _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                                       temperature=1.0, max_new_tokens=tokens,
                                                       min_new_tokens=tokens, pad_token_id=tok.pad_token_id))
    generated = int(out[:, ids.size(1):].numel())
    results["arms"]["hf_generate_float32"] = dict(threads=torch.get_num_threads(), tokens=generated,
                                                  wall_s=wall, process_cpu_s=cpu, tokens_per_s=generated / wall)
    model = None  # freed before the engines start

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0, seed=0)
    engines = []  # kept alive to the end: shutting an engine down tears down vLLM's process-wide state
    for dtype in ("float32", "bfloat16"):
        llm, start_wall, _ = _timed(lambda d=dtype: start_engine(path, dtype=d, enforce_eager=True, max_num_seqs=n))
        engines.append(llm)
        outs, wall, cpu = _timed(lambda llm=llm: llm.generate([{"prompt_token_ids": prompt_ids}] * n, params,
                                                      use_tqdm=False))
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        results["arms"][f"vllm_eager_{dtype}"] = dict(
            engine_dtype=str(engine_dtype(llm)).removeprefix("torch."), engine_start_s=start_wall,
            tokens=generated, wall_s=wall, process_cpu_s=cpu, tokens_per_s=generated / wall)
    results["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    results["load_average_before"] = load_before
    results["load_average_after"] = os.getloadavg()
    hf = results["arms"]["hf_generate_float32"]["tokens_per_s"]
    results["speedup_vs_hf_float32"] = {k: v["tokens_per_s"] / hf for k, v in results["arms"].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, Path(args.out).with_suffix(".md"))
    for name, arm in results["arms"].items():
        print(f"{name:24s} {arm['tokens_per_s']:7.1f} tokens/s  wall {arm['wall_s']:6.1f} s  "
              f"cpu {arm['process_cpu_s']:6.1f} s" + (f"  start {arm['engine_start_s']:.1f} s"
                                                     if "engine_start_s" in arm else ""))
    print(f"load average before {load_before}, after {results['load_average_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
