"""GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300) on Qwen2.5-Math-7B with GSM8K.

The paper's RL settings (section 4.2): group-std advantage, clip 0.2, k3 KL with beta = 0.04,
lr 1e-6, 64 samples per question, max length 1024, batch 1024 completions, one policy update per
exploration stage (so samples_per_update = 1024 and updates_per_rollout = 1: on-policy). The paper
trained DeepSeekMath-Instruct 7B on GSM8K + MATH chain-of-thought questions; this recipe uses the
Qwen2.5-Math-7B base with GSM8K's "#### answer" gold (pass --dataset for MATH).

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/grpo_qwen.py
    python recipes/grpo_qwen.py --toy                  # CPU, toy kit, about a minute
    python recipes/grpo_qwen.py --help                 # every field

8 GPUs: per_device_train_batch_size 8 -> 16 accumulation steps per update. The reference model
(beta > 0) is a second copy of the policy, sharded by ZeRO-3 like it.
"""

from _common import DatasetSpec, Recipe, main

RECIPE = Recipe(
    variant="grpo",
    model="Qwen/Qwen2.5-Math-7B",
    dataset=DatasetSpec("openai/gsm8k", config="main", prompt="question", answer="answer"),
    system_prompt="Please reason step by step, and put your final answer within \\boxed{}.",
    rewards=["math_accuracy"],
    samples_per_update=1024,  # paper: batch size 1024
    updates_per_rollout=1,  # paper: one update per exploration stage
    config=dict(
        num_generations=64,  # paper: 64 outputs per question
        max_completion_length=1024,
        per_device_train_batch_size=8,
        learning_rate=1e-6,
        beta=0.04,
        temperature=1.0,
        logging_steps=1,
        save_steps=100,
        report_to="none",
    ),
    vllm=dict(vllm_gpu_memory_utilization=0.3, vllm_max_model_length=4096),
    toy=dict(num_generations=8),
)

if __name__ == "__main__":
    main(RECIPE)
