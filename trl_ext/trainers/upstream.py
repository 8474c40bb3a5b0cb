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
  a run whose options differ (``check_resume_options``) before any step; and ``train()`` after ``evaluate()`` still
  trains under DDP.
"""

from __future__ import annotations

import dataclasses
import glob
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

from ..models import base_model_id, name_base_model
from ..quantized import keep_trainable

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


# ------------------------------------------------------------------------------------------------ resume options
STATE_FILE = "trl_ext_state.json"
RANK_STATE_FILE = "trl_ext_rank_state_{}.pt"

RESUME_OPTIONS = ("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed")
"""Options every trainer's resume depends on: which rows each process reads at each step (the number of processes,
batch size and accumulation place the data loader's position; ``seed``/``data_seed`` its order)."""

GRPO_RESUME_OPTIONS = (
    "steps_per_generation",
    "num_iterations",
    "num_generations",
    "generation_batch_size",
    "dynamic_sampling",
    "max_sampling_rounds",
)
"""Added for GRPO-style configs (those that have them): the shape of the buffered rollout and where the run stopped in
its cycle (``_step``), which the checkpoint restores; and dynamic sampling, whose extra rounds decide which samples
each step trains on (``max_sampling_rounds`` only while ``dynamic_sampling`` is on: otherwise it changes nothing)."""

KEPT_FROM_CHECKPOINT = (
    "the checkpoint's optimizer and scheduler keep {old!r} (transformers restores their state); "
    "start over to train with {new!r}"
)
NEW_SCHEDULE = "the steps after the checkpoint follow the new schedule, applied to the checkpoint's base learning rate"
USED_FROM_NOW = "the steps after the checkpoint use {new!r}"

CHANGEABLE_OPTIONS: dict[str, str] = {
    # restored by transformers with the optimizer and scheduler state: the checkpoint's value wins
    "learning_rate": KEPT_FROM_CHECKPOINT,
    "weight_decay": KEPT_FROM_CHECKPOINT,
    "adam_beta1": KEPT_FROM_CHECKPOINT,
    "adam_beta2": KEPT_FROM_CHECKPOINT,
    "adam_epsilon": KEPT_FROM_CHECKPOINT,
    # the scheduler's function is built anew from the options; its base rate and step come from the checkpoint
    "lr_scheduler_type": NEW_SCHEDULE,
    "lr_scheduler_kwargs": NEW_SCHEDULE,
    "warmup_steps": NEW_SCHEDULE,
    "warmup_ratio": NEW_SCHEDULE,
    "max_grad_norm": USED_FROM_NOW,
}
"""Options a resume may change, for every trainer: option -> what the resumed run does with the new value. Each
change is accepted with one warning that names the option, both values and this effect."""

GRPO_CHANGEABLE_OPTIONS: dict[str, str] = {
    name: USED_FROM_NOW
    for name in (
        # sampling: the rollouts after the checkpoint come from another distribution
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "max_completion_length",
        "generation_kwargs",
        # the objective: advantages, clipping, normalization, KL (``loss_type``/``scale_rewards`` are other names of
        # ``length_normalization``/``normalize_by_std``, compared under the course names)
        "reward_weights",
        "advantage_eps",
        "normalize_by_std",
        "pg_loss_type",
        "length_normalization",
        "epsilon",
        "mask_truncated_completions",
        "beta",
        "kl_estimator",
        "use_bias_correction_kl",
        "kl_target",
        "kl_horizon",
    )
}
"""Added for GRPO-style configs: the sampling and the objective of the steps after the checkpoint. ``beta`` with
``kl_target`` in both runs is the adaptive controller's starting value only: the checkpoint's adapted beta goes on
(``ADAPTIVE_BETA``); ``beta`` from 0 to nonzero or back is refused (``check_resume_options``: the reference model and
the rollouts' reference log-probs exist only with beta != 0)."""

ADAPTIVE_BETA = (
    "with kl_target the adaptive beta goes on from the checkpoint's value ({new!r} is only a starting value)"
)

LIBRARY_START_OVER = "train without resume_from_checkpoint (into a new output_dir to keep these checkpoints)"
"""How to start over instead of resuming, said by :class:`ResumeMismatchError` in library use."""


class ResumeMismatchError(ValueError):
    """A checkpoint cannot be continued exactly with the options given now.

    Attributes:
        checkpoint: the checkpoint folder.
        changes: ``[(option, value in the checkpoint, value now), ...]``.
    """

    def __init__(
        self, checkpoint: str, changes: list[tuple[str, Any, Any]], how_to_start_over: str = LIBRARY_START_OVER
    ):
        self.checkpoint, self.changes = checkpoint, changes
        listed = "; ".join(f"{name} was {old!r}, now {new!r}" for name, old, new in changes)
        super().__init__(
            f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue "
            f"where it stopped: {listed}. Resume with the checkpoint's values, or start over: {how_to_start_over}"
        )


def resume_options(args: Any) -> dict[str, Any]:
    """The values of the options a resume must keep (:data:`RESUME_OPTIONS`, plus :data:`GRPO_RESUME_OPTIONS` for a
    config that has them), as saved with each checkpoint; ``num_processes`` is ``args.world_size``. With
    ``auto_find_batch_size`` the batch size is left out (transformers restores the one it found), and
    ``max_sampling_rounds`` without ``dynamic_sampling``."""
    names = [*RESUME_OPTIONS, *(name for name in GRPO_RESUME_OPTIONS if hasattr(args, name))]
    if getattr(args, "auto_find_batch_size", False):
        names.remove("per_device_train_batch_size")
    if "max_sampling_rounds" in names and not getattr(args, "dynamic_sampling", False):
        names.remove("max_sampling_rounds")
    return {name: args.world_size if name == "num_processes" else getattr(args, name) for name in names}


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from ``trl_ext_state.json`` (tuples as lists, enums and other objects as text)."""
    return json.loads(json.dumps(value, default=str))


def changeable_options(args: Any) -> dict[str, Any]:
    """The values of the options a resume may change with a warning (:data:`CHANGEABLE_OPTIONS`, plus
    :data:`GRPO_CHANGEABLE_OPTIONS` for a GRPO config), as saved with each checkpoint."""
    names = [*CHANGEABLE_OPTIONS, *(GRPO_CHANGEABLE_OPTIONS if hasattr(args, "num_generations") else ())]
    return {name: _as_json(getattr(args, name)) for name in names if hasattr(args, name)}


def _effect(name: str, old: Any, new: Any, saved: dict[str, Any], args: Any) -> str:
    """What a resumed run does with ``name`` changed from ``old`` to ``new`` (one clause)."""
    if name == "beta" and getattr(args, "kl_target", None) is not None and saved.get("kl_target") is not None:
        return ADAPTIVE_BETA.format(new=new)
    effect = CHANGEABLE_OPTIONS.get(name) or GRPO_CHANGEABLE_OPTIONS[name]
    return effect.format(old=old, new=new)


_warned: set[str] = set()


def _options_from_files(checkpoint: str, args: Any) -> dict[str, Any]:
    """What an older checkpoint (no saved options) still tells: its number of processes (one per-process state or
    RNG file each) and the per-device batch size in ``trainer_state.json`` (as transformers reads it)."""
    found: dict[str, Any] = {}
    ranks = glob.glob(os.path.join(checkpoint, RANK_STATE_FILE.format("*"))) or glob.glob(
        os.path.join(checkpoint, "rng_state_*.pth")
    )
    if ranks:
        found["num_processes"] = len(ranks)
    elif os.path.exists(os.path.join(checkpoint, "rng_state.pth")):
        found["num_processes"] = 1
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            batch = json.load(f).get("train_batch_size")
    except (OSError, ValueError):
        batch = None
    if batch is not None and not getattr(args, "auto_find_batch_size", False):
        found["per_device_train_batch_size"] = batch // max(1, args.n_gpu)
    return found


def check_resume_options(checkpoint: str | os.PathLike, args: Any, how_to_start_over: str = LIBRARY_START_OVER) -> None:
    """Refuse to resume ``checkpoint`` with options that would not continue it exactly.

    Compares :func:`resume_options` of ``args`` with those saved in the checkpoint's ``trl_ext_state.json``.
    Options that may change on resume (logging, saving, ``report_to``, output paths, evaluation, ``max_steps``) are
    not compared; those that change what the steps after the checkpoint compute (:func:`changeable_options`: the
    learning rate and schedule, GRPO's sampling and objective) are accepted with one warning each
    (:func:`warn_changed_options`). A checkpoint of an older trl_ext, which did not save them, is checked for what its
    files still tell (the number of processes and the per-device batch size; for round 3's GRPO checkpoints whether
    dynamic sampling was on), and one warning names the options left unchecked.

    Raises:
        ResumeMismatchError: naming each option that differs with its value in the checkpoint and now, and how to
            start over (``how_to_start_over``; the recipes say a new ``--output_dir`` or ``--overwrite_output_dir``).
    """
    checkpoint = os.fspath(checkpoint)
    now = resume_options(args)
    try:
        with open(os.path.join(checkpoint, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):  # no such folder, or not a trl_ext checkpoint: resuming says so
        return  # (Trainer.train, TrainerMixin._load_optimizer_and_scheduler)
    saved = state.get("resume_options")
    older = saved is None
    if older:
        saved = _options_from_files(checkpoint, args)
    if "dynamic_sampling" in now and "dynamic_sampling" not in saved and "dynamic_sampling" in state:
        saved["dynamic_sampling"] = state["dynamic_sampling"] is not None  # a round-3 GRPO checkpoint tells it so
    changes = [(name, saved[name], value) for name, value in now.items() if name in saved and saved[name] != value]
    # GRPO keeps a reference model and the rollouts' reference log-probs only with beta != 0: a buffered rollout of a
    # beta-0 run has none to train a KL term on, and the other way round the reference model is missing
    old_beta = (state.get("changeable_options") or {}).get("beta")
    if hasattr(args, "num_generations") and old_beta is not None and (old_beta == 0) != (args.beta == 0):
        changes.append(("beta", old_beta, args.beta))
    if changes:
        raise ResumeMismatchError(checkpoint, changes, how_to_start_over)
    unchecked = [name for name in now if name not in saved]
    if older and unchecked:
        logger.warning(
            "%s was written by an older trl_ext that did not save its options: checked %s only; resume with the %s it "
            "was written with, or the run will not continue exactly",
            checkpoint,
            ", ".join(saved) or "nothing",
            ", ".join(unchecked),
        )
    elif unchecked:
        logger.warning(
            "%s was written by an older trl_ext that did not save %s: resume with the value it was written with, or "
            "the run will not continue exactly",
            checkpoint,
            ", ".join(unchecked),
        )
    warn_changed_options(checkpoint, args, state.get("changeable_options") or {})


def warn_changed_options(checkpoint: str, args: Any, saved: dict[str, Any]) -> list[str]:
    """Log one warning per option of :func:`changeable_options` whose value differs from the checkpoint's, naming
    both values and what the resumed run does (each line once per process: the recipes check before the model
    loads, the trainer again in ``train()``).

    Returns:
        The lines, e.g. ``"resuming checkpoint-9: temperature was 1.0, now 0.7; the steps after the checkpoint use
        0.7"``.
    """
    lines = []
    for name, value in changeable_options(args).items():
        if name in saved and saved[name] != value:
            effect = _effect(name, saved[name], value, saved, args)
            lines.append(f"resuming {checkpoint}: {name} was {saved[name]!r}, now {value!r}; {effect}")
    for line in lines:
        if line not in _warned:
            _warned.add(line)
            logger.warning(line)
    return lines


# Upstream methods TrainerMixin overrides: name -> parameters after self (transformers.Trainer via TRL 1.16.0).
TRAINER_MIXIN_SEAMS = {
    "train": ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("model", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "save_model": ("output_dir", "_internal_call"),
    "create_model_card": ("model_name", "dataset_name", "tags"),
}


class TrainerMixin:
    """What every trl_ext trainer adds around its TRL trainer (mix in before the TRL class).

    Checkpoints: saves ``_checkpoint_state()`` with each checkpoint and gives it back to
    ``_restore_checkpoint_state`` on resume. The options a resume depends on (:func:`resume_options`) are saved
    beside it, and ``train(resume_from_checkpoint=...)`` raises :class:`ResumeMismatchError` before any step when
    they differ now (:func:`check_resume_options`).

    The state shared by all processes goes to ``trl_ext_state.json`` (written by the main process); a trainer whose
    processes hold different state (GRPO's buffered rollout) returns it from ``_checkpoint_rank_state()``, saved by
    each process as ``trl_ext_rank_state_{process_index}.pt`` (like transformers' per-process ``rng_state_{i}.pth``).
    Mirrors ``trl.GRPOTrainer._save_checkpoint`` / ``_load_optimizer_and_scheduler`` (TRL 1.16), which do this for
    the adaptive entropy controller.

    Several processes: ``train()`` after ``evaluate()`` (a recipe's before-training evaluation) wraps the model in
    DDP; see ``train``.

    Portable outputs: what a save writes (the final model and every checkpoint: adapter_config.json, the adapter's
    README, TRL's model card) names the real base model, ``trl_ext.models.base_model_id`` -- the Hub id
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` for the embedded model instead of its local cache folder, so a LoRA
    adapter loads on any machine that has that model. See ``save_model`` and ``create_model_card``.
    """

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
