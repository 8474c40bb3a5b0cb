"""Run GRPO settings ("arms") one after another on the same model, data, seed, prompts and step budget; compare them.

An arm is a trainer (upstream ``trl.GRPOTrainer`` or ``trl_ext.GRPOTrainer``) plus the config fields it changes
relative to one shared ``trl.GRPOConfig`` (learning rate, batch, generation, steps, seed, ...). Upstream arms must
write out ``loss_type``, ``scale_rewards``, ``beta`` and ``epsilon`` (never TRL's implicit defaults: the ``trl``
preset writes in what the installed ``trl.GRPOConfig`` defaults to, :func:`~trl_ext.compare.arms.trl_defaults`);
``trl_ext`` arms set the course fields (``normalize_by_std``, ``length_normalization``, ...). The presets ``trl`` and
``trl_ext`` are the two trainers at TRL's defaults: the same math, upstream against trl_ext.

Per arm, :func:`run_comparison` records TRL's logged metrics (``reward``, ``entropy``, ``completions/mean_length``,
per-function rewards), held-out greedy accuracy at chosen steps (logged as ``heldout/accuracy`` next to TRL's
metrics, so tensorboard/wandb/trackio see it too), wall seconds per optimizer step (median), peak memory (process
RSS peak on CPU, ``torch.cuda.max_memory_allocated`` on GPU) and generated tokens per second of generation time.
:func:`write_comparison` writes ``comparison.json``, ``comparison.md`` (a table) and ``comparison.png`` (curves).

Arms train on a :class:`trl_ext.tasks.Task` (an arm may name another task: other prompts, rewards and evaluation),
and several comparisons can share a ``cache`` so an arm that appears in several of them (under different names)
trains once.

Modules: :mod:`~trl_ext.compare.arms` (arms, presets, per-arm configs), :mod:`~trl_ext.compare.monitoring` (step
time, memory, held-out evaluation during training, summaries), :mod:`~trl_ext.compare.run` (running the arms),
:mod:`~trl_ext.compare.report` (table, plot, files) and :mod:`~trl_ext.compare.ablations` (the handout's
experiments as arms).

Used by ``recipes/compare_upstream.py`` (math), ``recipes/grpo_sort.py`` (the lecture's sorting toy task) and
``recipes/grpo_ablations.py`` (the handout's GRPO experiments).
"""

from trl_ext.compare import ablations
from trl_ext.compare.arms import (
    ARM_PRESETS,
    TRAINERS,
    TRL_ADVANTAGE_EPS,
    TRL_UPDATE_FIELDS,
    UPSTREAM_REQUIRED,
    Arm,
    arm_config,
    arm_key,
    parse_arms,
    trl_defaults,
    trl_ext_at_trl_defaults,
)
from trl_ext.compare.monitoring import ArmMonitor, PeakMemory, release_memory, summarize_arm
from trl_ext.compare.report import DEFAULT_PANELS, comparison_table, plot_comparison, setup_summary, write_comparison
from trl_ext.compare.run import eval_steps, run_comparison
from trl_ext.measurement.observations import metric_curve

__all__ = [
    "ablations",
    "ARM_PRESETS",
    "DEFAULT_PANELS",
    "TRAINERS",
    "TRL_ADVANTAGE_EPS",
    "TRL_UPDATE_FIELDS",
    "UPSTREAM_REQUIRED",
    "Arm",
    "ArmMonitor",
    "PeakMemory",
    "arm_config",
    "arm_key",
    "comparison_table",
    "eval_steps",
    "metric_curve",
    "parse_arms",
    "plot_comparison",
    "release_memory",
    "run_comparison",
    "setup_summary",
    "summarize_arm",
    "trl_defaults",
    "trl_ext_at_trl_defaults",
    "write_comparison",
]
