"""Dr.GRPO (Liu et al. 2025, arXiv:2503.20783) on Qwen2.5-Math-7B, as the authors' Oat-Zero script runs it.

Reproduced from the paper and its reference script (sail-sg/understand-r1-zero,
examples/qwen2.5-math-7b.sh, Qwen-Math template): group-mean advantage, constant normaliser
L = max_completion_length = 3000, clip 0.2, beta 0, lr 1e-6 constant, temperature 1.0, 8 samples
per question, 128 questions per rollout (1024 completions), train batch 128 completions: 8
optimizer updates per rollout. Data: MATH questions of levels 3-5 (the authors' 8k set lives in
their repository; this recipe filters MATH-lighteval's train split by level, pass --dataset to use
theirs). Oat uses ZeRO-2 with the reference model offloaded; there is no reference model here
(beta = 0), ZeRO-3 works as well.

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/dr_grpo_qwen.py
    python recipes/dr_grpo_qwen.py --toy               # CPU, toy kit, about a minute

8 GPUs: per_device_train_batch_size 2 -> 8 accumulation steps per update, 64 micro-steps per rollout.
"""

from _common import DatasetSpec, Recipe, main

RECIPE = Recipe(
    variant="dr_grpo",
    model="Qwen/Qwen2.5-Math-7B",
    dataset=DatasetSpec(
        "DigitalLearningGmbH/MATH-lighteval",
        prompt="problem",
        answer="solution",  # the gold is the \boxed{} of the reference solution
        filter=lambda row: row["level"] in ("Level 3", "Level 4", "Level 5"),
    ),
    system_prompt="Please reason step by step, and put your final answer within \\boxed{}.",  # Qwen-Math template
    rewards=["math_accuracy"],  # Oat's math oracle: 1 correct, 0 otherwise
    samples_per_update=128,  # Oat: train_batch_size 128
    updates_per_rollout=8,  # Oat: rollout 128 questions x 8 samples = 1024 completions / 128
    config=dict(
        num_generations=8,
        max_completion_length=3000,  # L of the constant normaliser
        per_device_train_batch_size=2,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        temperature=1.0,
        top_p=1.0,
        logging_steps=1,
        save_steps=100,
        report_to="none",
    ),
    vllm=dict(vllm_gpu_memory_utilization=0.35, vllm_max_model_length=4096),  # Oat: vllm_gpu_ratio 0.35
)

if __name__ == "__main__":
    main(RECIPE)
