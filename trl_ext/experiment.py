"""The experiment record every recipe writes beside its ``metrics.json``: ``experiment.md``.

It ties a run to the code that made it and says what a reader wants to know first:

- the project's git commit and whether the working tree had uncommitted changes (``dirty``);
- the hyperparameters that differ from their defaults, plus the important ones whatever their value (learning
  rate, group size, loss type, normalization, beta, steps, ...), from the run's config dataclasses;
- a results table (before/after, final reward, time) and the plot(s);
- automatic observations from the training log (:func:`observe_training`): where the reward rose fastest, whether
  the entropy collapsed, whether completions hit the length limit, gradient-norm spikes, KL growth.

Used by the recipes through :func:`write_experiment_record`; the observations are plain functions of TRL's
``trainer.state.log_history`` and can be called on any run's log.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

IMPORTANT_FIELDS = (
    "model_name_or_path",
    "learning_rate",
    "lr_scheduler_type",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "pg_loss_type",
    "normalize_by_std",
    "length_normalization",
    "advantage_eps",
    "beta",
    "epsilon",
    "num_iterations",
    "steps_per_generation",
    "max_grad_norm",
    "seed",
)
"""Config fields always listed in the record (when the config has them), whatever their value."""

_NOISE_FIELDS = {"output_dir", "logging_dir", "run_name", "hub_token", "push_to_hub_token", "report_to"}


def git_state(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the git repository holding ``path`` (default: this
    package's source tree). ``dirty`` is True when tracked files differ from the commit or untracked files that git
    does not ignore exist. None where git or the repository is unavailable (e.g. an installed wheel)."""
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(status.strip())}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_hyperparameters(*configs: Any, important: Sequence[str] = IMPORTANT_FIELDS) -> dict[str, Any]:
    """The fields of dataclass ``configs`` that differ from their dataclass defaults, plus the ``important`` ones.

    Later configs win on repeated names. Paths and logging plumbing (``output_dir``, ``report_to``, ...) are left
    out; TRL's derived fields that equal what ``__post_init__`` set are reported as they are.

    Raises:
        TypeError: an argument that is not a dataclass instance.
    """
    out: dict[str, Any] = {}
    for config in configs:
        if config is None:
            continue
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            raise TypeError(f"expected dataclass instances (TRL/transformers configs), got {type(config).__name__}")
        for f in dataclasses.fields(config):
            if not f.init or f.name in _NOISE_FIELDS or f.name.startswith("_"):
                continue
            value = getattr(config, f.name)
            default = _default(f)
            if f.name in important or (default is not dataclasses.MISSING and value != default):
                out[f.name] = value
    order = {name: i for i, name in enumerate(important)}
    return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


# ----------------------------------------------------------------------------------------------- observations
def _curve(log_history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(e["step"]), float(e[key]))
        for e in log_history
        if "step" in e and isinstance(e.get(key), (int, float)) and math.isfinite(e[key])
    ]


def _head_tail_means(values: Sequence[float], k: int) -> tuple[float, float]:
    k = max(1, min(k, len(values) // 2 or 1))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def observe_training(
    log_history: Sequence[Mapping[str, Any]],
    max_completion_length: int | None = None,
    reward_key: str = "reward",
) -> list[str]:
    """Sentences about a training log (TRL's ``trainer.state.log_history``) that a reader would check first.

    - reward (``reward_key``): first vs last values (mean of up to 3 logged points each) and the window of about a
      fifth of the run where its running mean rose fastest;
    - ``loss`` when no reward was logged (SFT, reward models, DPO): first vs last;
    - ``entropy``: first vs last, and "collapsed" when the last value is below 0.1 nats/token or below a fifth of
      the first;
    - completion length: ``completions/clipped_ratio`` (share of completions that hit ``max_completion_length``)
      above 0.5 at the end, or the mean length within 10% of the limit;
    - ``grad_norm``: a spike when the largest value exceeds 5x the median;
    - ``kl``: its last value when logged.

    Returns:
        A list of sentences (empty for an empty log).
    """
    notes: list[str] = []
    reward = _curve(log_history, reward_key)
    if len(reward) >= 2:
        values = [v for _, v in reward]
        first, last = _head_tail_means(values, 3)
        window = max(1, len(values) // 5)
        best_gain, best_at = -math.inf, 0
        for i in range(len(values) - window):
            gain = statistics.fmean(values[i + 1 : i + 1 + window]) - statistics.fmean(values[max(0, i + 1 - window) : i + 1])
            if gain > best_gain:
                best_gain, best_at = gain, i
        trend = "rose" if last > first else "fell" if last < first else "stayed flat"
        note = f"Train reward {trend} from {first:.3f} (first logged steps) to {last:.3f} (last)"
        if best_gain > 0:
            note += (
                f"; it rose fastest around steps {reward[best_at][0]}-{reward[min(best_at + window, len(reward) - 1)][0]}"
                f" (+{best_gain:.3f} between consecutive {window}-point means)"
            )
        notes.append(note + ".")
    elif not reward:
        loss = _curve(log_history, "loss")
        if len(loss) >= 2:
            first, last = _head_tail_means([v for _, v in loss], 3)
            notes.append(f"Training loss went from {first:.4f} to {last:.4f} ({last - first:+.4f}).")
    entropy = _curve(log_history, "entropy")
    if len(entropy) >= 2:
        first, last = _head_tail_means([v for _, v in entropy], 3)
        collapsed = last < 0.1 or last < first / 5
        notes.append(
            f"Entropy went from {first:.3f} to {last:.3f} nats/token"
            + ("; it collapsed (the policy became nearly deterministic, so exploration is mostly gone)." if collapsed else "; no collapse.")
        )
    clipped = _curve(log_history, "completions/clipped_ratio")
    mean_length = _curve(log_history, "completions/mean_length")
    if clipped and clipped[-1][1] > 0.5:
        notes.append(
            f"{clipped[-1][1]:.0%} of the last step's completions hit the length limit"
            + (f" ({max_completion_length} tokens)" if max_completion_length else "")
            + ": answers are being cut off; raise max_completion_length or reward brevity."
        )
    elif mean_length and max_completion_length and mean_length[-1][1] >= 0.9 * max_completion_length:
        notes.append(f"Mean completion length {mean_length[-1][1]:.1f} is within 10% of the limit {max_completion_length}.")
    elif clipped or mean_length:
        tail = f"mean completion length {mean_length[-1][1]:.1f} tokens" if mean_length else ""
        share = f"{clipped[-1][1]:.0%} hit the length limit" if clipped else ""
        notes.append("At the end: " + ", ".join(x for x in (tail, share) if x) + ".")
    grad = _curve(log_history, "grad_norm")
    if len(grad) >= 3:
        values = [v for _, v in grad]
        median = statistics.median(values)
        step, peak = max(grad, key=lambda sv: sv[1])
        if median > 0 and peak > 5 * median:
            notes.append(f"Gradient norm spiked to {peak:.3g} at step {step} (median {median:.3g}).")
        else:
            notes.append(f"Gradient norm stayed within 5x its median {median:.3g} (max {peak:.3g}).")
    kl = _curve(log_history, "kl")
    if kl:
        notes.append(f"KL to the reference ended at {kl[-1][1]:.4f} (step {kl[-1][0]}).")
    return notes


# ------------------------------------------------------------------------------------------------------ record
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_experiment_record(
    output_dir: str | os.PathLike,
    title: str,
    *,
    configs: Sequence[Any] = (),
    hyperparameters: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | Sequence[Sequence[Any]] = (),
    results_header: Sequence[str] = ("metric", "value"),
    plots: Sequence[str | os.PathLike] = (),
    observations: Sequence[str] = (),
    log_history: Sequence[Mapping[str, Any]] | None = None,
    max_completion_length: int | None = None,
    command: str | None = None,
    extra_markdown: str = "",
    git: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``output_dir/experiment.md`` and return its path.

    Args:
        output_dir: the run's output directory (where ``metrics.json`` is).
        title: first heading.
        configs: the run's config dataclasses (script arguments, training config, ``trl.ModelConfig``); their
            non-default and important fields are listed (:func:`config_hyperparameters`).
        hyperparameters: extra or overriding name -> value pairs for the hyperparameter table.
        results: a mapping (two columns) or rows matching ``results_header`` (e.g. ``("accuracy", before, after)``).
        results_header: column titles of ``results``.
        plots: image paths (absolute or relative to ``output_dir``) embedded under "Plots".
        observations: sentences written first under "Observations".
        log_history: TRL's log; :func:`observe_training` adds its observations.
        max_completion_length: the generation budget, for the length-limit observation.
        command: the command line that reproduces the run (default: ``sys.argv``).
        extra_markdown: appended at the end (e.g. a comparison table).
        git: ``{"commit", "dirty"}`` taken when the run started (default: :func:`git_state` now). Take it at the
            start of long runs, so that commits made while the run goes on are not credited with its results.

    The record starts with the git commit and dirty flag of the project.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    git = dict(git) if git is not None else git_state()
    params = config_hyperparameters(*configs)
    params.update(hyperparameters or {})
    command = command or " ".join([Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]])
    lines = [
        f"# {title}",
        "",
        f"- git commit: `{git['commit'] or 'unknown'}`" + ("" if git["dirty"] is None else f" (dirty: {str(git['dirty']).lower()})"),
        f"- command: `{command}`",
        "",
        "## Hyperparameters (non-default and important ones)",
        "",
        "| name | value |",
        "|---|---|",
        *[f"| {k} | {_fmt(v)} |" for k, v in params.items()],
        "",
    ]
    rows = list(results.items()) if isinstance(results, Mapping) else [tuple(r) for r in results]
    if rows:
        lines += ["## Results", "", "| " + " | ".join(results_header) + " |", "|" + "---|" * len(results_header)]
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for plot in plots:
            plot = Path(plot)
            rel = os.path.relpath(plot, out) if plot.is_absolute() else str(plot)
            lines += [f"![{plot.stem}]({rel})", ""]
    notes = list(observations) + (observe_training(log_history, max_completion_length) if log_history else [])
    if notes:
        lines += ["## Observations", "", *[f"- {n}" for n in notes], ""]
    if extra_markdown:
        lines += [extra_markdown.rstrip(), ""]
    path = out / "experiment.md"
    path.write_text("\n".join(lines))
    return path


def write_recipe_record(output_dir: str | os.PathLike, title: str, *configs: Any, command: str | None = None) -> Path:
    """``experiment.md`` from what a recipe left in ``output_dir``; one call at the end of a recipe's ``main``.

    Reads ``metrics.json`` (its scalar entries become the results table, its ``log_history`` feeds
    :func:`observe_training`) or, for comparison recipes, ``comparison.json`` (one row per arm: final held-out
    accuracy and its standard error, train reward, seconds); embeds every ``*.png`` in ``output_dir``. ``configs``
    are the recipe's config dataclasses (their ``max_completion_length``, if any, is used for the length check).

    Raises:
        FileNotFoundError: neither ``metrics.json`` nor ``comparison.json`` exists in ``output_dir``.
    """
    out = Path(output_dir)
    metrics_path, comparison_path = out / "metrics.json", out / "comparison.json"
    import json

    log_history, observations = None, []
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        rows: list[Sequence[Any]] = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
        header: Sequence[str] = ("metric", "value")
        log_history = metrics.get("log_history")
    elif comparison_path.exists():
        arms = json.loads(comparison_path.read_text())["arms"]
        header = ("arm", "held-out accuracy (final)", "SE (points)", "train reward (last 5)", "train seconds")
        rows = [
            (a["name"], a.get("final_accuracy"), None if a.get("final_accuracy_se") is None else 100 * a["final_accuracy_se"],
             a.get("final_reward"), a.get("train_seconds"))
            for a in arms
        ]
        for a in arms:
            observations += [f"{a['name']}: {note}" for note in observe_training(_history_from_curves(a.get("curves", {})))]
    else:
        raise FileNotFoundError(f"{out} holds neither metrics.json nor comparison.json; write the recipe's results first")
    budget = next((c.max_completion_length for c in configs if getattr(c, "max_completion_length", None)), None)
    return write_experiment_record(
        out, title, configs=configs, results=rows, results_header=header, plots=sorted(p.name for p in out.glob("*.png")),
        observations=observations, log_history=log_history, max_completion_length=budget, command=command,
    )


def _history_from_curves(curves: Mapping[str, Sequence[Sequence[float]]]) -> list[dict[str, Any]]:
    """``{key: [[step, value], ...]}`` (trl_ext.compare summaries) back into log_history-like entries."""
    by_step: dict[int, dict[str, Any]] = {}
    for key, points in curves.items():
        for step, value in points:
            by_step.setdefault(int(step), {"step": int(step)})[key] = value
    return [by_step[s] for s in sorted(by_step)]
