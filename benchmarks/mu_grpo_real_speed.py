"""µ-GRPO stage speed on the real SmolLM2-135M-Instruct (speed only, no accuracy): on-policy GRPO vs stages.

A full accuracy comparison on this model does not fit a shared CPU (30 GRPO steps took 63 min,
``real_model.md``), so this measures only where the time goes for the same number of optimizer updates of
the same completions per update, on ``grpo_variants.tasks.word_problems`` with the ``math_accuracy`` reward:

* ``on_policy_grpo``: one rollout of ``--batch`` completions per update (µ = 1);
* ``stage_batching``: µ-GRPO stages of ``--updates`` x batch completions generated at once, each response
  used once (the same sequences as on-policy GRPO: the gain of stage-sized generation alone);
* ``stage_reuse``: stages of half that, each response used twice (half the sequences).

Both stage arms run µ-GRPO's loss ([0, 5] + H_kappa veto). Per arm: training wall and process CPU
seconds, time per phase (generation, reward, behaviour-log-prob passes, rest of the rollout, update +
other), rollout sequences/s and tokens/s. One seed, arms run back to back: indicative, not a
distribution. No held-out evaluation: these few updates say nothing about accuracy.

    python benchmarks/mu_grpo_real_speed.py                  # 8 updates of 16 completions per arm
    python benchmarks/mu_grpo_real_speed.py --quick          # pipeline check (2 updates, 8 tokens; temp folder)
    .venv-vllm/bin/python benchmarks/mu_grpo_real_speed.py --engine both   # HF generate and vLLM, side by side

Writes benchmarks/results/mu_grpo_real_speed.json and .md (``--engine hf``, the default), or
mu_grpo_real_speed_vllm.json and .md with ``--engine vllm`` / ``both``: the same arms with rollouts from vLLM's
CPU engine (colocate, eager, float32: the trainer's dtype, one engine shared by the arms, synced before each
rollout; its start is reported apart, not in any arm's time), in the engine environment (``make setup-vllm``).
With ``both`` the HF arms run first, in the same process: the end-to-end time per update of on-policy GRPO with
either engine, and how much of a step is rollout with each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from _bench import timed_train  # noqa: E402  (sets the offline environment first)

import torch  # noqa: E402

from grpo_variants import (  # noqa: E402
    GRPOVariantConfig,
    GRPOVariantTrainer,
    MuGRPOConfig,
    MuGRPOTrainer,
    word_problems,
)
from grpo_variants.tasks.models import smollm2  # noqa: E402

ARMS = ("on_policy_grpo", "stage_batching", "stage_reuse")
PHASES = ("generation", "reward", "logprobs", "rollout_other", "update_other")


ENGINES = ("hf", "vllm")


def build(arm: str, model: str, dataset, opts, output_dir: str, engine: str = "hf"):
    vllm = (dict(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True, vllm_dtype="float32",
                 vllm_reuse_engine=True, vllm_kv_cache_memory_bytes=512 << 20)  # float32: 46 KB/token, 8192 tokens
            if engine == "vllm" else {})
    common = dict(**vllm, output_dir=output_dir, per_device_train_batch_size=opts.batch, num_generations=opts.group,
                  max_completion_length=opts.max_new_tokens, learning_rate=opts.lr, lr_scheduler_type="constant",
                  warmup_steps=0, beta=0.0, max_steps=opts.updates, logging_steps=1, save_strategy="no",
                  report_to="none", bf16=False, gradient_checkpointing=False, seed=opts.seed, data_seed=opts.seed,
                  dataloader_num_workers=0, disable_tqdm=True, loss_type="grpo", scale_rewards="group")
    if arm == "on_policy_grpo":
        return GRPOVariantTrainer(model=model, reward_funcs="math_accuracy",
                                  args=GRPOVariantConfig(epsilon=0.2, **common), train_dataset=dataset)
    passes = 1 if arm == "stage_batching" else 2
    stage_completions = opts.updates * opts.batch // passes
    config = MuGRPOConfig(relaxed_clip=True, mu_clip_lower=0.0, mu_clip_upper=5.0, veto_scope="H_kappa",
                          stage_prompts=stage_completions // opts.group, updates_per_stage=opts.updates, **common)
    return MuGRPOTrainer(model=model, reward_funcs="math_accuracy", args=config, train_dataset=dataset)


def run_arm(arm: str, model: str, dataset, opts, engine: str = "hf") -> dict:
    torch.manual_seed(opts.seed)
    with tempfile.TemporaryDirectory(prefix=f"mu-real-{arm}-") as tmp:
        built = time.perf_counter()
        trainer = build(arm, model, dataset, opts, tmp, engine)
        construction = time.perf_counter() - built  # the engine's start, for the first vLLM arm
        timed = timed_train(trainer)
        tokens = int(trainer._tokens_generated_total)
    history = trainer.state.log_history
    wall, cpu_seconds, rollout, phase = timed["wall"], timed["cpu"], timed["rollout"], timed["phase"]
    return dict(
        arm=arm, engine=engine, construction_seconds=round(construction, 2),
        engine_reused=bool(getattr(getattr(trainer, "vllm_generation", None), "engine_reused", False)),
        wall_seconds=round(wall, 2), cpu_seconds=round(cpu_seconds, 2),
        phase_seconds={k: round(v, 2) for k, v in phase.items()}, rollouts=rollout["calls"],
        sequences=rollout["sequences"], generated_tokens=tokens, optimizer_steps=trainer.state.global_step,
        sequences_per_second=rollout["sequences"] / max(rollout["seconds"], 1e-9),
        tokens_per_second=tokens / max(rollout["seconds"], 1e-9),
        generate_only_sequences_per_second=rollout["sequences"] / max(phase["generation"], 1e-9),
        behaviour_logprobs_recorded=sum(1 for r in history if "rollout_logprobs/recorded" in r),
    )


def write_markdown(path: Path, result: dict) -> None:
    o = result["options"]
    runs = {r["arm"]: r for r in result["runs"]}
    on = runs["on_policy_grpo"]
    labels = {"on_policy_grpo": "on-policy GRPO (µ=1)",
              "stage_batching": f"µ-GRPO stage, 1 pass (µ={o['updates']}, same sequences)",
              "stage_reuse": f"µ-GRPO stage, 2 passes (µ={o['updates']}, half the sequences)"}
    arms = [a for a in ARMS if a in runs]
    row = lambda name, f: "| " + name + " | " + " | ".join(f(runs[a]) for a in arms) + " |"  # noqa: E731
    lines = [
        "# µ-GRPO stage speed on the real SmolLM2-135M-Instruct (speed only)",
        "",
        f"Generated by `benchmarks/mu_grpo_real_speed.py` on {result['created']}. **Speed only: no accuracy is "
        f"measured** ({o['updates']} updates say nothing about it; see `mu_grpo.md` for accuracy on the toy chain "
        f"task). SmolLM2-135M-Instruct (float32, HF generate), `word_problems` with `math_accuracy`, {o['updates']} "
        f"optimizer updates of {o['batch']} completions ({o['batch'] // o['group']} prompts x {o['group']}) per arm, "
        f"≤ {o['max_new_tokens']} new tokens, lr {o['lr']:g}, beta 0, seed {o['seed']}; torch threads "
        f"{result['torch_threads']} on a 2-core machine shared with other jobs (load average at start / end "
        f"{result['load_start']} / {result['load_end']}); one run per arm, back to back: indicative, not a "
        "distribution.",
        "",
        "| metric | " + " | ".join(labels[a] for a in arms) + " |",
        "|---|" + "---|" * len(arms),
        row("training wall seconds", lambda r: f"{r['wall_seconds']:.1f}"),
        row("speed-up vs on-policy (wall)", lambda r: f"{on['wall_seconds'] / r['wall_seconds']:.2f}x"),
        row("training CPU seconds (this process)", lambda r: f"{r['cpu_seconds']:.1f}"),
        row("speed-up vs on-policy (CPU)", lambda r: f"{on['cpu_seconds'] / r['cpu_seconds']:.2f}x"),
        *[row(f"  {p.replace('_', ' ')} s", lambda r, p=p: f"{r['phase_seconds'][p]:.1f}") for p in PHASES],
        row("rollouts", lambda r: str(r["rollouts"])),
        row("sequences generated", lambda r: str(r["sequences"])),
        row("tokens generated", lambda r: f"{r['generated_tokens']:,}"),
        row("rollout sequences/s", lambda r: f"{r['sequences_per_second']:.2f}"),
        row("rollout tokens/s", lambda r: f"{r['tokens_per_second']:.1f}"),
        row("HF generate only sequences/s", lambda r: f"{r['generate_only_sequences_per_second']:.2f}"),
        row("behaviour log-probs recorded in generate (rollouts)", lambda r: str(r["behaviour_logprobs_recorded"])),
        "",
        f"Command: `{result['command']}`.",
        "",
    ]
    path.write_text("\n".join(lines))


def write_engine_markdown(path: Path, result: dict) -> None:
    """mu_grpo_real_speed_vllm.md: the arms per rollout engine, side by side."""
    o = result["options"]
    runs = result["runs"]
    by = {(r["engine"], r["arm"]): r for r in runs}
    names = {"hf": "HF generate", "vllm": "vLLM (eager, float32)"}
    labels = {"on_policy_grpo": "on-policy GRPO", "stage_batching": "µ-GRPO stage, 1 pass",
              "stage_reuse": "µ-GRPO stage, 2 passes"}
    cols = [(r["engine"], r["arm"]) for r in runs]
    cell = lambda f: " | ".join(f(by[c], c) for c in cols)  # noqa: E731
    per_update = lambda r: r["wall_seconds"] / max(r["optimizer_steps"], 1)  # noqa: E731
    rollout = lambda r: r["wall_seconds"] - r["phase_seconds"]["update_other"]  # noqa: E731

    def vs(reference):
        def f(r, c):
            ref = by.get(reference(c))
            return f"{per_update(ref) / per_update(r):.2f}x" if ref else "-"
        return f
    lines = [
        "# µ-GRPO stages and on-policy GRPO with vLLM's CPU engine vs HF generate (SmolLM2-135M-Instruct, speed only)",
        "",
        (f"Generated by `benchmarks/mu_grpo_real_speed.py --engine {o['engine']}` on {result['created']}, in the "
        f"engine environment (vLLM {result.get('vllm_version', '?')}, transformers {result.get('transformers_version', '?')}). "
        f"**Speed only.** `word_problems` with `math_accuracy`, {o['updates']} optimizer updates of {o['batch']} "
        f"completions ({o['batch'] // o['group']} prompts x {o['group']}) per arm, ≤ {o['max_new_tokens']} new tokens, "
        f"beta 0, seed {o['seed']}; the trainer on {result['torch_threads']} torch thread(s), vLLM's CPU engine on the "
        f"core it binds; 2-core machine, load average at start / end {result['load_start']} / {result['load_end']}. "
        f"The engine started once ({result.get('engine_start_seconds', 0):.1f} s, in the first vLLM arm's "
        "construction, not in any arm's time) and was synced before every rollout (the sync is in the rollout time). "
        "One run per arm, back to back, in one process: indicative, not a distribution."),
        "",
        "| metric | " + " | ".join(f"{labels[a]}, {names[e]}" for e, a in cols) + " |",
        "|---|" + "---|" * len(cols),
        "| training wall seconds | " + cell(lambda r, c: f"{r['wall_seconds']:.1f}") + " |",
        "| wall seconds per update | " + cell(lambda r, c: f"{per_update(r):.2f}") + " |",
        "| rollout share of the wall time | " + cell(lambda r, c: f"{rollout(r) / max(r['wall_seconds'], 1e-9):.0%}") + " |",
        "| speed-up vs on-policy GRPO, same engine | " + cell(vs(lambda c: (c[0], "on_policy_grpo"))) + " |",
        "| speed-up vs HF generate, same arm | " + cell(vs(lambda c: ("hf", c[1]))) + " |",
        "| training CPU seconds (this process) | " + cell(lambda r, c: f"{r['cpu_seconds']:.1f}") + " |",
        *["| " + f"  {p.replace('_', ' ')} s" + " | " + cell(lambda r, c, p=p: f"{r['phase_seconds'][p]:.1f}") + " |"
          for p in PHASES],
        "| rollouts | " + cell(lambda r, c: str(r["rollouts"])) + " |",
        "| sequences generated | " + cell(lambda r, c: str(r["sequences"])) + " |",
        "| tokens generated | " + cell(lambda r, c: f"{r['generated_tokens']:,}") + " |",
        "| rollout tokens/s | " + cell(lambda r, c: f"{r['tokens_per_second']:.1f}") + " |",
        "",
        ("The training CPU seconds are this process's: the colocated engine runs in it (TRL's colocate mode, "
         "vLLM's external launcher), so they include the sampling. \"logprobs s\" is the trainer's forward pass "
         "over each rollout that TRL runs when the completions come from vLLM (the old log-probs of its "
         "importance-sampling correction, `vllm_importance_sampling_correction`); with HF generate and one update "
         "per rollout TRL skips it (the old log-probs are the current ones). The engine generates faster than HF "
         "generate here (generation s), and that forward pass takes back more than the difference at this size "
         "(24 new tokens); µ-GRPO's stages pay it once per stage."),
        "",
        f"Command: `{result['command']}`.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="completions per update")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--engine", choices=("hf", "vllm", "both"), default="hf",
                    help="the rollout engine of the arms (vllm / both: in the engine environment, make setup-vllm)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: a temporary one)")
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.updates, opts.max_new_tokens = 2, 8
    if (opts.updates * opts.batch // 2) % opts.group or opts.batch % opts.group or opts.updates % 2:
        ap.error("--updates must be even and --batch a multiple of --group (the reuse arm halves the stage)")
    engines = ENGINES if opts.engine == "both" else (opts.engine,)
    if "vllm" in engines:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            print("skipped: vLLM is not installed in this environment; run `make setup-vllm`, then "
                  "`.venv-vllm/bin/python benchmarks/mu_grpo_real_speed.py --engine both` (docs/vllm.md)")
            return 0
    torch.set_num_threads(opts.threads)
    model = str(smollm2())
    dataset = word_problems.make_dataset("train", 2000, seed=opts.seed)
    result = dict(created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch_threads=torch.get_num_threads(),
                  load_start=round(os.getloadavg()[0], 2), options={k: v for k, v in vars(opts).items() if k != "out"},
                  command="python benchmarks/mu_grpo_real_speed.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                  runs=[])
    out = Path(opts.out or (tempfile.mkdtemp(prefix="mu-real-quick-") if opts.quick else HERE / "results"))
    out.mkdir(parents=True, exist_ok=True)
    name = "mu_grpo_real_speed" if engines == ("hf",) else "mu_grpo_real_speed_vllm"
    if "vllm" in engines:
        import transformers
        import vllm

        result.update(vllm_version=vllm.__version__, transformers_version=transformers.__version__)
    for engine in engines:
        for arm in [a for a in opts.arms.split(",") if a]:
            run = run_arm(arm, model, dataset, opts, engine)
            if engine == "vllm" and not run["engine_reused"]:
                result["engine_start_seconds"] = run["construction_seconds"]
            print(f"[mu_grpo_real_speed {time.strftime('%H:%M:%S')}] {engine} {arm}: wall {run['wall_seconds']:.1f} "
                  f"s, CPU {run['cpu_seconds']:.1f} s, phases {run['phase_seconds']}, "
                  f"{run['sequences_per_second']:.2f} seq/s", flush=True)
            result["runs"].append(run)
            result["load_end"] = round(os.getloadavg()[0], 2)
            (out / f"{name}.json").write_text(json.dumps(result, indent=1))
            if engines == ("hf",) and "on_policy_grpo" in {r["arm"] for r in result["runs"]}:
                write_markdown(out / f"{name}.md", result)
            elif engines != ("hf",):
                write_engine_markdown(out / f"{name}.md", result)
    print((out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
