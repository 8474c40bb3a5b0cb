"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO)."""

from . import functional
from .trainers import GRPOConfig, GRPOTrainer

__all__ = ["functional", "GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
