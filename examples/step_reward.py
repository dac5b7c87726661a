"""A step reward you write yourself (process supervision), on the offline toy kit: two steps, CPU, seconds.

    python examples/step_reward.py [--output_dir outputs/step_reward] [--max_steps 2]

The toy policy answers two-digit additions (``"37+45="`` -> ``"82"``). A plain reward scores a whole
completion; a *step reward* scores its parts, and the trainer gives each token the credit of the steps
that end at or after it (``process_credit``: ``"sum"`` as DeepSeekMath, ``"min"`` as PURE). Here every
digit of the answer is a step, scored 1 when it is the right digit in its place, so a completion with the
first digit right and the second wrong is pushed up on its first token and down on its second.

A step reward keeps TRL's calling convention (prompts, completions, dataset columns as keyword
arguments) and returns, per completion, a list of ``(end_char, score)`` pairs: the step is
``text[previous_end:end_char]``. ``@step_reward`` declares it; anything else about it (timeouts, errors,
caching, weights) is the same as for a plain reward. See docs/algorithms.md, "Process supervision".
"""

from __future__ import annotations

import argparse

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, step_reward, toy


@step_reward
def digit_steps(prompts, completions, answer, **kwargs):
    """One step per character of the gold answer: 1.0 when the completion has that digit in that place."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]  # plain or chat
        steps = [(i + 1, float(i < len(text) and text[i] == digit)) for i, digit in enumerate(gold)]
        out.append([(end, score) for end, score in steps if end <= len(text)])  # steps past the text: none
    return out


def train(output_dir: str = "outputs/step_reward", max_steps: int = 2) -> GRPOVariantTrainer:
    kit = toy.prepare(task="addition")  # the warm-started toy policy (built once, then cached)
    args = GRPOVariantConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=32, num_generations=8,
        max_completion_length=6, learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, process_credit="sum",
    )
    trainer = GRPOVariantTrainer(
        model=kit.model_path,
        reward_funcs=["toy_accuracy", digit_steps],  # an outcome reward and the step reward, weight 1 each
        args=args,
        train_dataset=kit.train_dataset.select(range(256)),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/step_reward")
    parser.add_argument("--max_steps", type=int, default=2)
    cli = parser.parse_args()
    trainer = train(cli.output_dir, cli.max_steps)
    for record in trainer.state.log_history:
        if "process/steps_per_completion" in record:
            print(f"step {record['step']}: steps per completion {record['process/steps_per_completion']:.2f}, "
                  f"tokens with a non-zero advantage {record['process/nonzero_advantage_fraction']:.1%}, "
                  f"digit_steps mean {record['rewards/digit_steps/mean']:.3f}")
