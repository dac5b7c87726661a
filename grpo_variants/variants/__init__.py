"""Built-in variants. Importing this package registers them (see ``grpo_variants.registry``)."""

from grpo_variants.variants.grpo import GRPOPaperConfig, GRPOPaperTrainer

__all__ = ["GRPOPaperConfig", "GRPOPaperTrainer"]
