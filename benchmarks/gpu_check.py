"""GPU check: a few GRPO / DAPO / µ-GRPO steps on random-weight Qwen2.5-0.5B and -1.5B shapes, measured.

One script, sized for one H200 in under 10 minutes (``--budget-s``, default 480 s, stops starting new
runs when the budget would be exceeded and reports them as skipped). Nothing is downloaded: the
models are ``Qwen2ForCausalLM`` built from the published Qwen2.5 shapes (written out below as
``Qwen2Config`` values) with random weights, and the tokenizer is built in-script: a word-level
tokenizer with exactly the model's vocabulary size (151,936: the toy kit's characters plus filler
tokens ``<x123>``), so the LM head and the logits cost what they cost on the real model. Prompts are
``--prompt-len`` tokens (filler tokens + a toy question). A random-weight policy hardly ever emits
EOS, so every completion runs to ``--completion-len`` tokens; the reward is a deterministic hash of
the completion (1 with probability 1/8), so groups have reward variance and DAPO's dynamic sampling
keeps about 2 groups in 3 (it re-samples, as it would on a hard dataset).

Runs (each optional, reported as skipped with the reason when it cannot run here):

* ``{0.5b,1.5b} x {grpo, dapo, mu_grpo}``: HF ``generate``, bf16 autocast, gradient checkpointing;
* ``vllm_colocate``: GRPO on 0.5B with TRL's colocated vLLM (needs ``vllm``; in a subprocess);
* ``qlora``: GRPO on 1.5B, base in 4-bit NF4 (bitsandbytes) + LoRA r=16 (needs ``bitsandbytes``).

Per run it records, from the trainer's own metrics (``time/generation_s``, ``time/reward_s``,
``time/logprobs_s``, ``time/update_s``, ``throughput/generated_tokens_per_s``): generated tokens/s
(generation only, and end to end over the whole training time), the step-time breakdown (mean
over the steps after the first, which includes warm-up), and peak GPU memory
(``torch.cuda.max_memory_allocated``, reset before each run). Ratios measured side by side in the
same run: DAPO / GRPO and µ-GRPO / GRPO step time per generated token, 1.5B / 0.5B tokens/s, vLLM
/ HF generation tokens/s, QLoRA / full fine-tuning peak memory.

    python benchmarks/gpu_check.py                 # on the GPU machine (see benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --cpu-smoke     # tiny shapes, 1 step each, on CPU (~1-2 min)

Writes ``benchmarks/results/gpu_check.json`` (``gpu_check_cpu_smoke.json`` with ``--cpu-smoke``),
a markdown table (``.md``) and a plot of the step-time breakdown (``.png``) beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .` (the GPU machine)
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

# The published Qwen2.5 shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B), as Qwen2Config values.
QWEN25_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    # --cpu-smoke only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
}
FULL_VARIANTS = ("grpo", "dapo", "mu_grpo")
PHASES = ("generation", "reward", "logprobs", "update")


# ------------------------------------------------------------------------------------------------
# Model, tokenizer, data, reward (all local)
# ------------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int):
    """Word-level tokenizer with exactly ``vocab_size`` entries: the toy kit's + filler tokens ``<xN>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_variants.tasks.toy import ASSISTANT, BOS, CHARS, EOS, PAD, SPECIAL_TOKENS, UNK, USER

    base = SPECIAL_TOKENS + CHARS
    vocab = {tok: i for i, tok in enumerate(base)}
    for i in range(vocab_size - len(base)):
        vocab[f"<x{i}>"] = len(base) + i
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"<x\d+>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK, additional_special_tokens=[USER, ASSISTANT],
                                        padding_side="left", model_max_length=1 << 20)
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def load_tokenizer(folder):
    """The saved tokenizer exactly as built. ``AutoTokenizer`` / ``AutoProcessor`` (what TRL uses when no
    ``processing_class`` is given) map a ``qwen2`` model folder to ``Qwen2Tokenizer``, which replaces the
    pre-tokenizer with Qwen's byte-level one: the filler tokens would be split into characters."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def build_model_folder(shape: str, folder: Path, device: str) -> Path:
    """A random-weight Qwen2 model of ``shape`` saved (bf16 on CUDA) with its tokenizer; reused if present."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    values = QWEN25_SHAPES[shape]
    tokenizer = build_tokenizer(values["vocab_size"])
    config = Qwen2Config(**values, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def make_dataset(prompt_len: int, vocab_size: int, n: int = 512, seed: int = 0):
    from datasets import Dataset

    from grpo_variants.tasks.toy import CHARS, SPECIAL_TOKENS

    rng = random.Random(seed)
    filler = vocab_size - len(SPECIAL_TOKENS) - len(CHARS)
    prompts = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"{a}+{b}="
        prefix = "".join(f"<x{rng.randrange(filler)}>" for _ in range(max(prompt_len - len(question), 0)))
        prompts.append(prefix + question)
    return Dataset.from_dict({"prompt": prompts})


def hash_reward(completions, **kwargs):
    """1 with probability ~1/8, a deterministic function of the completion text (throughput runs only)."""
    return [1.0 if zlib.crc32(str(c).encode()) % 8 == 0 else 0.0 for c in completions]


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------
def run_config(run: dict, opts, model_path: str, dataset) -> dict:
    """Train one configuration for ``opts.steps`` steps and return its measurements."""
    import torch

    from grpo_variants import get_variant
    from grpo_variants.runtime.scale import lora_config, qlora_model_init_kwargs, vllm_kwargs

    cuda = torch.cuda.is_available()
    spec = get_variant(run["variant"])
    batch, group = opts.batch, opts.num_generations
    values = dict(
        output_dir=str(Path(opts.workdir) / "runs" / run["name"]),
        per_device_train_batch_size=batch,
        num_generations=group,
        max_completion_length=opts.completion_len,
        max_steps=opts.steps,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=cuda,
        gradient_checkpointing=cuda,
        disable_tqdm=True,
        temperature=1.0,
        reward_isolation="none",
    )
    if run["variant"] == "mu_grpo":  # one stage = 2 mini-batches, each used once: stage 2 starts at step 3
        values.update(stage_prompts=2 * batch // group, updates_per_stage=2)
    peft_config = None
    if run.get("qlora"):
        values["model_init_kwargs"] = qlora_model_init_kwargs()
        peft_config = lora_config(r=16)
    if run.get("vllm"):
        values.update(vllm_kwargs("colocate", gpu_memory_utilization=0.35, sleep_mode=False,
                                  vllm_max_model_length=opts.prompt_len + opts.completion_len + 16))
    args = spec.config_cls(**values)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = spec.trainer_cls(model=model_path, reward_funcs=hash_reward, args=args, train_dataset=dataset,
                               peft_config=peft_config, processing_class=load_tokenizer(model_path))
    build_s = time.perf_counter() - start
    prompt_tokens = len(trainer.processing_class(dataset[0]["prompt"])["input_ids"])
    if prompt_tokens != opts.prompt_len:
        raise RuntimeError(f"the trainer's tokenizer makes {prompt_tokens} prompt tokens, expected {opts.prompt_len}")
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    history = [r for r in trainer.state.log_history if "train_runtime" not in r]
    result = summarise(history, train_s, trainer._tokens_generated_total, opts.steps)
    result.update(build_s=round(build_s, 2), train_s=round(train_s, 2), prompt_tokens=prompt_tokens)
    if cuda:
        result["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        result["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    if run.get("qlora"):
        import bitsandbytes as bnb

        result["linear4bit_modules"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    if hasattr(trainer, "last_dynamic_sampling") and trainer.last_dynamic_sampling is not None:
        info = trainer.last_dynamic_sampling
        result["dapo_last_rounds"] = info.rounds
        result["dapo_last_kept_fraction"] = round(info.groups_kept / max(info.groups_generated, 1), 3)
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else None


def summarise(history: list[dict], train_s: float, generated_tokens: int, steps: int) -> dict:
    per_step = []
    for record in history:
        if "loss" not in record:
            continue
        per_step.append({
            "step": record.get("step"),
            "loss": record.get("loss"),
            "step_time_s": record.get("step_time"),
            "generation_s": record.get("time/generation_s", 0.0),
            "reward_s": record.get("time/reward_s", 0.0),
            "logprobs_s": record.get("time/logprobs_s", 0.0),
            "update_s": record.get("time/update_s"),
            "generated_tokens": record.get("tokens/generated", 0.0),
            "generation_tokens_per_s": record.get("throughput/generated_tokens_per_s"),
            "mfu": record.get("throughput/mfu"),
        })
    steady = per_step[1:] if len(per_step) > 1 else per_step  # step 1 carries the warm-up
    out = {
        "steps": len(per_step),
        "generated_tokens": int(generated_tokens),
        "tokens_per_s_end_to_end": round(generated_tokens / train_s, 2) if train_s > 0 else None,
        "generation_tokens_per_s": _round(_mean([s["generation_tokens_per_s"] for s in steady])),
        "step_time_s": _round(_mean([s["step_time_s"] for s in steady])),
        "breakdown_s": {phase: _round(_mean([s[f"{phase}_s"] for s in steady])) for phase in PHASES},
        "breakdown_total_s": {phase: _round(sum(s[f"{phase}_s"] or 0.0 for s in per_step)) for phase in PHASES},
        "mfu": _round(_mean([s["mfu"] for s in steady])),
        "per_step": per_step,
        "losses_finite": all(s["loss"] is not None and math.isfinite(s["loss"]) for s in per_step),
    }
    if len(per_step) != steps:
        out["note"] = f"{len(per_step)} logged steps of {steps}"
    return out


def _round(x, digits=4):
    return None if x is None else round(x, digits)


# ------------------------------------------------------------------------------------------------
# Plan, budget, subprocess runs
# ------------------------------------------------------------------------------------------------
def plan(opts) -> list[dict]:
    """The smallest shape's variants, then the optional paths (vLLM, QLoRA), then the larger shapes:
    if the budget runs out, what is skipped is more of the same rather than a whole code path."""
    first, last = opts.shapes[0], opts.shapes[-1]
    runs = [{"name": f"{first}-{v}", "shape": first, "variant": v} for v in opts.variants]
    if not opts.no_vllm:
        runs.append({"name": f"{first}-grpo-vllm_colocate", "shape": first, "variant": "grpo", "vllm": True,
                     "compare_to": f"{first}-grpo"})
    if not opts.no_qlora:
        runs.append({"name": f"{last}-grpo-qlora", "shape": last, "variant": "grpo", "qlora": True,
                     "compare_to": f"{last}-grpo"})
    for shape in opts.shapes[1:]:
        runs += [{"name": f"{shape}-{v}", "shape": shape, "variant": v} for v in opts.variants]
    return runs


def _import_error(module: str, timeout: float = 180.0) -> str | None:
    """Import ``module`` in a throw-away interpreter (vLLM's import is heavy and touches global state)."""
    try:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{module} import did not finish in {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return f"{module} import failed: {lines[-1] if lines else f'exit code {proc.returncode}'}"


def unavailable(run: dict) -> str | None:
    from grpo_variants.runtime.scale import qlora_unavailable_reason, vllm_unavailable_reason

    if run.get("vllm"):
        return _import_error("vllm") or vllm_unavailable_reason()
    if run.get("qlora"):
        return qlora_unavailable_reason() or _import_error("bitsandbytes")
    return None


def run_in_subprocess(run: dict, opts, model_path: str, timeout: float) -> dict:
    """vLLM runs in a fresh process: it sets distributed env vars and keeps GPU memory for its life."""
    out = Path(opts.workdir) / f"{run['name']}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--single-run", json.dumps(run), "--single-out", str(out),
           "--model-path", model_path, *opts.passthrough]
    proc = subprocess.run(cmd, cwd=REPO, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"subprocess exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def ratios(results: dict[str, dict], opts) -> dict:
    ok = {name: r for name, r in results.items() if r.get("status") == "ok"}

    def per_token_step(r):  # training seconds per generated token (variants generate different amounts)
        return r["train_s"] / max(r["generated_tokens"], 1)

    out = {}
    for shape in opts.shapes:
        base = ok.get(f"{shape}-grpo")
        if base is None:
            continue
        for variant in ("dapo", "mu_grpo"):
            other = ok.get(f"{shape}-{variant}")
            if other is not None:
                out[f"{shape}: {variant}/grpo train seconds per generated token"] = round(
                    per_token_step(other) / per_token_step(base), 3)
    small, large = ok.get(f"{opts.shapes[0]}-grpo"), ok.get(f"{opts.shapes[-1]}-grpo")
    if small and large and small is not large and small.get("generation_tokens_per_s") and large.get(
            "generation_tokens_per_s"):
        out[f"grpo generation tokens/s {opts.shapes[-1]}/{opts.shapes[0]}"] = round(
            large["generation_tokens_per_s"] / small["generation_tokens_per_s"], 3)
    for name, r in ok.items():
        base = ok.get(r.get("compare_to", ""))
        if base is None:
            continue
        if "vllm" in name and r.get("generation_tokens_per_s") and base.get("generation_tokens_per_s"):
            out[f"{name}: vLLM/HF generation tokens/s"] = round(
                r["generation_tokens_per_s"] / base["generation_tokens_per_s"], 3)
        if "qlora" in name and r.get("peak_gpu_memory_gb") and base.get("peak_gpu_memory_gb"):
            out[f"{name}: QLoRA/full peak GPU memory"] = round(r["peak_gpu_memory_gb"] / base["peak_gpu_memory_gb"], 3)
    return out


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("transformers", "trl", "accelerate", "peft", "datasets", "vllm", "bitsandbytes", "deepspeed"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    return info


def write_outputs(payload: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out)
    rows = ["| run | status | gen tok/s | end-to-end tok/s | step s | gen / reward / logprobs / update s | peak GB |",
            "|---|---|---|---|---|---|---|"]
    for name, r in payload["runs"].items():
        if r.get("status") != "ok":
            rows.append(f"| {name} | {r.get('status')}: {r.get('reason', '')[:80]} | | | | | |")
            continue
        b = r["breakdown_s"]
        parts = " / ".join("-" if b[p] is None else f"{b[p]:.2f}" for p in PHASES)
        rows.append(f"| {name} | ok | {r.get('generation_tokens_per_s')} | {r.get('tokens_per_s_end_to_end')} | "
                    f"{r.get('step_time_s')} | {parts} | {r.get('peak_gpu_memory_gb', '-')} |")
    ratio_rows = [f"- {k}: **{v}**" for k, v in payload.get("ratios", {}).items()]
    env = payload["environment"]
    text = (f"# GPU check ({env['device']}, torch {env['torch']}, trl {env['trl']})\n\n"
            f"Settings: {json.dumps(payload['settings'])}\n\n" + "\n".join(rows)
            + "\n\nStep-time breakdown: mean over the steps after the first (warm-up).\n\n"
            + ("Ratios (same run, side by side):\n\n" + "\n".join(ratio_rows) + "\n" if ratio_rows else ""))
    out.with_suffix(".md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = {n: r for n, r in payload["runs"].items() if r.get("status") == "ok"}
        if ok:
            fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ok)), 4))
            bottom = [0.0] * len(ok)
            for phase in PHASES:
                heights = [r["breakdown_s"][phase] or 0.0 for r in ok.values()]
                ax.bar(list(ok), heights, bottom=bottom, label=phase)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            ax.set_ylabel("seconds per step (after warm-up)")
            ax.set_title(f"GPU check: step-time breakdown ({env['device']})")
            ax.legend()
            plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
            fig.tight_layout()
            fig.savefig(out.with_suffix(".png"), dpi=120)
            plt.close(fig)
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, 1 step each, on CPU")
    parser.add_argument("--shapes", default=None, help="comma list of 0.5b,1.5b (default both)")
    parser.add_argument("--variants", default=",".join(FULL_VARIANTS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--completion-len", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no run that would end past this")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-qlora", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--single-run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--single-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    smoke = opts.cpu_smoke
    defaults = dict(steps=1 if smoke else 3, batch=8 if smoke else 64, num_generations=4 if smoke else 8,
                    prompt_len=16 if smoke else 128, completion_len=8 if smoke else 256)
    opts.passthrough = ["--cpu-smoke"] if smoke else []
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
        else:
            opts.passthrough += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    opts.shapes = ["tiny"] if smoke else (opts.shapes or "0.5b,1.5b").split(",")
    opts.variants = opts.variants.split(",")
    unknown = [s for s in opts.shapes if s not in QWEN25_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from 0.5b, 1.5b")
    opts.workdir = opts.workdir or os.environ.get("GPU_CHECK_WORKDIR") or "/tmp/grpo_variants_gpu_check"
    opts.passthrough += ["--workdir", opts.workdir]
    name = "gpu_check_cpu_smoke.json" if smoke else "gpu_check.json"
    opts.out = Path(opts.out or HERE / "results" / name)
    return opts


def main(argv=None) -> int:
    opts = parse(argv)
    import torch

    if opts.single_run is not None:  # child process of run_in_subprocess
        run = json.loads(opts.single_run)
        shape = QWEN25_SHAPES[run["shape"]]
        dataset = make_dataset(opts.prompt_len, shape["vocab_size"])
        result = run_config(run, opts, opts.model_path, dataset)
        Path(opts.single_out).write_text(json.dumps(result))
        return 0

    if not torch.cuda.is_available() and not opts.cpu_smoke:
        print("gpu_check: no CUDA device; use --cpu-smoke for the CPU check", file=sys.stderr)
        return 2
    if opts.cpu_smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    Path(opts.workdir).mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment(),
        "settings": {k: getattr(opts, k) for k in ("steps", "batch", "num_generations", "prompt_len",
                                                   "completion_len", "budget_s", "shapes", "variants", "cpu_smoke")},
        "runs": {},
    }
    print(f"[gpu_check] {payload['environment']}", flush=True)
    runs = plan(opts)
    durations: dict[str, float] = {}
    models: dict[str, str] = {}
    for run in runs:
        name = run["name"]
        reason = unavailable(run)
        if reason is not None:
            payload["runs"][name] = {"status": "skipped", "reason": reason}
            print(f"[gpu_check] {name}: skipped ({reason})", flush=True)
            write_outputs(payload, opts.out)
            continue
        elapsed = time.perf_counter() - started
        estimate = 150.0 if run.get("vllm") else max([d for n, d in durations.items()
                                                      if n.startswith(run["shape"])] or [45.0])
        if elapsed + estimate > opts.budget_s:
            reason = f"time budget: {elapsed:.0f} s used, ~{estimate:.0f} s needed, budget {opts.budget_s:.0f} s"
            payload["runs"][name] = {"status": "skipped", "reason": reason}
            print(f"[gpu_check] {name}: skipped ({reason})", flush=True)
            write_outputs(payload, opts.out)
            continue
        t0 = time.perf_counter()
        try:
            if run["shape"] not in models:
                folder = Path(opts.workdir) / f"qwen2.5-{run['shape']}-random"
                models[run["shape"]] = str(build_model_folder(run["shape"], folder, device))
            if run.get("vllm"):
                result = run_in_subprocess(run, opts, models[run["shape"]],
                                           timeout=max(opts.budget_s - elapsed, 60.0))
            else:
                dataset = make_dataset(opts.prompt_len, QWEN25_SHAPES[run["shape"]]["vocab_size"])
                result = run_config(run, opts, models[run["shape"]], dataset)
            result["status"] = "ok"
        except Exception as err:  # a failed run is reported, the others still run
            result = {"status": "failed", "reason": f"{type(err).__name__}: {err}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        result.update({k: v for k, v in run.items() if k not in ("name",)})
        durations[name] = result["wall_s"]
        payload["runs"][name] = result
        payload["ratios"] = ratios(payload["runs"], opts)
        payload["total_s"] = round(time.perf_counter() - started, 1)
        write_outputs(payload, opts.out)
        summary = {k: result.get(k) for k in ("status", "reason", "generation_tokens_per_s",
                                              "tokens_per_s_end_to_end", "step_time_s", "breakdown_s",
                                              "peak_gpu_memory_gb", "wall_s")}
        print(f"[gpu_check] {name}: {json.dumps(summary)}", flush=True)
    payload["total_s"] = round(time.perf_counter() - started, 1)
    write_outputs(payload, opts.out)
    failed = [n for n, r in payload["runs"].items() if r.get("status") == "failed"]
    print(f"[gpu_check] wrote {opts.out} ({payload['total_s']} s); ratios: {json.dumps(payload.get('ratios', {}))}")
    if failed:
        print(f"[gpu_check] FAILED runs: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
