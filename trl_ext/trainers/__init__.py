"""TRL trainers with the course's math swapped in; each overrides only the hook that computes it."""

from .dpo import DPOConfig, DPOTrainer
from .grpo import GRPOConfig, GRPOTrainer
from .reward import RewardConfig, RewardTrainer
from .sft import SFTConfig, SFTTrainer

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
]
