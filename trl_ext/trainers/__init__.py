"""TRL trainers with the course's math swapped in; each overrides only the hook that computes it."""

from trl_ext.trainers.dpo import DPOConfig, DPOTrainer
from trl_ext.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from trl_ext.trainers.reward import RewardConfig, RewardTrainer
from trl_ext.trainers.sft import SFTConfig, SFTTrainer

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
