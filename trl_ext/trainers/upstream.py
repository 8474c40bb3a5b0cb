"""The contract between trl_ext's trainers and the installed TRL.

- ``check_upstream``: the TRL version is one trl_ext was tested with, and every upstream method a trl_ext trainer
  overrides or calls (a "seam") still exists with the parameters trl_ext expects. A renamed seam would otherwise
  leave our override uncalled and upstream's math running with no error.
- ``config_from_upstream``: builds a trl_ext config from an upstream one (``trl.SFTConfig`` -> ``trl_ext.SFTConfig``
  ...) or a plain ``transformers.TrainingArguments``, field by field, with the same values.
- ``TrainerMixin``: trainer state that changes during training (the adaptive KL ``beta``, counters, the rollout
  buffer) is saved with each checkpoint and restored on resume, as TRL 1.16's ``GRPOTrainer`` does for its adaptive
  entropy controller (``_save_checkpoint`` writes ``entropy_ctrl_state.json``, ``_load_optimizer_and_scheduler``
  reads it back); the options a resume depends on are saved too, and ``train(resume_from_checkpoint=...)`` refuses
  a run whose options differ or warns once per changed option (``trl_ext.trainers.resume``, which classifies every
  config field) before any step; and ``train()`` after ``evaluate()`` still trains under DDP.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import warnings
from typing import Any

import torch
import trl
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from trl_ext.models import base_model_id, name_base_model
from trl_ext.quantized import keep_trainable
from trl_ext.trainers.resume import (  # which options a resume refuses, warns about or lets change
    RANK_STATE_FILE,
    STATE_FILE,
    changeable_options,
    check_resume_options,
    check_training_rows,
    resume_options,
    training_rows,
)

logger = logging.getLogger(__name__)

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
    upstream = f"{base.__module__.split('.')[0]}.{base.__name__}"
    expected = f"args must be a {config_cls.__name__}, a {upstream} or a transformers.TrainingArguments"
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
    with warnings.catch_warnings():
        # a deprecated option (e.g. DPOConfig's pad_token) already warned when the user built `args`; not twice
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return config_cls(**values)


# Upstream methods TrainerMixin overrides: name -> parameters after self (transformers.Trainer via TRL 1.16.0).
TRAINER_MIXIN_SEAMS = {
    "train": ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("model", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "save_model": ("output_dir", "_internal_call"),
    "create_model_card": ("model_name", "dataset_name", "tags"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
}


class TrainerMixin:
    """What every trl_ext trainer adds around its TRL trainer (mix in before the TRL class).

    Checkpoints: ``_checkpoint_state()`` is saved to ``trl_ext_state.json`` (main process) and
    ``_checkpoint_rank_state()`` to ``trl_ext_rank_state_{process_index}.pt``, both given back to
    ``_restore_checkpoint_state`` on resume (as ``trl.GRPOTrainer._save_checkpoint`` does for its entropy controller,
    TRL 1.16). The resume options and training row count are saved too; ``train(resume_from_checkpoint=...)`` refuses or
    warns before any step (``check_resume_options``, ``check_training_rows``).

    Saved outputs name the real base model (``trl_ext.models.base_model_id``, a Hub id instead of a cache folder):
    see ``save_model`` and ``create_model_card``. ``train()`` after ``evaluate()`` under several processes: see
    ``train``."""

    STATE_FILE = STATE_FILE
    RANK_STATE_FILE = RANK_STATE_FILE
    has_rank_state = False  # True when _checkpoint_rank_state returns per-process state

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # A 4-bit (QLoRA) model stays trainable on the CPU: bitsandbytes' bf16 inference kernel, which has no backward
        # and which an evaluation-mode forward (the savings probe, evaluate()) would switch on, stays off.
        keep_trainable(self.model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        # Resume refuses options that would not continue the checkpoint exactly, before any model work.
        checkpoint = resume_from_checkpoint
        if checkpoint is True:  # as Trainer.train: the last checkpoint in output_dir (it raises when there is none)
            checkpoint = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        if checkpoint not in (None, False):
            check_resume_options(checkpoint, self.args)
            check_training_rows(checkpoint, self.args, training_rows(self.train_dataset))
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
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Resuming a PEFT model, transformers 5 reloads the adapter with PEFT's `load_adapter`, which casts it to fp32
        # (autocast_adapter_dtype). TRL trains the adapters of a quantized (QLoRA) base in bf16, so the resumed run
        # would go on in fp32 -- another computation than the uninterrupted run's. Each trainable parameter keeps the
        # dtype it had before the checkpoint was loaded (the values are the checkpoint's, saved in that dtype).
        target = self.model if model is None else model
        dtypes = {name: p.dtype for name, p in target.named_parameters() if p.requires_grad}
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for name, param in target.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])

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
        # trl_ext's files go in first: transformers writes trainer_state.json last, and a checkpoint that has it is
        # complete (what resume_from_checkpoint=True and the recipes pick); written after it, a kill in between left
        # a "complete" checkpoint that could not be resumed
        output_dir = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(output_dir, exist_ok=True)
        if self.args.should_save:
            with open(os.path.join(output_dir, self.STATE_FILE), "w") as f:
                saved = {
                    "resume_options": resume_options(self.args),
                    "changeable_options": changeable_options(self.args),
                    "training_rows": training_rows(self.train_dataset),
                }
                json.dump({**self._checkpoint_state(), **saved}, f)
        if self.has_rank_state:
            torch.save(
                self._checkpoint_rank_state(),
                os.path.join(output_dir, self.RANK_STATE_FILE.format(self.args.process_index)),
            )
        super()._save_checkpoint(model, trial)

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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # checkpoints come here too (transformers' _save_checkpoint calls save_model)
        result = super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            name_base_model(output_dir if output_dir is not None else self.args.output_dir)
        return result

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # TRL 1.16 BaseTrainer.create_model_card names config._name_or_path as the base model, or none for a local
        # folder (the embedded model's cache); name the model base_model_id gives instead, for the card alone
        config = self.model.config
        loaded_from = config._name_or_path
        config._name_or_path = base_model_id(loaded_from) if loaded_from else loaded_from
        try:
            return super().create_model_card(model_name, dataset_name, tags)
        finally:
            config._name_or_path = loaded_from
