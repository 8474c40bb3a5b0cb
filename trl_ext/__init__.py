"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO).

The trainers are imported on first use (``trl_ext.GRPOTrainer``, ``from trl_ext import GRPOConfig``), and so are the
submodules (``trl_ext.models``, ``trl_ext.tasks``...): importing TRL's trainers takes ~13 s on a 2-core machine,
which tools that only need ``trl_ext.functional``, ``trl_ext.runtime`` or the data and reward modules should not pay.

The rooms, from the math up, are :data:`LAYERS` (the one list of them: tests/test_layout.py checks every import of
the library against it, and ``trl_ext.<room>`` imports any of them on first use).
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


LAYERS = (  # bottom first; a module imports modules of its own layer or of a layer below, never above
    # the math (functional: what the trainers compute), and leaves that import nothing above them: named choices
    # (registry), bad user input (errors), options every recipe has (options), which options each kind of task uses
    # (task_options), what this machine can run and reach (machine), what a training log says (observations), timers
    # (profiling), threads and CPU precision (runtime), each phase's work against the machine's floor (roofline),
    # oneDNN/MKL-packed linear weights for CPU inference (packed_linear), torch.multinomial's draws vectorised
    # (sampling), the user's random generators left as they were (rng), bitsandbytes' 4-bit layers kept trainable on
    # the CPU (quantized), where a completion ends at a stop string (stop_strings)
    (
        "functional",
        "registry",
        "errors",
        "options",
        "task_options",
        "machine",
        "observations",
        "profiling",
        "runtime",
        "roofline",
        "packed_linear",
        "sampling",
        "rng",
        "quantized",
        "stop_strings",
    ),
    # the registered choices of GRPO's objective, each entry a thin call of functional: policy losses,
    # aggregations (length normalization), advantage estimators
    ("losses", "aggregations", "advantages"),
    ("course",),  # the course's helpers beyond what the trainers run (re-exported by cs336)
    ("rewards",),  # verifiable rewards, as TRL reward functions and as the course's reward_fn
    ("data", "models"),  # loaders, templates and generators; model loading, the embedded model, LoRA/QLoRA
    # the GRPO speed paths (evaluation shares the prompt-cache generation; log-prob forwards in one sequence) and the
    # vLLM engine TRL builds for it
    ("packing", "shared_prompts", "grpo_speed", "vllm_engine"),
    ("trainers",),  # the four TRL subclasses and their configs
    ("eval",),  # greedy generation and grading of whole rows (transformers or vLLM)
    # a task owns data, reward and evaluation (reasoning_gym_support: reasoning-gym's generators and answer formats);
    # cs336 re-exports the course's API
    ("reasoning_gym_support", "tasks", "cs336"),
    ("compare",),  # arms against upstream or each other
    ("run",),  # a recipe's run: output folder, resume, signals, provenance
    ("report",),  # the closing call
    ("cli",),  # the command line
    ("trl_ext",),  # the package itself: the public names, its trainers imported on first use
)
"""The layers of trl_ext, named by room: a top-level module (``cli``) or a subpackage (``compare`` for
``trl_ext.compare.*``); ``trl_ext`` is the package's ``__init__``. The one list of them: tests/test_layout.py checks
every import against it, and :data:`_SUBMODULES` (the rooms ``trl_ext.<room>`` imports on first use) is read from
it."""

_SUBMODULES = tuple(room for layer in LAYERS for room in layer if room not in ("trl_ext", *__all__))


def __getattr__(name: str):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRAINERS) | set(_SUBMODULES))
