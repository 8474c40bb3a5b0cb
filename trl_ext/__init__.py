"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO)."""

from . import functional
from .trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

__all__ = [
    "functional",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
]
__version__ = "0.1.0"
