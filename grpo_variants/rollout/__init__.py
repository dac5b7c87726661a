"""Rollout components: the machinery variants compose around TRL's own rollout.

Each wraps ``trl.GRPOTrainer._generate_and_score_completions`` (or a loss-side hook) and never
copies it; see docs/architecture.md#rollout-components.

* ``sampling``      dynamic sampling (drop zero-signal groups, re-sample, carry the surplus)
* ``stages``        stage rollouts (one large rollout, many updates on it; µ-GRPO)
* ``two_stage``     draft -> rewrite rollouts (iGRPO)
* ``adaptive_clip`` clip bounds chosen from each update's own ratios
* ``batch``         the padding rule and concatenation of TRL rollout dicts
* ``logprobs``      behaviour log-probs recorded while HF ``generate`` samples
* ``loader``        a generation batch's rows fetched and moved once
"""
