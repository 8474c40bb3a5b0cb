"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO).

The trainers are imported on first use (``trl_ext.GRPOTrainer``, ``from trl_ext import GRPOConfig``): importing TRL's
trainers takes ~13 s on a 2-core machine, which tools that only need ``trl_ext.functional``, ``trl_ext.runtime`` or
the data and reward modules should not pay.
"""

from . import functional

_TRAINERS = (
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
)

__all__ = ["functional", *_TRAINERS]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRAINERS))
