"""The contract between trl_ext's trainers and the installed TRL.

- ``check_upstream``: the TRL version is one trl_ext was tested with, and every upstream method a trl_ext trainer
  overrides or calls (a "seam") still exists with the parameters trl_ext expects. A renamed seam would otherwise
  leave our override uncalled and upstream's math running with no error.
- ``config_from_upstream``: builds a trl_ext config from an upstream one (``trl.SFTConfig`` -> ``trl_ext.SFTConfig``
  ...) or a plain ``transformers.TrainingArguments``, field by field, with the same values.
- ``TrainerMixin``: trainer state that changes during training (the adaptive KL ``beta``, counters, the rollout
  buffer) is saved with each checkpoint and restored on resume, as TRL 1.16's ``GRPOTrainer`` does for its adaptive
  entropy controller (``_save_checkpoint`` writes ``entropy_ctrl_state.json``, ``_load_optimizer_and_scheduler``
  reads it back); and ``train()`` after ``evaluate()`` still trains under DDP.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from typing import Any

import torch
import trl
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

TESTED_TRL_VERSIONS = ("1.16.0",)
"""TRL versions whose seams and math trl_ext was tested against (pyproject.toml pins the first)."""

ALLOW_UNTESTED_TRL_ENV = "TRL_EXT_ALLOW_UNTESTED_TRL"
"""Set to 1 to turn the version check into a warning (the seam check still runs and still raises)."""


def check_upstream(upstream_cls: type, seams: dict[str, tuple[str, ...]]) -> None:
    """Fail loudly when the installed TRL is not the one trl_ext's overrides were written for.

    Args:
        upstream_cls: the TRL trainer class a trl_ext trainer subclasses (e.g. ``trl.GRPOTrainer``).
        seams: method name -> its parameter names after ``self``, in order, as trl_ext overrides or calls it.

    Raises:
        RuntimeError: the installed TRL version is not in ``TESTED_TRL_VERSIONS`` (a warning instead when the
            environment variable ``TRL_EXT_ALLOW_UNTESTED_TRL=1``), or a seam is missing from ``upstream_cls`` or
            has other parameters; the message names the version or the seam and both signatures.
    """
    if trl.__version__ not in TESTED_TRL_VERSIONS:
        message = (
            f"trl_ext was tested with trl {', '.join(TESTED_TRL_VERSIONS)}, but trl {trl.__version__} is installed; "
            f"install a tested version (`uv sync --locked`), or set {ALLOW_UNTESTED_TRL_ENV}=1 to try this one "
            "(the seams trl_ext overrides are still checked)"
        )
        if os.environ.get(ALLOW_UNTESTED_TRL_ENV) != "1":
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=3)
    for name, expected in seams.items():
        method = getattr(upstream_cls, name, None)
        if not callable(method):
            raise RuntimeError(
                f"{upstream_cls.__module__}.{upstream_cls.__qualname__}.{name} does not exist in trl "
                f"{trl.__version__}; trl_ext overrides or calls it, so without it upstream's math would run instead "
                f"of the course's. trl_ext was tested with trl {', '.join(TESTED_TRL_VERSIONS)}."
            )
        params = tuple(p for p in inspect.signature(method).parameters if p != "self")
        if params != expected:
            raise RuntimeError(
                f"{upstream_cls.__qualname__}.{name}({', '.join(params)}) in trl {trl.__version__} differs from the "
                f"({', '.join(expected)}) trl_ext overrides or calls; trl_ext was tested with trl "
                f"{', '.join(TESTED_TRL_VERSIONS)}."
            )


def config_from_upstream(config_cls: type, args: Any, **overrides: Any) -> Any:
    """A ``config_cls`` (a trl_ext config) with every init field of ``args`` copied by value.

    ``args`` is ``config_cls``'s upstream base (``trl.SFTConfig`` for ``trl_ext.SFTConfig``, ...) or a plain
    ``transformers.TrainingArguments``, which ``trl.SFTTrainer`` converts the same way (its own fields then keep the
    upstream config's defaults). Fields are read with ``getattr`` (``TrainingArguments.to_dict()`` would mask every
    ``*_token`` field); fields ``args`` does not have -- trl_ext's own, and the upstream config's for a plain
    ``TrainingArguments`` -- keep ``config_cls``'s defaults unless given in ``overrides``, which also replace copied
    values.

    Raises:
        TypeError: when ``args`` is not a ``TrainingArguments``, or has fields ``config_cls`` lacks (the config of
            another trainer, e.g. a ``trl.DPOConfig`` given to the SFT trainer); the message names them.
    """
    base = config_cls.__mro__[1]
    expected = f"args must be a {config_cls.__name__}, a {base.__module__.split('.')[0]}.{base.__name__} or a transformers.TrainingArguments"
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"{expected}, got {type(args).__name__}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(config_cls) if f.init})
    if unknown:
        raise TypeError(
            f"{expected}, got a {type(args).__name__} with fields {config_cls.__name__} does not have: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    values.update(overrides)
    return config_cls(**values)


# Upstream methods TrainerMixin overrides: name -> parameters after self (transformers.Trainer via TRL 1.16.0).
TRAINER_MIXIN_SEAMS = {
    "train": ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("model", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}


class TrainerMixin:
    """What every trl_ext trainer adds around its TRL trainer (mix in before the TRL class).

    Checkpoints: saves ``_checkpoint_state()`` with each checkpoint and gives it back to
    ``_restore_checkpoint_state`` on resume.

    The state shared by all processes goes to ``trl_ext_state.json`` (written by the main process); a trainer whose
    processes hold different state (GRPO's buffered rollout) returns it from ``_checkpoint_rank_state()``, saved by
    each process as ``trl_ext_rank_state_{process_index}.pt`` (like transformers' per-process ``rng_state_{i}.pth``).
    Mirrors ``trl.GRPOTrainer._save_checkpoint`` / ``_load_optimizer_and_scheduler`` (TRL 1.16), which do this for
    the adaptive entropy controller.

    Several processes: ``train()`` after ``evaluate()`` (a recipe's before-training evaluation) wraps the model in
    DDP; see ``train``.
    """

    STATE_FILE = "trl_ext_state.json"
    RANK_STATE_FILE = "trl_ext_rank_state_{}.pt"
    has_rank_state = False  # True when _checkpoint_rank_state returns per-process state

    def train(self, *args: Any, **kwargs: Any):
        # transformers 5 / accelerate 1.x: Trainer.evaluate() before train() prepares the bare model in evaluation
        # mode, which marks it `_is_accelerate_prepared`; train()'s `accelerator.prepare` then returns it without the
        # DistributedDataParallel wrapper, and every process trains its own copy (no gradient all-reduce, different
        # weights on each rank). Forget that evaluation-only preparation so that training wraps the model. FSDP and
        # DeepSpeed are prepared fully by evaluate() and left alone.
        model = self.model
        if (
            self.model_wrapped is model
            and getattr(model, "_is_accelerate_prepared", False)
            and not (self.is_fsdp_enabled or self.is_deepspeed_enabled)
        ):
            model._is_accelerate_prepared = False
            if "_original_forward" in model.__dict__:  # undo the mixed-precision forward wrapper, re-added by prepare
                model.forward = model.__dict__.pop("_original_forward")
            self.accelerator._models = [m for m in self.accelerator._models if m is not model]
        return super().train(*args, **kwargs)

    def _checkpoint_state(self) -> dict[str, Any]:
        """JSON-serializable state of the whole run. Default: upstream's running token count (logged as
        ``num_tokens``, which upstream restarts from 0 on resume)."""
        return {"total_train_tokens": self._total_train_tokens}

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self._total_train_tokens = state["total_train_tokens"]

    def _checkpoint_rank_state(self) -> dict[str, Any]:
        """Per-process state (tensors allowed); only called when ``has_rank_state``."""
        return {}

    def _restore_checkpoint_rank_state(self, state: dict[str, Any]) -> None:
        pass

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            with open(os.path.join(output_dir, self.STATE_FILE), "w") as f:
                json.dump(self._checkpoint_state(), f)
        if self.has_rank_state:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self._checkpoint_rank_state(), os.path.join(output_dir, self.RANK_STATE_FILE.format(self.args.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, self.STATE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} is missing: {checkpoint} was not written by a trl_ext trainer (or by an older trl_ext), so "
                "the trainer state trl_ext saves with each checkpoint (adaptive KL coefficient, counters) cannot be "
                "restored and a resumed run would not continue the interrupted one"
            )
        with open(path) as f:
            self._restore_checkpoint_state(json.load(f))
        if self.has_rank_state:
            rank_path = os.path.join(checkpoint, self.RANK_STATE_FILE.format(self.args.process_index))
            if not os.path.exists(rank_path):
                raise FileNotFoundError(
                    f"{rank_path} is missing: the checkpoint was written by a run with fewer processes, or not by "
                    "trl_ext; resume with the same number of processes"
                )
            self._restore_checkpoint_rank_state(torch.load(rank_path, map_location="cpu", weights_only=True))
