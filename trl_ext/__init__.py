"""trl_ext: TRL trainers with the exact math of Stanford CS336 assignment 5 (GRPO, SFT, reward models, DPO).

The trainers are imported on first use (``trl_ext.GRPOTrainer``, ``from trl_ext import GRPOConfig``), and so are the
submodules (``trl_ext.models``, ``trl_ext.tasks``...): importing TRL's trainers takes ~13 s on a 2-core machine,
which tools that only need ``trl_ext.functional``, ``trl_ext.runtime`` or the data and reward modules should not pay.

The rooms, from the math up, are :data:`LAYERS` (the one list of them: tests/test_layout.py checks every import of
the library against it, and ``trl_ext.<room>`` imports any of them on first use).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys

# quantized: before TRL/PEFT import bitsandbytes, it drops bitsandbytes' Hub-kernel message (see there)
from trl_ext import functional, quantized

_TRAINERS = tuple(f"{kind}{part}" for kind in ("DPO", "GRPO", "Reward", "SFT") for part in ("Config", "Trainer"))

__all__ = ["functional", "quantized", *_TRAINERS]
__version__ = "0.1.0"


LAYERS = (  # bottom first; a module imports modules of its own layer or of a layer below, never above
    # the math (functional: what the trainers compute), and leaves that import nothing above them: named choices and
    # their one loader (registry), bad user input (errors), options every recipe has (options), what this machine can
    # run and reach (machine), threads and CPU precision (runtime), bitsandbytes' 4-bit layers kept trainable on the
    # CPU (quantized), where a completion ends at a stop string (stop_strings)
    ("functional", "registry", "errors", "logs", "options", "machine", "runtime", "quantized", "stop_strings"),
    ("speed",),  # exact CPU savings: shared prompts, one-sequence forwards, packed weights, sampling, rng
    ("measurement",),  # timers, the roofline (each phase against the machine's floor), what a training log says
    # GRPO's objective: policy losses, aggregations, advantage estimators, the course's helpers, TRL's option names
    ("objective",),
    ("rewards",),  # verifiable rewards, as TRL reward functions and as the course's reward_fn
    ("data", "models"),  # loaders, templates and generators; model loading, the embedded model, LoRA/QLoRA
    ("trainers",),  # the four TRL subclasses and their configs; the GRPO trainer whole (trainers.grpo)
    # greedy generation and grading of whole rows (transformers or vLLM); held-out evaluation every N steps and
    # rollout samples as TRL callbacks
    ("eval", "callbacks"),
    # a task owns data, reward and evaluation (one loader, the only dispatch on a task's name); cs336 re-exports the
    # course's API
    ("tasks", "cs336"),
    ("compare",),  # arms against upstream or each other
    ("run",),  # a recipe's run: output folder, resume, signals, provenance
    ("report",),  # the closing call
    ("cli",),  # the command line
    ("trl_ext",),  # the package itself: the public names, its trainers imported on first use
)
"""The layers of trl_ext, named by room: a top-level module (``cli``) or a subpackage (``objective`` for
``trl_ext.objective.*``); ``trl_ext`` is the package's ``__init__``. The one list of them: tests/test_layout.py checks
every import against it, and :data:`_SUBMODULES` (the rooms ``trl_ext.<room>`` imports on first use) is read from
it."""

MOVED = {
    # module as it was named until round 5 -> where it lives now; the old name imports the same module object (so
    # ``import trl_ext.losses``, ``mock.patch("trl_ext.grpo_speed....")`` and pickles naming an old path keep working)
    "trl_ext.losses": "trl_ext.objective.losses",
    "trl_ext.aggregations": "trl_ext.objective.aggregations",
    "trl_ext.advantages": "trl_ext.objective.advantages",
    "trl_ext.course": "trl_ext.objective.course",
    "trl_ext.trainers.grpo_options": "trl_ext.objective.trl_names",
    "trl_ext.task_options": "trl_ext.tasks.options",
    "trl_ext.reasoning_gym_support": "trl_ext.tasks.reasoning_gym",
    "trl_ext.trainers.grpo_config": "trl_ext.trainers.grpo.config",
    "trl_ext.trainers.grpo_terms": "trl_ext.trainers.grpo.terms",
    "trl_ext.trainers.dynamic_sampling": "trl_ext.trainers.grpo.dynamic_sampling",
    "trl_ext.grpo_speed": "trl_ext.trainers.grpo.speed",
    "trl_ext.vllm_engine": "trl_ext.trainers.grpo.vllm",
    "trl_ext.shared_prompts": "trl_ext.speed.shared_prompts",
    "trl_ext.packing": "trl_ext.speed.packing",
    "trl_ext.packed_linear": "trl_ext.speed.packed_linear",
    "trl_ext.sampling": "trl_ext.speed.sampling",
    "trl_ext.rng": "trl_ext.speed.rng",
    "trl_ext.roofline": "trl_ext.measurement.roofline",
    "trl_ext.profiling": "trl_ext.measurement.profiling",
    "trl_ext.observations": "trl_ext.measurement.observations",
}
"""Old module names and their rooms now: :class:`_MovedModules` makes each old name import the module it became."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name (a key of :data:`MOVED`) as the very module it became: ``sys.modules`` gets the
    one module object under both names, so attributes, ``mock.patch`` targets and pickled classes agree."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # importlib is about to give the module the old name's spec
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # it ran when imported under its own name: its spec back


sys.meta_path.append(_MovedModules())

_SUBMODULES = tuple(room for layer in LAYERS for room in layer if room not in ("trl_ext", *__all__))


def __getattr__(name: str):
    if name in _TRAINERS:
        from trl_ext import trainers

        return getattr(trainers, name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if f"{__name__}.{name}" in MOVED:
        return importlib.import_module(MOVED[f"{__name__}.{name}"])
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRAINERS) | set(_SUBMODULES))
