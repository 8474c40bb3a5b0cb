"""TRL trainers with the course's math swapped in; each overrides only the hook that computes it."""

from .grpo import GRPOConfig, GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
