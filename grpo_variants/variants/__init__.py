"""Built-in variants. Importing this package registers them (see ``grpo_variants.registry``)."""

from grpo_variants.variants.grpo import GRPOPaperConfig, GRPOPaperTrainer
from grpo_variants.variants.dapo import DAPOConfig, DAPOTrainer, DynamicSamplingInfo, select_groups
from grpo_variants.variants.dr_grpo import DrGRPOConfig, DrGRPOTrainer
from grpo_variants.variants.gspo import GSPOConfig, GSPOTokenConfig, GSPOTokenTrainer, GSPOTrainer
from grpo_variants.variants.fipo import FIPOConfig, FIPOTrainer
from grpo_variants.variants.mu_grpo import MuGRPOConfig, MuGRPOTrainer
from grpo_variants.variants.igrpo import IGRPOConfig, IGRPOTrainer

__all__ = ["GRPOPaperConfig", "GRPOPaperTrainer"]
__all__ += ["DrGRPOConfig", "DrGRPOTrainer", "GSPOConfig", "GSPOTrainer", "GSPOTokenConfig", "GSPOTokenTrainer"]
__all__ += ["FIPOConfig", "FIPOTrainer"]
__all__ += ["IGRPOConfig", "IGRPOTrainer"]
__all__ += ["MuGRPOConfig", "MuGRPOTrainer"]
__all__ += ["DAPOConfig", "DAPOTrainer", "DynamicSamplingInfo", "select_groups"]
