"""What a resume may change: every config field of each trl_ext trainer, classified once, as data.

Each field of ``trl_ext.SFTConfig``, ``DPOConfig``, ``RewardConfig`` and ``GRPOConfig`` is in exactly one class
(``tests/test_resume_classes.py`` fails on an unclassified field after an upgrade):

- **refused** (:data:`REFUSE`): changes which rows or batches a step reads (batch size, seeds, sampler, packing, GRPO's
  rollout shape); saved with each checkpoint (:func:`resume_options`), a change raises :class:`ResumeMismatchError`
  (recipes: before the model loads; library: at ``train()``).
- **warned** (:data:`WARN`): changes what later steps compute (learning rate, loss, sampling, precision); saved
  (:func:`changeable_options`), a change logs one warning.
- **free** (:data:`FREE`): logging, saving, evaluation, ``max_steps``, how the same math runs. Not compared.

Options marked ``drops_rows`` may change which rows exist for some data; the prepared training set's row count is saved
and checked too (:func:`check_training_rows`). Tables: :data:`COMMON` (``TrainingArguments``) and :data:`SFT`,
:data:`DPO`, :data:`REWARD`, :data:`GRPO` (the same name may mean another thing per trainer); :func:`resume_rules` picks
them for a config.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import trl

from trl_ext.logs import say_once

logger = logging.getLogger(__name__)

STATE_FILE = "trl_ext_state.json"
RANK_STATE_FILE = "trl_ext_rank_state_{}.pt"

REFUSE, WARN, FREE = "refuse", "warn", "free"

# ------------------------------------------------------------------------------------------------ what a warning says
KEPT_FROM_CHECKPOINT = (
    "the checkpoint's optimizer and scheduler keep {old!r} (transformers restores their state); "
    "start over to train with {new!r}"
)
NEW_SCHEDULE = "the steps after the checkpoint follow the new schedule, applied to the checkpoint's base learning rate"
USED_FROM_NOW = "the steps after the checkpoint use {new!r}"
ADAPTIVE_BETA = (
    "with kl_target the adaptive beta goes on from the checkpoint's value ({new!r} is only a starting value)"
)
ADAPTIVE_ENTROPY = (
    "with use_adaptive_entropy the entropy coefficient goes on from the checkpoint's value ({new!r} is only a "
    "starting value)"
)
DATA_SKIP = (
    "the steps after the checkpoint read the epoch again from its first batch, not the rows the uninterrupted run "
    "reads (transformers skips no batch already trained on)"
)

# ------------------------------------------------------------------------------------------------ why an option is free
LOGGING = "logging and progress output"
SAVING = "checkpoints, saving and the Hub"
EVALUATION = "evaluation only"
LENGTH = "how long training runs (a decaying schedule follows the new length)"
HOW = "how the same math runs (devices, kernels, memory): float rounding at most"
LOADING = "how the model or data are loaded, not what they are"
RESUMING = "how this run resumes"
NOT_READ_BY_GRPO = "not read by GRPO's prompt sampler (whole batches, ordered by seed and shuffle_dataset)"


@dataclasses.dataclass(frozen=True)
class ResumeRule:
    """What a resume does when a config field differs from the checkpoint's.

    Attributes:
        kind: :data:`REFUSE`, :data:`WARN` or :data:`FREE`.
        note: refused: what the option changes; warned: the effect stated (a template of ``old`` and ``new``, or ``(old,
            new, saved, args) -> str``); free: why it may change.
        only_if: compared only while this is true of the config.
        refuse_if: for a warned option, ``(old, new, args) -> bool``: refused instead of warned.
        drops_rows: it may change which rows the prepared training set holds (:func:`check_training_rows`).
        value: the value saved and compared (default: the field, as JSON reads it back)."""

    kind: str
    note: str | Callable[..., str]
    only_if: Callable[[Any], bool] | None = None
    refuse_if: Callable[[Any, Any, Any], bool] | None = None
    drops_rows: bool = False
    value: Callable[[Any], Any] | None = None


def refused(note: str, **kwargs: Any) -> ResumeRule:
    return ResumeRule(REFUSE, note, **kwargs)


def warned(note: str | Callable[..., str] = USED_FROM_NOW, **kwargs: Any) -> ResumeRule:
    return ResumeRule(WARN, note, **kwargs)


def free(note: str, **kwargs: Any) -> ResumeRule:
    return ResumeRule(FREE, note, **kwargs)


def _accelerator_rows(args: Any) -> dict[str, Any] | None:
    """The parts of ``accelerator_config`` that place rows on processes and steps (not ``non_blocking``)."""
    config = args.accelerator_config
    if config is None:
        return None
    keys = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "gradient_accumulation_kwargs")
    return {key: getattr(config, key, None) for key in keys}


COMMON: dict[str, ResumeRule] = {
    # ---- which rows each step reads: refused
    "num_processes": refused("the rows each process reads", value=lambda args: args.world_size),  # not a field
    "per_device_train_batch_size": refused(
        "the rows of each step",
        only_if=lambda args: not args.auto_find_batch_size,  # transformers restores it
    ),
    "gradient_accumulation_steps": refused("the rows of each optimizer step"),
    "seed": refused("the data order (and the model's initialization and dropout)"),
    "data_seed": refused("the data order"),
    "auto_find_batch_size": refused("the batch size (then restored from the checkpoint)"),
    "dataloader_drop_last": refused("the batches of each epoch, and where the resumed run skips to"),
    "dataloader_in_order": refused("the order of a streamed dataset's batches"),
    "train_sampling_strategy": refused("the data order"),
    "length_column_name": refused(
        "the data order of a length-grouped sampler",
        only_if=lambda args: args.train_sampling_strategy in ("group_by_length", "batch_rebalance"),
    ),
    "accelerator_config": refused("the rows of each process and step", value=_accelerator_rows),
    "parallelism_config": refused("the number of data-parallel replicas"),
    # ---- what the steps after the checkpoint compute: warned
    "learning_rate": warned(KEPT_FROM_CHECKPOINT),
    "weight_decay": warned(KEPT_FROM_CHECKPOINT),
    "adam_beta1": warned(KEPT_FROM_CHECKPOINT),
    "adam_beta2": warned(KEPT_FROM_CHECKPOINT),
    "adam_epsilon": warned(KEPT_FROM_CHECKPOINT),
    "lr_scheduler_type": warned(NEW_SCHEDULE),
    "lr_scheduler_kwargs": warned(NEW_SCHEDULE),
    "warmup_steps": warned(NEW_SCHEDULE),
    "max_grad_norm": warned(),
    "optim": warned(),
    "optim_args": warned(),
    "optim_target_modules": warned(),
    "bf16": warned(),
    "fp16": warned(),
    "tf32": warned(),
    "neftune_noise_alpha": warned(),
    "label_smoothing_factor": warned(),
    "label_names": warned(),
    "remove_unused_columns": warned(),
    "average_tokens_across_devices": warned(),
    "use_liger_kernel": warned(),  # GRPO and DPO: liger's own loss replaces the course's
    "liger_kernel_config": warned(),
    "deepspeed": warned(),  # its config may set the optimizer, scheduler and precision
    "fsdp_config": warned(),  # mixed precision among others
    "ignore_data_skip": warned(lambda old, new, saved, args: DATA_SKIP if new else USED_FROM_NOW.format(new=new)),
    # ---- free
    "max_steps": free(LENGTH),
    "num_train_epochs": free(LENGTH),
    "output_dir": free(SAVING),
    "resume_from_checkpoint": free(RESUMING),
    "restore_callback_states_from_checkpoint": free(RESUMING),
    "save_strategy": free(SAVING),
    "save_steps": free(SAVING),
    "save_total_limit": free(SAVING),
    "save_only_model": free(SAVING),
    "save_on_each_node": free(SAVING),
    "enable_jit_checkpoint": free(SAVING),
    "push_to_hub": free(SAVING),
    "hub_model_id": free(SAVING),
    "hub_strategy": free(SAVING),
    "hub_token": free(SAVING),
    "hub_private_repo": free(SAVING),
    "hub_always_push": free(SAVING),
    "hub_revision": free(SAVING),
    "report_to": free(LOGGING),
    "run_name": free(LOGGING),
    "project": free(LOGGING),
    "trackio_space_id": free(LOGGING),
    "trackio_bucket_id": free(LOGGING),
    "trackio_static_space_id": free(LOGGING),
    "logging_strategy": free(LOGGING),
    "logging_steps": free(LOGGING),
    "logging_first_step": free(LOGGING),
    "logging_nan_inf_filter": free(LOGGING),
    "log_level": free(LOGGING),
    "log_level_replica": free(LOGGING),
    "log_on_each_node": free(LOGGING),
    "disable_tqdm": free(LOGGING),
    "skip_memory_metrics": free(LOGGING),
    "include_num_input_tokens_seen": free(LOGGING),
    "debug": free(LOGGING),
    "do_train": free(LOGGING),
    "do_eval": free(EVALUATION),
    "do_predict": free(EVALUATION),
    "eval_strategy": free(EVALUATION),
    "eval_steps": free(EVALUATION),
    "eval_delay": free(EVALUATION),
    "eval_on_start": free(EVALUATION),
    "eval_accumulation_steps": free(EVALUATION),
    "eval_do_concat_batches": free(EVALUATION),
    "eval_use_gather_object": free(EVALUATION),
    "per_device_eval_batch_size": free(EVALUATION),
    "prediction_loss_only": free(EVALUATION),
    "include_for_metrics": free(EVALUATION),
    "batch_eval_metrics": free(EVALUATION),
    "bf16_full_eval": free(EVALUATION),
    "fp16_full_eval": free(EVALUATION),
    "metric_for_best_model": free(EVALUATION),
    "greater_is_better": free(EVALUATION),
    "load_best_model_at_end": free(EVALUATION),
    "use_cpu": free(HOW),
    "local_rank": free(HOW),
    "full_determinism": free(HOW),
    "use_cache": free(HOW),
    "activation_checkpointing": free(HOW),
    "activation_checkpointing_kwargs": free(HOW),
    "gradient_checkpointing": free(HOW),
    "gradient_checkpointing_kwargs": free(HOW),
    "torch_compile": free(HOW),
    "torch_compile_backend": free(HOW),
    "torch_compile_mode": free(HOW),
    "torch_empty_cache_steps": free(HOW),
    "fsdp": free(HOW),
    "ddp_backend": free(HOW),
    "ddp_timeout": free(HOW),
    "ddp_find_unused_parameters": free(HOW),
    "ddp_bucket_cap_mb": free(HOW),
    "ddp_broadcast_buffers": free(HOW),
    "ddp_static_graph": free(HOW),
    "dataloader_num_workers": free(LOADING),
    "dataloader_pin_memory": free(LOADING),
    "dataloader_persistent_workers": free(LOADING),
    "dataloader_prefetch_factor": free(LOADING),
    "dataloader_multiprocessing_context": free(LOADING),
}
"""``transformers.TrainingArguments``' fields (every trainer), and the number of processes."""

# Fields TRL's configs share; classified alike where they mean the same thing in each trainer.
_TRL_SHARED: dict[str, ResumeRule] = {
    "model_init_kwargs": warned(),  # the dtype among others, for a model given by name
    "trust_remote_code": free(LOADING),
    "dataset_num_proc": free(LOADING),
    "activation_offloading": free(HOW),
    "pad_to_multiple_of": free(HOW),
    "router_aux_loss_coef": warned(),
    "disable_dropout": warned(),
    "pad_token": warned(),
    "eos_token": warned(),
    "chat_template_path": warned(),
}

SFT: dict[str, ResumeRule] = {
    "packing": refused("the sequences of each batch: rows are packed together"),
    "packing_strategy": refused("the sequences of each batch", only_if=lambda args: args.packing),
    "shuffle_dataset": refused("the data order"),
    "max_length": warned(refuse_if=lambda old, new, args: bool(args.packing), drops_rows=True),  # packing: rows
    "truncation_mode": warned(only_if=lambda args: not args.packing, drops_rows=True),
    "completion_only_loss": warned(drops_rows=True),  # truncation may leave a row with no trained token
    "assistant_only_loss": warned(drops_rows=True),
    "dataset_kwargs": warned(drops_rows=True),  # skip_prepare_dataset: no truncation, no dropped rows
    "dataset_text_field": warned(),
    "loss_type": warned(),
    "padding_free": warned(),  # without packing, TRL no longer enforces max_length
    "eval_packing": free(EVALUATION),
    "safety_penalty_weight": warned(),
    "banned_strings": warned(),
}
"""``trl_ext.SFTConfig``'s fields beyond ``TrainingArguments``'."""

DPO: dict[str, ResumeRule] = {
    "beta": warned(),
    "loss_type": warned(),
    "loss_weights": warned(),
    "label_smoothing": warned(),
    "f_divergence_type": warned(),
    "f_alpha_divergence_coef": warned(),
    "ld_alpha": warned(),
    "use_weighting": warned(),
    "discopop_tau": warned(),
    "max_length": warned(),  # truncates in the collator: every pair stays
    "truncation_mode": warned(),
    "padding_free": warned(),
    "sync_ref_model": warned(),
    "ref_model_mixup_alpha": warned(),
    "ref_model_sync_steps": warned(),
    "precompute_ref_log_probs": free(HOW),  # the same reference (the model as passed), computed before training
    "precompute_ref_batch_size": free(HOW),
    "skip_invalid_pairs": free("the same rows, or a ValueError at construction", drops_rows=True),
}
"""``trl_ext.DPOConfig``'s fields beyond ``TrainingArguments``'."""

REWARD: dict[str, ResumeRule] = {
    "max_length": refused("which pairs are trained: longer ones are dropped", drops_rows=True),
    "center_rewards_coefficient": warned(),
    "skip_invalid_pairs": free("the same rows, or a ValueError at construction", drops_rows=True),
}
"""``trl_ext.RewardConfig``'s fields beyond ``TrainingArguments``'."""


def _beta_effect(old: Any, new: Any, saved: dict[str, Any], args: Any) -> str:
    if args.kl_target is not None and saved.get("kl_target") is not None:
        return ADAPTIVE_BETA.format(new=new)
    return USED_FROM_NOW.format(new=new)


def _entropy_coef_effect(old: Any, new: Any, saved: dict[str, Any], args: Any) -> str:
    if args.use_adaptive_entropy and saved.get("use_adaptive_entropy"):
        return ADAPTIVE_ENTROPY.format(new=new)
    return USED_FROM_NOW.format(new=new)


GRPO: dict[str, ResumeRule] = {
    # the rollout's shape and where the run stopped in its cycle (``_step``), which the checkpoint restores
    "steps_per_generation": refused("the rollout each step trains on"),
    "num_iterations": refused("the rollout each step trains on"),
    "num_generations": refused("the groups of each rollout"),
    "generation_batch_size": refused("the rollout each step trains on"),
    "shuffle_dataset": refused("the prompt order"),
    # GRPO's RepeatSampler orders whole batches of prompts from seed and shuffle_dataset alone (TRL 1.16
    # GRPOTrainer._get_train_sampler), and dynamic sampling's extra prompts from seed: transformers' sampler options
    # are never read
    "data_seed": free(NOT_READ_BY_GRPO),
    "train_sampling_strategy": free(NOT_READ_BY_GRPO),
    "length_column_name": free(NOT_READ_BY_GRPO),
    "dataloader_drop_last": free(NOT_READ_BY_GRPO),
    # dynamic sampling: its extra rounds decide which samples each step trains on
    "dynamic_sampling": refused("which groups each step trains on"),
    "max_sampling_rounds": refused("which groups each step trains on", only_if=lambda args: args.dynamic_sampling),
    # sampling: the rollouts after the checkpoint come from another distribution
    "temperature": warned(),
    "top_p": warned(),
    "top_k": warned(),
    "min_p": warned(),
    "repetition_penalty": warned(),
    "max_completion_length": warned(),
    "stop_strings": warned(),  # where a completion ends: other completions and rewards after the checkpoint
    "min_completion_length": warned(),
    "generation_kwargs": warned(),
    "chat_template_kwargs": warned(),
    "max_tool_calling_iterations": warned(),
    "use_vllm": warned(),  # another engine: other draws
    "vllm_mode": warned(),
    "vllm_max_model_length": warned(),
    "vllm_structured_outputs_regex": warned(),
    "vllm_dtype": warned(),  # the engine samples from a copy of the policy in another dtype: other draws
    "use_transformers_continuous_batching": warned(),
    "use_transformers_paged": warned(),
    "transformers_continuous_batching_config": warned(),
    # the objective: advantages, clipping, normalization, KL
    "reward_weights": warned(),
    "advantage_eps": warned(),
    "normalize_by_std": warned(),
    "advantage_estimator": warned(),
    "scale_rewards": free("TRL's name for normalize_by_std and advantage_estimator: compared under those names"),
    "pg_loss_type": warned(),
    "length_normalization": warned(),
    "loss_type": free("TRL's name for pg_loss_type and length_normalization: compared under those names"),
    "multi_objective_aggregation": free("TRL's name for advantage_estimator: compared under that name"),
    "epsilon": warned(),
    "epsilon_high": warned(),
    "mask_truncated_completions": warned(),
    # beta from 0 or to 0: the reference model and the rollouts' reference log-probs exist only with beta != 0
    "beta": warned(_beta_effect, refuse_if=lambda old, new, args: (old == 0) != (new == 0)),
    "kl_estimator": warned(),
    "use_bias_correction_kl": warned(),
    "kl_target": warned(),
    "kl_horizon": warned(),
    "sync_ref_model": warned(),
    "ref_model_mixup_alpha": warned(),
    "ref_model_sync_steps": warned(),
    "cast_lm_head_to_fp32": warned(),
    "vllm_importance_sampling_correction": warned(),
    "vllm_importance_sampling_mode": warned(),
    "vllm_importance_sampling_cap": warned(),
    "vllm_importance_sampling_clip_min": warned(),
    "vllm_importance_sampling_clip_max": warned(),
    # TRL's objective options (each implemented as upstream means it: trl_ext.trainers.grpo.terms,
    # trl_ext.objective.losses)
    "importance_sampling_level": warned(),
    "top_entropy_quantile": warned(),
    "entropy_coef": warned(_entropy_coef_effect),
    "entropy_coef_delta": warned(),
    "entropy_coef_min": warned(),
    "entropy_coef_max": warned(),
    "entropy_target": warned(),
    "use_adaptive_entropy": warned(),
    "off_policy_mask_threshold": warned(),
    "delta": warned(),
    "sapo_temperature_neg": warned(),
    "sapo_temperature_pos": warned(),
    "vespo_k_neg": warned(),
    "vespo_k_pos": warned(),
    "vespo_lambda_neg": warned(),
    "vespo_lambda_pos": warned(),
    # free: trl_ext's exact speed paths, generation plumbing, logging, evaluation
    "share_prompt_cache": free(HOW),
    "skip_zero_advantage_rows": free(HOW),
    "pack_completions": free(HOW),
    "prepack_linear_weights": free(HOW),
    "cache_implementation": free(HOW),
    "ds3_gather_for_generation": free(HOW),
    "vllm_model_impl": free(HOW),
    "vllm_tensor_parallel_size": free(HOW),
    "vllm_gpu_memory_utilization": free(HOW),
    "vllm_enable_sleep_mode": free(HOW),
    "vllm_server_base_url": free(HOW),
    "vllm_server_host": free(HOW),
    "vllm_server_port": free(HOW),
    "vllm_server_timeout": free(HOW),
    "vllm_group_port": free(HOW),
    "num_generations_eval": free(EVALUATION),
    "log_completions": free(LOGGING),
    "log_completions_hub_repo": free(LOGGING),
    "log_multimodal": free(LOGGING),
    "log_unique_prompts": free(LOGGING),
    "num_completions_to_print": free(LOGGING),
}
"""``trl_ext.GRPOConfig``'s fields beyond ``TrainingArguments``'. ``loss_type``/``scale_rewards``/
``multi_objective_aggregation`` are other names of ``pg_loss_type``, ``length_normalization``, ``normalize_by_std`` and
``advantage_estimator`` (compared under the course names: one warning per change). ``beta``
with ``kl_target`` in both runs is the adaptive controller's starting value only: the checkpoint's adapted beta goes
on (:data:`ADAPTIVE_BETA`); so is ``entropy_coef`` with ``use_adaptive_entropy`` in both runs
(:data:`ADAPTIVE_ENTROPY`)."""

TRAINER_RULES: tuple[tuple[type, dict[str, ResumeRule]], ...] = (
    (trl.SFTConfig, {**_TRL_SHARED, **SFT}),
    (trl.DPOConfig, {**_TRL_SHARED, **DPO}),
    (trl.RewardConfig, {**_TRL_SHARED, **REWARD}),
    (trl.GRPOConfig, {**_TRL_SHARED, **GRPO}),
)
"""The trainer's own table for each TRL config class (trl_ext's configs subclass them)."""


def resume_rules(args: Any) -> dict[str, ResumeRule]:
    """Option name -> :class:`ResumeRule` for the config ``args``: :data:`COMMON`, then its trainer's table (only
    the fields ``args`` has: a ``_TRL_SHARED`` entry a config lacks is left out). A plain ``TrainingArguments``
    gets :data:`COMMON` alone."""
    own = next((table for cls, table in TRAINER_RULES if isinstance(args, cls)), {})
    return {**COMMON, **{name: rule for name, rule in own.items() if hasattr(args, name)}}


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from ``trl_ext_state.json`` (tuples as lists, enums and other objects as text)."""
    return json.loads(json.dumps(value, default=str))


def _values(args: Any, kind: str) -> dict[str, Any]:
    values = {}
    for name, rule in resume_rules(args).items():
        if rule.kind != kind or (rule.only_if is not None and not rule.only_if(args)):
            continue
        values[name] = _as_json(rule.value(args) if rule.value is not None else getattr(args, name))
    return values


def resume_options(args: Any) -> dict[str, Any]:
    """The values of the refused options of ``args`` (those compared now), as saved with each checkpoint."""
    return _values(args, REFUSE)


def changeable_options(args: Any) -> dict[str, Any]:
    """The values of the warned options of ``args`` (those compared now), as saved with each checkpoint."""
    return _values(args, WARN)


def row_dropping_options(args: Any) -> list[str]:
    """The options of ``args``' trainer that may change which rows its prepared training set holds."""
    return [name for name, rule in resume_rules(args).items() if rule.drops_rows]


def training_rows(dataset: Any) -> int | None:
    """The number of rows of a prepared training set; None for one without a length (a stream)."""
    try:
        return len(dataset)
    except TypeError:
        return None


LIBRARY_START_OVER = "train without resume_from_checkpoint (into a new output_dir to keep these checkpoints)"
"""How to start over instead of resuming, said by :class:`ResumeMismatchError` in library use."""


class ResumeMismatchError(ValueError):
    """A checkpoint cannot be continued exactly with the options given now.

    Attributes:
        checkpoint: the checkpoint folder.
        changes: ``[(option, value in the checkpoint, value now), ...]``.
    """

    def __init__(
        self,
        checkpoint: str,
        changes: list[tuple[str, Any, Any]],
        how_to_start_over: str = LIBRARY_START_OVER,
        note: str = "",
    ):
        self.checkpoint, self.changes = checkpoint, changes
        listed = "; ".join(f"{name} was {old!r}, now {new!r}" for name, old, new in changes)
        super().__init__(
            f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue "
            f"where it stopped: {listed}{note}. Resume with the checkpoint's values, or start over: {how_to_start_over}"
        )


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


def read_state(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint's ``trl_ext_state.json``, or None (no such folder, or not a trl_ext checkpoint)."""
    try:
        with open(os.path.join(os.fspath(checkpoint), STATE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_resume_options(checkpoint: str | os.PathLike, args: Any, how_to_start_over: str = LIBRARY_START_OVER) -> None:
    """Refuse to resume ``checkpoint`` with options that would not continue it exactly; warn once per option that
    changes what later steps compute.

    Compares :func:`resume_options` of ``args`` with the checkpoint's ``trl_ext_state.json``, then the warned ones
    (:func:`warn_changed_options`; a ``refuse_if`` hit is refused). An older checkpoint that did not save them is
    checked for what its files tell, with one warning naming the options left unchecked. Needs no model.

    Raises:
        ResumeMismatchError: naming each differing option with both values, and ``how_to_start_over``."""
    checkpoint = os.fspath(checkpoint)
    state = read_state(checkpoint)
    if state is None:  # no such folder, or not a trl_ext checkpoint: resuming says so
        return  # (Trainer.train, TrainerMixin._load_optimizer_and_scheduler)
    now = resume_options(args)
    saved = state.get("resume_options")
    older = saved is None
    if older:
        saved = _options_from_files(checkpoint, args)
    if "dynamic_sampling" in now and "dynamic_sampling" not in saved and "dynamic_sampling" in state:
        saved["dynamic_sampling"] = state["dynamic_sampling"] is not None  # a round-3 GRPO checkpoint tells it so
    changes = [(name, saved[name], value) for name, value in now.items() if name in saved and saved[name] != value]
    rules = resume_rules(args)
    saved_changeable = state.get("changeable_options") or {}
    for name, value in changeable_options(args).items():
        refuse_if = rules[name].refuse_if
        old = saved_changeable.get(name, value)
        if old != value and refuse_if is not None and refuse_if(old, value, args):
            changes.append((name, old, value))
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
    warn_changed_options(checkpoint, args, saved_changeable)


def warn_changed_options(checkpoint: str, args: Any, saved: dict[str, Any]) -> list[str]:
    """Log one warning per warned option (:func:`changeable_options`) that differs from the checkpoint's.

    Returns:
        The lines, e.g. ``"resuming checkpoint-9: temperature was 1.0, now 0.7; the steps after the checkpoint use
        0.7"``."""
    lines = []
    rules = resume_rules(args)
    for name, value in changeable_options(args).items():
        if name in saved and saved[name] != value:
            note, old = rules[name].note, saved[name]
            effect = note(old, value, saved, args) if callable(note) else note.format(old=old, new=value)
            lines.append(f"resuming {checkpoint}: {name} was {old!r}, now {value!r}; {effect}")
    for line in lines:
        say_once(line, log=logger)
    return lines


def check_training_rows(
    checkpoint: str | os.PathLike, args: Any, rows: int | None, how_to_start_over: str = LIBRARY_START_OVER
) -> None:
    """Refuse to resume when the prepared training set has another row count than the checkpoint's run (every row after
    a dropped one moves). Not checked for a stream (``rows`` None) or a checkpoint that did not save it.

    Raises:
        ResumeMismatchError: ``training rows was 8, now 7``, with the options that may have changed it
            (:func:`row_dropping_options`)."""
    saved = (read_state(checkpoint) or {}).get("training_rows")
    if saved is None or rows is None or saved == rows:
        return
    options = row_dropping_options(args)
    which = f" (the training data changed, or an option that drops rows: {', '.join(options)})" if options else ""
    raise ResumeMismatchError(
        os.fspath(checkpoint), [("training rows", saved, rows)], how_to_start_over, note=which or " (the data changed)"
    )
