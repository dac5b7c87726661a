"""The TRL contract, field by field: every ``trl.GRPOConfig`` field honoured, refused (with the error) or changed
by a variant (with the announcement).

:func:`config_table` inspects ``trl.GRPOConfig``'s dataclass fields, the registered variants' config
classes and the registry of refusals below, and writes the Markdown table that ``docs/trl-users.md``
carries between its ``BEGIN generated`` / ``END generated`` markers (``tests/test_trl_contract.py`` checks
that the committed table equals the generated one, and that every refusal's example raises its error)::

    python -m grpo_variants.trl_contract --write docs/trl-users.md

"Honoured" means the field reaches TRL's code unchanged and acts as in ``trl.GRPOTrainer``; on our composed
loss path the fields TRL's loss reads are mapped onto :mod:`grpo_variants.losses` (see ``HONOURED_BY_OUR_LOSS``).
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, fields

__all__ = ["BASE_NOTES", "HONOURED_BY_OUR_LOSS", "REFUSALS", "Refusal", "config_table", "write_table"]

BEGIN = "<!-- BEGIN generated: python -m grpo_variants.trl_contract --write docs/trl-users.md -->"
END = "<!-- END generated -->"


@dataclass(frozen=True)
class Refusal:
    """A TRL field value refused at construction: when, an example that raises, and words of the error."""

    field: str
    when: str
    config: str  # the config class the example builds ("GRPOVariantConfig" or a variant's name)
    example: dict
    error: str  # a part of the ConfigError's message


# Every ConfigError a TRL GRPOConfig field can raise at construction (TRL's own ValueErrors are kept, as
# ConfigError with TRL's message, and not listed). Each example is built by the contract test.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("loss_type", "cispo / sapo / luspo / vespo with a variant config or an explicit `aggregation` (our "
            "PPO-clip loss would train instead)", "dapo", dict(loss_type="cispo"), "does not compose"),
    Refusal("loss_type", "a composed loss type other than the config's default while the variant fixes another "
            "`aggregation` (one of the two would be ignored)", "dapo", dict(loss_type="grpo"), "one would be ignored"),
    Refusal("loss_type", "not a TRL 1.16 loss type", "GRPOVariantConfig", dict(loss_type="ppo"),
            "not a TRL 1.16 loss type"),
    Refusal("steps_per_generation", "not a multiple of `gradient_accumulation_steps` with `aggregation="
            "'token_mean'` (an update would straddle two rollouts)", "dapo",
            dict(steps_per_generation=3, gradient_accumulation_steps=2, num_generations=4,
                 per_device_train_batch_size=8), "straddle two rollouts"),
    Refusal("steps_per_generation", "set together with `generation_batch_size`", "GRPOVariantConfig",
            dict(steps_per_generation=2, generation_batch_size=16), "set only one"),
    Refusal("num_generations", "< 2 (no group to normalise within)", "GRPOVariantConfig", dict(num_generations=1),
            "must be >= 2"),
    Refusal("per_device_train_batch_size", "a generation batch that is not a multiple of `num_generations`",
            "GRPOVariantConfig", dict(per_device_train_batch_size=3, num_generations=4), "not divisible by "
            "num_generations"),
    Refusal("use_adaptive_entropy", "True with a variant config (its composed loss has no adaptive controller)",
            "grpo", dict(use_adaptive_entropy=True), "use_adaptive_entropy"),
    Refusal("use_adaptive_entropy", "True with one of our loss options (`clip_ratio_c`, `veto_scope`, `fipo`, "
            "`kl_estimator`, `aggregation`): TRL's own loss would ignore them", "GRPOVariantConfig",
            dict(use_adaptive_entropy=True, clip_ratio_c=10.0), "cannot honour"),
    Refusal("epsilon_high", "< `epsilon` (clip-higher needs the upper width >= the lower)", "GRPOVariantConfig",
            dict(epsilon=0.3, epsilon_high=0.2), "clip-higher needs"),
    Refusal("multi_objective_aggregation", "`normalize_then_sum` with our `kl_in_reward=True` (checked by the "
            "trainer)", "", {}, "kl_in_reward=True needs multi_objective_aggregation"),
    Refusal("use_vllm", "True with our `behaviour_logprobs='rollout'` (vLLM returns its own log-probs)",
            "GRPOVariantConfig", dict(use_vllm=True, behaviour_logprobs="rollout"), "behaviour_logprobs='rollout'"),
    Refusal("vllm_enable_sleep_mode", "True in colocate mode on a machine without a GPU (vLLM's CPU backend has no "
            "sleep mode; docs/vllm.md)", "GRPOVariantConfig",
            dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True), "no sleep mode on its CPU backend"),
    Refusal("vllm_server_base_url", "not this machine, in server mode without a GPU (the weight sync streams over "
            "loopback to `grpo-variants vllm-serve`; docs/vllm.md)", "GRPOVariantConfig",
            dict(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://10.0.0.2:8000"),
            "syncs weights by a tensor stream over loopback"),
    Refusal("vllm_server_host", "not this machine, in server mode without a GPU (as `vllm_server_base_url`)",
            "GRPOVariantConfig", dict(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2"),
            "syncs weights by a tensor stream over loopback"),
)

# TRL fields TRL's loss reads, and what our composed loss does with them (docs/algorithms.md has the formulas).
HONOURED_BY_OUR_LOSS = {
    "loss_type": "grpo / bnpo / dr_grpo / dapo: our aggregation of the same name (dapo: per update, announced "
                 "where TRL's rollout average differs); others: TRL's own loss",
    "epsilon": "lower clip width", "epsilon_high": "upper clip width", "delta": "ratio cap of the unclipped branch "
    "(TRL's two-sided clip: for A < 0 equal to a dual clip at c = delta)",
    "beta": "KL coefficient", "use_bias_correction_kl": "ratio-weighted KL (`kl_ratio_correction`)",
    "importance_sampling_level": "ratio level (token / sequence)", "scale_rewards": "advantage estimator",
    "top_entropy_quantile": "high-entropy token mask (TRL's get_high_entropy_mask)",
    "off_policy_mask_threshold": "TRL's off-policy sequence mask (get_off_policy_mask), against the sampling "
                                 "log-probs (see the rule below)",
    "vllm_importance_sampling_correction": "TRL's per-token IS ratio as a token weight",
    "entropy_coef": "TRL's static entropy bonus; logs `policy_loss`, `entropy_coef`",
    "mask_truncated_completions": "TRL's completion mask", "router_aux_loss_coef": "added as TRL adds it",
    "num_iterations": "TRL's buffer reuse", "steps_per_generation": "TRL's buffer; per-update token counts",
}


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        try:
            return f.default_factory()
        except Exception:  # noqa: BLE001
            return "(factory)"
    return "(required)"


def _show(value) -> str:
    from enum import Enum

    if isinstance(value, Enum):
        value = value.value
    text = repr(value)
    return "`" + (text if len(text) <= 40 else text[:37] + "...") + "`"


# The base config's own departures from TRL's defaults (GRPOVariantConfig, no variant), announced in one line.
BASE_NOTES = {
    "bf16": "None resolves to False without CUDA (TRL: True, which fails or crawls on CPU), announced",
    "gradient_checkpointing": "default None: on with CUDA (TRL's True), off without, announced; passed to "
                              "transformers as `activation_checkpointing`",
}


def _variant_changes() -> dict[str, list[tuple[str, object]]]:
    """TRL field -> [(variant, its default)] where a registered variant's config default differs from the base
    config's (which is TRL's, :data:`BASE_NOTES` aside). A None default that TRL does not have means "derived"."""
    from trl import GRPOConfig

    import grpo_variants.variants  # noqa: F401  (registers the variants)
    from grpo_variants.config import GRPOVariantConfig
    from grpo_variants.registry import _VARIANTS

    trl_names = {f.name for f in fields(GRPOConfig) if f.init}
    base = {f.name: _default(f) for f in fields(GRPOVariantConfig) if f.init}
    changes: dict[str, list[tuple[str, object]]] = {}
    for name in sorted(_VARIANTS):
        cls = _VARIANTS[name].config_cls
        for f in fields(cls):
            if f.init and f.name in trl_names and _default(f) != base[f.name]:
                changes.setdefault(f.name, []).append((name, _default(f)))
    return changes


def config_table() -> str:
    """The Markdown section: one row per ``trl.GRPOConfig`` field (GRPO's own, then transformers' inherited)."""
    from trl import GRPOConfig

    trl_fields = [f for f in fields(GRPOConfig) if f.init]
    own = [f for f in trl_fields if f.name in GRPOConfig.__annotations__ or f.name in _base_annotations()]
    inherited = [f for f in trl_fields if f not in own]
    changes = _variant_changes()
    refusals: dict[str, list[Refusal]] = {}
    for r in REFUSALS:
        refusals.setdefault(r.field, []).append(r)

    def row(f) -> str:
        status = []
        if f.name in BASE_NOTES:
            status.append(BASE_NOTES[f.name])
        for r in refusals.get(f.name, []):
            status.append(f"**refused** when {r.when}: ConfigError \"…{r.error}…\"")
        if f.name in changes:
            listed = ", ".join(f"{v} {'(derived)' if d is None else _show(d)}" for v, d in changes[f.name])
            status.append(f"changed by {listed} (announced)")
        if f.name in HONOURED_BY_OUR_LOSS:
            status.append("our loss: " + HONOURED_BY_OUR_LOSS[f.name])
        text = "; ".join(status) if status else "honoured"
        return f"| `{f.name}` | {_show(_default(f))} | {text} |"

    lines = [
        BEGIN,
        "",
        f"`trl.GRPOConfig` has {len(trl_fields)} fields: {len(own)} of GRPO's own, {len(inherited)} inherited "
        "from `transformers.TrainingArguments`. \"Honoured\": it reaches TRL's code unchanged. \"Announced\": the "
        "trainer logs one line at construction (`grpo-variants <variant>: defaults differing from TRL's: ...`). "
        "Every refusal is a `ConfigError` at construction, before any model is loaded.",
        "",
        "| field | TRL default | with grpo-variants |",
        "|---|---|---|",
        *[row(f) for f in own],
        "",
        "Inherited from `transformers.TrainingArguments`:",
        "",
        "| field | TRL default | with grpo-variants |",
        "|---|---|---|",
        *[row(f) for f in inherited],
        "",
        END,
    ]
    return "\n".join(lines)


def _base_annotations() -> set[str]:
    try:
        from trl.trainer.base_config import _BaseConfig

        return set(_BaseConfig.__annotations__)
    except Exception:  # noqa: BLE001 - another TRL layout: GRPOConfig's own annotations only
        return set()


def write_table(path: str) -> bool:
    """Replace the generated section of ``path`` (between the markers); True when the file changed."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + config_table() + text[end:]
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":  # python -m grpo_variants.trl_contract [--write docs/trl-users.md]
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        print("updated" if write_table(sys.argv[2]) else "up to date", sys.argv[2])
    else:
        print(config_table())
