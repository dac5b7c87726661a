"""iGRPO (Hatamizadeh et al. 2026, arXiv:2602.09000) on DeepSeek-R1-Distill-Qwen-7B: 4 drafts + 4 refinements.

Paper settings: per prompt, N = 4 drafts scored by the same verifier (no gradient), the best one
inserted into the prompt, G = 4 refinements trained with GRPO (the rollout budget of plain GRPO
with G = 8); beta = 0, lr 1e-6 with a cosine schedule, temperature 0.7, group-std advantage, clip
0.2, seq-mean-token-mean; evaluation single-shot from the original prompt. The refinement prompt is
``IGRPOConfig.draft_template`` (``--draft_template "...{prompt}...{draft}..."``); the paper appends
the best draft to the question, our default wording asks for an improved solution. Data: AceReason-Math
(the paper's dataset for its OpenReasoning-Nemotron-7B run; ``--dataset`` to change it).

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/igrpo_qwen.py
    python recipes/igrpo_qwen.py --toy                 # CPU, toy kit, about a minute

Batching (not given in the paper; our choice): 64 prompts x 4 refinements = 256 trained completions
per optimizer update, one update per rollout (on-policy), 256 drafts generated besides. On 8 GPUs:
per_device_train_batch_size 4 -> 8 accumulation steps. Under ZeRO-3 every rank generates the same
number of drafts in lock-step; the trainer checks at construction that (prompts per rollout x N)
splits evenly over the processes. q' holds a whole draft, so the prompt can be as long as the
completion budget: vLLM's context is sized for question + draft + refinement.

--toy keeps iGRPO's own settings (4 + 4, temperature 0.7, cosine) with the toy draft template
``{prompt}({draft}){prompt}``. The toy policy never saw any context before a question, so it cannot
use the draft (its accuracy on q' is 2-4% against ~33% single-shot on q): the toy run shows the
mechanics and the logged igrpo/* metrics, not the paper's gains.
"""

from _common import DatasetSpec, Recipe, main

from grpo_variants.variants.igrpo import TOY_DRAFT_TEMPLATE

RECIPE = Recipe(
    variant="igrpo",
    model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    dataset=DatasetSpec(
        "nvidia/AceReason-Math",
        prompt="problem",
        answer="answer",
        template="{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    ),
    rewards=["math_accuracy"],  # the same verifier selects drafts and scores refinements
    samples_per_update=256,  # trained (stage-2) completions per optimizer update
    updates_per_rollout=1,
    config=dict(
        num_drafts=4,
        num_generations=4,
        max_completion_length=8192,
        per_device_train_batch_size=4,
        learning_rate=1e-6,
        lr_scheduler_type="cosine",
        temperature=0.7,
        beta=0.0,
        num_train_epochs=1,
        logging_steps=1,
        save_steps=100,
        report_to="none",
    ),
    vllm=dict(vllm_gpu_memory_utilization=0.4, vllm_max_model_length=8192 * 2 + 1024),
    toy=dict(
        num_drafts=4,
        num_generations=4,
        temperature=0.7,
        lr_scheduler_type="cosine",
        draft_template=TOY_DRAFT_TEMPLATE,
    ),
    description="iGRPO: best-of-N draft inserted into the prompt, GRPO on the refinements",
)

if __name__ == "__main__":
    main(RECIPE)
