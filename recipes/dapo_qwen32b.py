"""DAPO (Yu et al. 2025, arXiv:2503.14476) on Qwen2.5-32B with DAPO-Math-17k, as the paper trains it.

Hyper-parameters from the paper and verl's 32B DAPO reference recipe: clip-higher 0.2 / 0.28, dual
clip c = 10, token-level loss (token-mean over the whole batch), no KL (beta 0), +1 / -1 rule
reward, dynamic sampling (groups whose answers are all right or all wrong are dropped and more
prompts are generated, at most 10 generation rounds per batch), overlong filtering (truncated
completions get no gradient) and soft overlong punishment (eq. 13: 16,384 expected + 4,096 soft
buffer = 20,480 max tokens; the variant appends the penalty reward itself), 16 samples per prompt,
512 prompts per rollout split into 16 mini-batches of 512 completions (16 updates per rollout),
AdamW lr 1e-6 constant after 20 warm-up steps, weight decay 0.1, gradient clipping 1.0,
temperature 1.0 (top-p 1.0) for training, bf16, gradient checkpointing, vLLM rollouts (colocated,
sleeping during the update) when vLLM is installed. verl's recipe draws 1,536 prompts per
generation round; here each round draws 512 (one rollout's worth) and repeats until 512 groups
qualify, so its 3x over-sampling corresponds to about 3 rounds.

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/dapo_qwen32b.py
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 64 recipes/dapo_qwen32b.py \\
        --model Qwen/Qwen2.5-32B --output_dir outputs/dapo-32b
    python recipes/dapo_qwen32b.py --toy                  # same code path: toy kit on CPU, about a minute

Evaluation as in the paper (AIME 2024, avg@32, temperature 1.0, top-p 0.7), a separate step on a
saved model (vLLM with tensor parallelism when installed, HF generate otherwise)::

    python recipes/dapo_qwen32b.py --eval_only outputs/dapo [--eval_dataset BytedTsinghua-SIA/AIME-2024]

With ``--toy`` the same evaluation runs on the toy held-out set after training (avg@4, HF generate).
The paper reports AIME24 avg@32 = 50 for Qwen2.5-32B (DeepSeek-R1-Zero-Qwen-32B: 47, with twice the
steps). Scale: verl's 32B run used 16 nodes x 8 GPUs; with per_device_train_batch_size 1 the
gradient accumulation grows on fewer GPUs so that an update still holds 512 completions.
"""

from __future__ import annotations

import argparse
import sys

from _common import DatasetSpec, Recipe, is_main_process, main

RECIPE = Recipe(
    variant="dapo",
    model="Qwen/Qwen2.5-32B",
    dataset=DatasetSpec("BytedTsinghua-SIA/DAPO-Math-17k", prompt="prompt", answer="reward_model.ground_truth"),
    rewards=["math_accuracy_pm1"],  # +1 correct / -1 wrong; overlong_penalty is appended by the variant
    samples_per_update=512,  # mini-batch: 32 prompts x 16 samples
    updates_per_rollout=16,  # rollout: 512 prompts x 16 samples = 8,192 completions
    config=dict(
        num_generations=16,
        max_completion_length=20480,  # L_max
        overlong_penalty=True,
        overlong_buffer_len=4096,  # L_cache
        epsilon=0.2,
        epsilon_high=0.28,
        clip_ratio_c=10.0,
        beta=0.0,
        loss_type="dapo",
        mask_truncated_completions=True,
        dynamic_sampling=True,
        max_num_gen_batches=10,
        per_device_train_batch_size=1,
        learning_rate=1e-6,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=20,
        weight_decay=0.1,
        max_grad_norm=1.0,
        temperature=1.0,
        top_p=1.0,
        gradient_checkpointing=True,  # bf16 is on by default with CUDA (GRPOVariantConfig / TRL)
        logging_steps=1,
        save_steps=20,
        report_to="none",
    ),
    vllm=dict(vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=22528),
    toy=dict(num_generations=8, overlong_buffer_len=None, bf16=False, gradient_checkpointing=False),
    description=__doc__,
)

EVAL = DatasetSpec("BytedTsinghua-SIA/AIME-2024", prompt="prompt", answer="reward_model.ground_truth")
EVAL_SAMPLES, EVAL_TEMPERATURE, EVAL_TOP_P = 32, 1.0, 0.7


def evaluate_avg_at_k(model_path: str, dataset, reward: str, k: int, temperature: float = EVAL_TEMPERATURE,
                      top_p: float = EVAL_TOP_P, max_tokens: int = 20480, use_vllm: bool | None = None) -> float:
    """avg@k: the mean reward (1 correct / 0 wrong) over k sampled answers per prompt."""
    from transformers import AutoTokenizer

    from _common import vllm_available
    from grpo_variants import get_reward

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list)
               else p for p in dataset["prompt"]]
    answers = list(dataset["answer"])
    use_vllm = vllm_available() if use_vllm is None else use_vllm
    if use_vllm:
        import torch
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_path, tensor_parallel_size=torch.cuda.device_count(), max_model_len=max_tokens + 2048)
        sampling = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        outputs = llm.generate(prompts, sampling)
        completions = [[c.text for c in out.outputs] for out in outputs]
    else:
        import torch
        from transformers import AutoModelForCausalLM

        from grpo_variants.runtime.distributed import zero3_init_disabled

        with zero3_init_disabled():  # whole on this rank, even after a ZeRO-3 training run in this process
            model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        completions = []
        with torch.no_grad():
            for start in range(0, len(prompts), 64):
                batch = prompts[start : start + 64]
                enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left",
                                add_special_tokens=False).to(model.device)
                out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=None,
                                     max_new_tokens=max_tokens, num_return_sequences=k,
                                     pad_token_id=tokenizer.pad_token_id, synced_gpus=False)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                completions += [texts[i * k : (i + 1) * k] for i in range(len(batch))]
    score = get_reward(reward)
    flat = [c for group in completions for c in group]
    gold = [a for a in answers for _ in range(k)]
    values = score(prompts=[p for p in prompts for _ in range(k)], completions=flat, answer=gold)
    return sum(max(float(v or 0.0), 0.0) for v in values) / max(len(values), 1)


def run(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--eval_only")
    parser.add_argument("--eval_dataset", default=EVAL.path)
    parser.add_argument("--eval_samples", type=int, default=None)
    opts, rest = parser.parse_known_args(argv)
    toy_mode = "--toy" in rest
    if opts.eval_only:
        from _common import load_prompts

        spec = EVAL if opts.eval_dataset == EVAL.path else DatasetSpec(opts.eval_dataset, prompt="prompt",
                                                                       answer="reward_model.ground_truth")
        k = opts.eval_samples or EVAL_SAMPLES
        accuracy = evaluate_avg_at_k(opts.eval_only, load_prompts(spec), "math_accuracy", k)
        print(f"[dapo] {spec.path} avg@{k} (T={EVAL_TEMPERATURE}, top-p {EVAL_TOP_P}): {accuracy:.1%}")
        return accuracy
    if toy_mode and not any(a == "--reward" or a.startswith("--reward=") for a in rest):
        rest += ["--reward", "toy_accuracy_pm1"]  # DAPO's +1 / -1 rule reward on the toy task
    trainer = main(RECIPE, rest)
    if toy_mode and is_main_process():
        from grpo_variants.tasks import toy

        kit_eval = toy.make_dataset(split="eval").select(range(200))
        k = opts.eval_samples or 4
        accuracy = evaluate_avg_at_k(trainer.args.output_dir, kit_eval, "toy_accuracy", k, max_tokens=6,
                                     use_vllm=False)
        print(f"[dapo] toy held-out avg@{k} (T={EVAL_TEMPERATURE}, top-p {EVAL_TOP_P}): {accuracy:.1%}")
    return trainer


if __name__ == "__main__":
    run()
