"""FIPO (arXiv:2603.19835) on Qwen2.5-32B with DAPO-Math-17k: the DAPO recipe plus future-KL weights.

From the paper and the DAPO recipe it builds on: clip 0.2 / 0.28, dual clip c = 10 with the
response drop, token-mean loss, no KL, dynamic sampling, overlong filtering and DAPO's soft overlong
punishment (L_max = 20,480, L_cache = 4,096, added automatically by the variant), +1/-1 rule reward,
16 samples per prompt, 512 prompts per rollout in 16 mini-batches of 32 prompts (512 completions per
update, 16 updates per rollout: the staleness FIPO's weights feed on), AdamW lr 1e-6 constant after
20 warm-up steps, weight decay 0.1, gradient clipping 1.0, temperature 1.0. FIPO: tau = 32,
weights clipped to [1.0, 1.2] (``--fipo_clip_low 0.8`` for the symmetric option).

    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 64 recipes/fipo_qwen32b.py
    python recipes/fipo_qwen32b.py --toy               # CPU, toy kit, about a minute

Scale: the reference runs used many nodes (verl's 32B DAPO recipe: 16 nodes x 8 GPUs). With
per_device_train_batch_size 1, 64 processes accumulate 8 micro-steps per update; on fewer GPUs the
accumulation grows so that an update still holds 512 completions.
"""

from _common import DatasetSpec, Recipe, main

RECIPE = Recipe(
    variant="fipo",
    model="Qwen/Qwen2.5-32B",
    dataset=DatasetSpec("BytedTsinghua-SIA/DAPO-Math-17k", prompt="prompt", answer="reward_model.ground_truth"),
    rewards=["math_accuracy_pm1"],  # DAPO's +1 / -1 rule reward; the overlong penalty is appended by the variant
    samples_per_update=512,  # 32 prompts x 16 samples
    updates_per_rollout=16,  # 512 prompts per rollout
    config=dict(
        num_generations=16,
        max_completion_length=20480,
        overlong_buffer_len=4096,
        per_device_train_batch_size=1,
        learning_rate=1e-6,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=20,
        weight_decay=0.1,
        max_grad_norm=1.0,
        temperature=1.0,
        top_p=1.0,
        logging_steps=1,
        save_steps=20,
        report_to="none",
    ),
    vllm=dict(vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=22528),
    toy=dict(overlong_buffer_len=None),  # 20% of the toy's 6-token budget
)

if __name__ == "__main__":
    main(RECIPE)
