"""Variant registry: names ("grpo", "dapo", ...) -> trainer and config classes.

``get_variant("dapo")`` returns a :class:`VariantSpec` whose ``trainer_cls`` / ``config_cls`` the
CLI, the lab and user code instantiate. Variants register themselves with
:func:`register_variant` on their trainer class.

This module is only the table: it imports no variant. The built-in variants are registered when the
package is imported (``grpo_variants/__init__.py`` imports :mod:`grpo_variants.variants`, and Python
runs a package's ``__init__`` before any of its modules), so the table is complete whenever
:func:`get_variant` can be called, and ``registry`` -> ``variants`` -> ``registry`` is not a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_variants.errors import UnknownVariantError


@dataclass(frozen=True)
class VariantSpec:
    name: str
    trainer_cls: type
    config_cls: type
    description: str
    paper: str


_VARIANTS: dict[str, VariantSpec] = {}

# What a run with no variant (``GRPOVariantTrainer`` with ``GRPOVariantConfig``, TRL's defaults) is called in the
# console, the reward plot and the model card: it is TRL's GRPO, not the ``grpo`` variant (whose defaults are
# the DeepSeekMath paper's: beta 0.04, the sequence-mean loss).
NO_VARIANT_LABEL = "TRL GRPO (no variant)"


def run_label(variant_name: str | None) -> str:
    """The name a run is shown under: its variant's name, or :data:`NO_VARIANT_LABEL` without one."""
    return variant_name or NO_VARIANT_LABEL


def register_variant(name: str, *, description: str, paper: str = ""):
    """Class decorator for a trainer subclass that has a ``config_class`` attribute."""

    def decorator(trainer_cls):
        trainer_cls.variant_name = name
        _VARIANTS[name] = VariantSpec(
            name=name,
            trainer_cls=trainer_cls,
            config_cls=trainer_cls.config_class,
            description=description,
            paper=paper,
        )
        return trainer_cls

    return decorator


def get_variant(name: str) -> VariantSpec:
    """The registered variant ``name``; :class:`UnknownVariantError` lists the known names otherwise."""
    key = name.strip().lower().replace("-", "_").replace("µ", "mu").replace("μ", "mu")
    if key not in _VARIANTS:
        raise UnknownVariantError(
            f"Unknown variant {name!r}. Registered variants: {', '.join(sorted(_VARIANTS))}. "
            "Register a new one with @grpo_variants.register_variant('name', description=...)."
        )
    return _VARIANTS[key]


def list_variants() -> list[VariantSpec]:
    """All registered variants, sorted by name."""
    return [_VARIANTS[k] for k in sorted(_VARIANTS)]
