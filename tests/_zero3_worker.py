"""Worker for tests/test_zero3.py: train every variant a few steps and write what happened to JSON.

Launched three ways by the test (and usable by hand):

* ``accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 2 tests/_zero3_worker.py compare ...``
  (2 CPU processes over gloo under DeepSpeed ZeRO-3, through grpo_variants.runtime.distributed's shim);
* ``python tests/_zero3_worker.py compare ...`` (the single-process reference, no DeepSpeed);
* ``... tests/_zero3_worker.py resume ...`` (save -> kill -> resume under ZeRO-3).

Generation is made deterministic and identical in every rank layout: the trainer's
``_generate_single_turn`` still runs the real generation (under ZeRO-3: with gathered parameters,
every rank in lock-step), then its samples are replaced by a fixed completion that is a function
of the prompt text and the sample's index in its group, with varied correctness so advantages are
non-zero. Everything downstream (decoding, rewards, advantages, the loss, the update) is the
trainers' own code. With the same global batch and seed the loss, the gradient norm and the
updated parameters must then agree across layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import grpo_variants  # noqa: E402  (installs the CPU distributed shim when launched on CPU)
from grpo_variants import get_variant, list_variants, toy  # noqa: E402

GLOBAL_BATCH = 16  # completions per optimizer step, in every layout
NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 6
_QUESTION = re.compile(r"(\d+)\s*([+-])\s*(\d+)\s*=")

# Fields a variant's paper-scale defaults may set that must be tiny here (applied when the field exists).
TINY = dict(
    num_generations=NUM_GENERATIONS,
    max_completion_length=MAX_COMPLETION_LENGTH,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    logging_steps=1,
    report_to="none",
    seed=0,
    bf16=False,
    fp16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
    save_strategy="no",
    max_prompt_length=None,
    # one mini-batch per rollout, used twice: step 2 is off-policy (ratios != 1, clipping, veto and FIPO's
    # future-KL weights act), step 3 is a fresh rollout. With steps_per_generation > 1 TRL shuffles each
    # rank's local generation batch into mini-batches, so a mini-batch's rows would depend on the layout.
    num_iterations=2,
    gradient_accumulation_steps=1,
    steps_per_generation=1,
    generation_batch_size=None,
    temperature=1.0,
    dataloader_num_workers=0,
)

# Variant fields that must be sized for the toy run (per variant), and steps per variant.
VARIANT_OVERRIDES = {
    # one stage = 4 prompts x 4 = one mini-batch, reused twice (num_iterations 2): step 2 is off-policy
    # against the stored behaviour log-probs, step 3 starts the next stage.
    "mu_grpo": dict(stage_prompts=4, updates_per_stage=2),
    # the toy vocabulary has no letters and 64 positions: the toy template ("37+45=82 37+45=")
    "igrpo": "toy_template",
}
VARIANT_STEPS: dict[str, int] = {}


def overrides_for(name: str) -> dict:
    value = VARIANT_OVERRIDES.get(name, {})
    if value == "toy_template":
        from grpo_variants.variants.igrpo import TOY_DRAFT_TEMPLATE

        return dict(draft_template=TOY_DRAFT_TEMPLATE)
    return dict(value)


def fixed_completion(prompt_text: str, k: int, eos: str, max_len: int = MAX_COMPLETION_LENGTH) -> str:
    """The k-th sample's completion for a prompt: right for some k, wrong for others, some truncated.

    About one group in five is all-correct (zero reward variance: DAPO filters it), the others mix
    right and wrong answers, of varied lengths.
    """
    h = zlib.crc32(prompt_text.encode())
    match = None
    for match in _QUESTION.finditer(prompt_text):  # the last question in the prompt (iGRPO may prepend a draft)
        pass
    if match is not None:
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        gold = a + b if op == "+" else a - b
    else:
        gold = h % 97
    if h % 5 == 0:
        correct = True
    else:
        correct = (h // 5 + k) % 3 == 0
    if correct:
        text = f"{gold}{eos}"
    elif (h + k) % 4 == 0:  # a wrong, truncated answer (no EOS within the budget)
        return str(gold + 1 + k).ljust(max_len, "9")[:max_len]
    else:
        text = f"{gold + 1 + k}{eos}"
    return text


def make_deterministic(trainer) -> None:
    """Replace the samples of every rollout by :func:`fixed_completion` (after running real generation).

    A sample's index k is its occurrence count among this call's identical prompts, so a group's
    samples must sit on one rank: true here (8 or 16 rows per rank, groups of 4, TRL's sampler keeps
    a group's rows together, iGRPO's draft plan gives each rank whole prompts' drafts).
    """
    tokenizer = trainer.processing_class
    original = trainer._generate_single_turn

    def _generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        real_ids, _ = original(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        assert len(real_ids) == len(prompt_ids)
        seen: dict[tuple, int] = {}
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            k = seen.get(key, 0)
            seen[key] = k + 1
            text = tokenizer.decode(ids, skip_special_tokens=True)
            completion = fixed_completion(text, k, tokenizer.eos_token, trainer.max_completion_length)
            out.append(tokenizer(completion, add_special_tokens=False)["input_ids"][: trainer.max_completion_length])
        return out, None

    trainer._generate_single_turn = _generate_single_turn


BASE = "base"  # the base GRPOVariantTrainer with no variant (TRL's defaults: token-mean "dapo" loss, beta 0)


def resolve(name: str):
    """(trainer class, config class) of a registered variant, or of the base trainer for ``"base"``."""
    if name == BASE:
        from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer

        return SimpleNamespace(trainer_cls=GRPOVariantTrainer, config_cls=GRPOVariantConfig)
    return get_variant(name)


def variant_args(name: str, output_dir: str, num_processes: int, **overrides):
    spec = resolve(name)
    field_names = {f.name for f in __import__("dataclasses").fields(spec.config_cls)}
    values = {k: v for k, v in TINY.items() if k in field_names}
    values.update(per_device_train_batch_size=GLOBAL_BATCH // num_processes, output_dir=output_dir)
    values.update(overrides_for(name))
    values.update(overrides)
    return spec.config_cls(**values)


def _deepspeed_engine(trainer):
    engine = getattr(trainer, "deepspeed", None)
    return engine if engine is not None and engine is not trainer.model else None


def _unwrapped(trainer):
    return trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model


def shard_report(trainer) -> dict:
    """Under ZeRO-3 every rank holds only its shard of each parameter, and parameters above the
    persistence threshold are released (``numel() == 0``) outside a gather."""
    params = list(_unwrapped(trainer).named_parameters())
    zero3 = all(hasattr(p, "ds_id") for _, p in params)
    report = {"zero3": zero3, "num_params": len(params), "total_numel": sum(
        int(p.ds_numel) if hasattr(p, "ds_id") else p.numel() for _, p in params)}
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        ref_module = ref.module if hasattr(ref, "module") else ref
        report["ref_model_zero3"] = all(hasattr(p, "ds_id") for p in ref_module.parameters())
    if not zero3:
        return report
    plugin = trainer.accelerator.state.deepspeed_plugin
    threshold = int(plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"])
    local = sum(int(p.ds_tensor.numel()) for _, p in params)
    per_rank = [None] * trainer.accelerator.num_processes
    torch.distributed.all_gather_object(per_rank, local)
    report.update(
        world=trainer.accelerator.num_processes,
        local_shard_numel_per_rank=per_rank,
        persistence_threshold=threshold,
        num_above_threshold=sum(1 for _, p in params if p.ds_numel > threshold),
        released_above_threshold=sum(1 for _, p in params if p.ds_numel > threshold and p.numel() == 0),
        visible_numel=sum(p.numel() for _, p in params),  # materialised outside a gather
    )
    return report


def save_params(trainer, path) -> None:
    """The trainable parameters in full (gathered under ZeRO-3; a collective call), saved by rank 0."""
    out = {}
    for name, p in _unwrapped(trainer).named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().clone()
        else:
            out[name] = p.detach().float().clone()
    if trainer.accelerator.is_main_process:
        torch.save(out, path)


def _log_series(trainer, key: str) -> list:
    return [r[key] for r in trainer.state.log_history if key in r and "train_runtime" not in r]


def train_variant(name, model_path, dataset, output_dir, steps, num_processes, **overrides) -> dict:
    spec = resolve(name)
    args = variant_args(name, output_dir, num_processes, max_steps=steps, **overrides)
    trainer = spec.trainer_cls(model=model_path, reward_funcs="toy_accuracy", args=args, train_dataset=dataset)
    make_deterministic(trainer)
    start = time.perf_counter()
    trainer.train()
    params_file = os.path.join(output_dir, "final_params.pt")
    save_params(trainer, params_file)
    return {
        "variant": name,
        "seconds": round(time.perf_counter() - start, 2),
        "global_step": trainer.state.global_step,
        "loss": _log_series(trainer, "loss"),
        "grad_norm": _log_series(trainer, "grad_norm"),
        "reward": _log_series(trainer, "reward"),
        "padding_free_steps": len(_log_series(trainer, "padding_free/slot_ratio")),  # steps with a packed forward
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "deepspeed": _deepspeed_engine(trainer) is not None,
        "zero_stage": (trainer.accelerator.state.deepspeed_plugin.zero_stage
                       if trainer.accelerator.state.deepspeed_plugin is not None else None),
        "shards": shard_report(trainer),
        "params_file": params_file,
    }


# Extra cases: "<variant>@<case>" runs the variant with these config overrides.
CASES = {
    # generation on the partitioned model (no gather; every rank steps through generate in lock-step)
    # it also trains with TRL's padded forward (padding_free="auto" packs the toy model in every other case), so the
    # padded training path under ZeRO-3 stays covered; packed and padded agree to float rounding
    "nogather": dict(ds3_gather_for_generation=False, padding_free=False),
    # padding-free packed training forward (tests/test_zero3.py compares it with the padded reference)
    "padfree": dict(padding_free=True),
    # TRL's padded forward (padding_free="auto", the default, packs the toy model): the padded reference
    "padded": dict(padding_free=False),
}


def cmd_compare(opts) -> None:
    names = opts.variants.split(",") if opts.variants else [v.name for v in list_variants()]
    dataset = toy.make_dataset(split="train", n=256)
    results = {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in names:
        variant, _, case = name.partition("@")
        print(f"[_zero3_worker] {name}: training on {world} process(es)", flush=True)
        results[name] = train_variant(
            variant, opts.model, dataset, os.path.join(opts.workdir, f"{name.replace('@', '-')}-{world}"),
            VARIANT_STEPS.get(variant, opts.steps), world, **CASES.get(case, {}),
        )
        if results[name]["num_processes"] > 1:
            torch.distributed.barrier()
    _write(opts.out, results)


def cmd_resume(opts) -> None:
    """Save -> kill -> resume under the launcher's layout, in two launches.

    ``--phase kill``: train ``--steps`` uninterrupted (the reference trajectory), then train again
    in a fresh folder saving every ``--save-steps`` and exit hard (``os._exit``: no clean shutdown,
    like a pre-empted job) right after the checkpoint at ``--kill-after`` is written.
    ``--phase resume``: a new process resumes that checkpoint with ``train(resume_from_checkpoint=...)``
    and finishes the run. The test compares the resumed losses with the reference.
    """
    from transformers import TrainerCallback

    dataset = toy.make_dataset(split="train", n=256)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    name = opts.variants or "grpo"
    spec = resolve(name)

    def build(output_dir, **overrides):
        args = variant_args(name, output_dir, world, max_steps=opts.steps, **overrides)
        trainer = spec.trainer_cls(model=opts.model, reward_funcs="toy_accuracy", args=args, train_dataset=dataset)
        if not opts.real_generation:
            make_deterministic(trainer)
        return trainer

    def summary(trainer, **extra):
        return {"loss": _log_series(trainer, "loss"), "grad_norm": _log_series(trainer, "grad_norm"),
                "global_step": trainer.state.global_step,
                "recorded_logprob_steps": len(_log_series(trainer, "rollout_logprobs/recorded")),
                "record_failures": list(trainer.rollout_logprob_failures), **extra}

    ckpt_args = dict(save_strategy="steps", save_steps=opts.save_steps, save_only_model=False)
    run_dir = os.path.join(opts.workdir, "killed")
    if opts.phase == "kill":
        reference = build(os.path.join(opts.workdir, "reference"))
        reference.train()
        save_params(reference, os.path.join(opts.workdir, "reference_params.pt"))
        result = {"reference": summary(reference, params_file=os.path.join(opts.workdir, "reference_params.pt"))}
        del reference
        trainer = build(run_dir, **ckpt_args)

        class KillAfterSave(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step >= opts.kill_after:
                    trainer.accelerator.wait_for_everyone()
                    result["killed"] = summary(trainer)
                    _write(opts.out, result)
                    trainer.accelerator.wait_for_everyone()
                    os._exit(0)

        # runs after the Trainer's own on_save handling: the checkpoint folder is complete by then
        trainer.add_callback(KillAfterSave())
        trainer.train()
        raise SystemExit(f"the run was not killed after step {opts.kill_after}")
    trainer = build(run_dir, **ckpt_args)
    checkpoint = os.path.join(run_dir, f"checkpoint-{opts.kill_after}")
    trainer.train(resume_from_checkpoint=checkpoint)
    save_params(trainer, os.path.join(opts.workdir, "resumed_params.pt"))
    _write(opts.out, {"resumed": summary(trainer, shards=shard_report(trainer),
                                         params_file=os.path.join(opts.workdir, "resumed_params.pt"))})


def _write(path, payload) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, path)


def cmd_nonfinite(opts) -> None:
    """A NaN loss at optimizer step 2 of 3 under ZeRO-3: DeepSpeed's engine must discard that update.

    Records each rank's parameter shard after every step, the engine's skipped-step count, AdamW's step
    count and what the non-finite guard logged.
    """
    from transformers import TrainerCallback

    from grpo_variants import GRPOVariantTrainer

    dataset = toy.make_dataset(split="train", n=256)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = variant_args(BASE, os.path.join(opts.workdir, "nonfinite"), world, max_steps=3,
                        max_consecutive_nonfinite=3)
    trainer = GRPOVariantTrainer(model=opts.model, reward_funcs="toy_accuracy", args=args, train_dataset=dataset)
    make_deterministic(trainer)
    original = trainer._compute_loss

    def poisoned(model, inputs):
        loss = original(model, inputs)
        return loss * float("nan") if trainer.state.global_step == 1 else loss

    trainer._compute_loss = poisoned
    shards = []

    def snapshot():
        params = _unwrapped(trainer).parameters()
        return torch.cat([(p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().float().reshape(-1).clone()
                          for p in params])

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            shards.append(snapshot())

        def on_step_end(self, args, state, control, **kwargs):
            shards.append(snapshot())

    trainer.add_callback(Snapshots())
    trainer.train()
    engine = _deepspeed_engine(trainer)
    adam_steps = sorted({int(v["step"]) for v in engine.optimizer.optimizer.state.values() if "step" in v})
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, {
        "step1_changed": not torch.equal(shards[0], shards[1]),
        "nan_step_changed": not torch.equal(shards[1], shards[2]),
        "step3_changed": not torch.equal(shards[2], shards[3]),
        "finite_after": bool(torch.isfinite(shards[3]).all()),
    })
    _write(opts.out, {
        "per_rank": per_rank,
        "global_step": trainer.state.global_step,
        "engine_skipped_steps": int(engine.skipped_steps),
        "adam_steps": adam_steps,
        "skipped_logged": _log_series(trainer, "nonfinite/skipped_steps"),
        "nonfinite_logged": _log_series(trainer, "nonfinite/steps"),
    })


def main(argv=None) -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["compare", "resume", "nonfinite"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=0)
    parser.add_argument("--phase", choices=["kill", "resume"], default="kill")
    parser.add_argument("--real-generation", action="store_true")
    opts = parser.parse_args(argv)
    {"compare": cmd_compare, "resume": cmd_resume, "nonfinite": cmd_nonfinite}[opts.command](opts)


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import exit_without_teardown

    exit_without_teardown()
