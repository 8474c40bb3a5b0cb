"""Run GRPO settings ("arms") one after another on the same model, data, seed, prompts and step budget; compare them.

An arm is a trainer (upstream ``trl.GRPOTrainer`` or ``trl_ext.GRPOTrainer``) plus the fields it changes in one
shared ``trl.GRPOConfig``, trained on a :class:`trl_ext.tasks.Task`; the presets ``trl`` and ``trl_ext`` are the two
trainers at TRL's defaults. :func:`run_comparison` records per arm TRL's metrics, held-out accuracy at chosen steps,
step time, peak memory and generation speed; :func:`write_comparison` writes ``comparison.json``/``.md``/``.png``.

Modules: :mod:`~trl_ext.compare.arms` (arms, presets, configs), :mod:`~trl_ext.compare.monitoring` (step time,
memory, held-out evaluation), :mod:`~trl_ext.compare.run`, :mod:`~trl_ext.compare.report` (table, plot, files) and
:mod:`~trl_ext.compare.ablations` (the handout's experiments as arms).
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
from trl_ext.compare.report import (
    DEFAULT_PANELS,
    comparison_table,
    plot_comparison,
    setup_summary,
    time_to_gain_table,
    time_to_reference_gain,
    write_comparison,
)
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
    "time_to_gain_table",
    "time_to_reference_gain",
    "trl_defaults",
    "trl_ext_at_trl_defaults",
    "write_comparison",
]
