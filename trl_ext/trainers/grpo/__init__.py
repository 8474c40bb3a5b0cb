"""The GRPO trainer, whole: the trainer (``trainer``: TRL's ``GRPOTrainer`` with the course's loss), its config
(``config``), upstream's extra loss terms (``terms``), dynamic sampling (``dynamic_sampling``), the speed paths
(``speed``: shared prompts, one-sequence log-prob forwards, packed weights and vectorised sampling wired into TRL's
generation) and the vLLM engine TRL builds (``vllm``).

``trl_ext.trainers.grpo`` was one module until round 6: its names (``GRPOTrainer``, ``GRPOConfig``,
``generation_grouping_problem``...) still import from here, on first use (TRL's trainer takes seconds to import), and
a config pickled then (``trl_ext.trainers.grpo.GRPOConfig`` in a checkpoint's ``training_args.bin``) still loads.
"""

import importlib

_SUBMODULES = ("config", "dynamic_sampling", "speed", "terms", "trainer", "vllm")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.trainer"), name)


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES) | set(dir(importlib.import_module(f"{__name__}.trainer"))))
