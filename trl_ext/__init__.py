"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO).

The trainers are imported on first use (``trl_ext.GRPOTrainer``, ``from trl_ext import GRPOConfig``), and so are the
submodules (``trl_ext.models``, ``trl_ext.tasks``...): importing TRL's trainers takes ~13 s on a 2-core machine,
which tools that only need ``trl_ext.functional``, ``trl_ext.runtime`` or the data and reward modules should not pay.

The rooms, from the math up (README "Layout"; imports point down, tests/test_layout.py's ``LAYERS``): ``functional``
(what the trainers compute) and the leaves ``registry`` (named choices), ``errors`` (bad user input), ``options``
(what every recipe's options share), ``machine`` (what this machine can run and reach), ``observations`` (what a
training log says), ``profiling``, ``runtime`` and ``quantized`` (bitsandbytes' 4-bit layers kept trainable on the
CPU); the registered choices of GRPO's objective ``losses`` (policy losses), ``aggregations`` (length normalization)
and ``advantages`` (advantage estimators); ``course`` (the rest of the course's API, re-exported by ``cs336``);
``rewards``, ``data`` and ``models`` (loading, the embedded model); the GRPO speed paths ``shared_prompts``/
``grpo_speed`` and the vLLM engine TRL builds for GRPO, ``vllm_engine``; ``trainers`` (the four TRL subclasses and
their configs); ``eval``; ``tasks`` (a task owns its data, reward and evaluation; ``reasoning_gym_support``:
reasoning-gym's generators and answer formats); ``compare`` (arms against upstream or each other); and the run
lifecycle of a recipe: ``run`` (output folder, resume, signals), ``report`` (results), ``cli`` (flags, checks, the
command line).
"""

import importlib

# quantized: before TRL/PEFT import bitsandbytes, it drops bitsandbytes' Hub-kernel message (see there)
from . import functional, quantized

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

__all__ = ["functional", "quantized", *_TRAINERS]
__version__ = "0.1.0"


_SUBMODULES = (
    "advantages",
    "aggregations",
    "cli",
    "compare",
    "course",
    "cs336",
    "data",
    "errors",
    "eval",
    "grpo_speed",
    "losses",
    "machine",
    "models",
    "observations",
    "options",
    "task_options",
    "packed_linear",
    "packing",
    "profiling",
    "reasoning_gym_support",
    "registry",
    "report",
    "rewards",
    "rng",
    "roofline",
    "run",
    "runtime",
    "sampling",
    "shared_prompts",
    "stop_strings",
    "tasks",
    "trainers",
    "vllm_engine",
)


def __getattr__(name: str):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRAINERS) | set(_SUBMODULES))
