"""GSPO (Zheng et al. 2025, arXiv:2507.18071) on the Qwen3-30B-A3B-Base mixture of experts.

From the paper: sequence-level ratio and clipping with eps_low = 3e-4, eps_high = 4e-4, no KL,
per-sequence mean, and each rollout split into 4 mini-batches (updates_per_rollout = 4). GSPO needs
no "Routing Replay" for MoE models: the sequence likelihood is robust to expert-routing changes
between the rollout and the update, which is why it is the family's choice for MoE.

Not published, our choices (override them on the command line): DAPO-Math-17k prompts with the
+1/0 math reward, 16 samples per prompt, 1024 completions per update (rollout of 4096 completions
= 256 prompts), max completion 8192 tokens, lr 1e-6 constant.

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/gspo_qwen3_moe.py
    accelerate launch --config_file recipes/accelerate/zero3_offload.yaml recipes/gspo_qwen3_moe.py  # fewer GPUs
    python recipes/gspo_qwen3_moe.py --toy             # CPU, toy kit, about a minute

8 x 80 GB GPUs: per_device_train_batch_size 4 -> 32 accumulation steps per update; vLLM runs
colocated with tensor parallelism 4 (the bf16 weights are about 61 GB).
"""

from _common import DatasetSpec, Recipe, main

RECIPE = Recipe(
    variant="gspo",
    model="Qwen/Qwen3-30B-A3B-Base",
    dataset=DatasetSpec("BytedTsinghua-SIA/DAPO-Math-17k", prompt="prompt", answer="reward_model.ground_truth"),
    rewards=["math_accuracy"],
    samples_per_update=1024,
    updates_per_rollout=4,  # paper: 4 mini-batches per rollout
    config=dict(
        num_generations=16,
        max_completion_length=8192,
        per_device_train_batch_size=4,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        temperature=1.0,
        logging_steps=1,
        save_steps=50,
        report_to="none",
    ),
    vllm=dict(vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.4, vllm_max_model_length=10240),
)

if __name__ == "__main__":
    main(RECIPE)
