"""The end of a recipe run, in one call: metrics.json, experiment.md, plots, the console table and the model card.

:func:`finish` is what a training or evaluation recipe calls last::

    report.finish(run, metrics, [report.Record("GRPO on math problems"), report.accuracy_table(...),
                                 report.Curves("training_curves.png", PANELS)], trainer=trainer)

:func:`finish_comparison` does the same for a comparison of arms. ``experiment.md``
(:func:`write_experiment_record`) ties a run to the code that made it (version, git commit, dirty tree), its
non-default and important hyperparameters, a results table, the plots and observations of the training log
(``trl_ext.measurement.observations.observe_training``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from trl_ext.measurement.observations import observe_training
from trl_ext.measurement.profiling import format_breakdown
from trl_ext.measurement.roofline import format_roofline
from trl_ext.models import DEFAULT_MODEL, EMBEDDED_BASE_MODEL, base_model_id, is_embedded
from trl_ext.run import command_line, describe_code, git_state, is_main_process

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
    "advantage_estimator",
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


def _history_from_curves(curves: Mapping[str, Sequence[Sequence[float]]]) -> list[dict[str, Any]]:
    """``{key: [[step, value], ...]}`` (trl_ext.compare summaries) back into log_history-like entries."""
    by_step: dict[int, dict[str, Any]] = {}
    for key, points in curves.items():
        for step, value in points:
            by_step.setdefault(int(step), {"step": int(step)})[key] = value
    return [by_step[s] for s in sorted(by_step)]


# ------------------------------------------------------------------------------------------------------ record
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _hyperparameters(configs: Sequence[Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The record's hyperparameter table: :func:`config_hyperparameters`, then ``extra``; the embedded model (an
    unset ``model_name_or_path``) named by the Hub id it was quantized from."""
    params = config_hyperparameters(*configs)
    params.update(extra or {})
    if "model_name_or_path" in params and is_embedded(params["model_name_or_path"]):  # unset: the embedded model
        params["model_name_or_path"] = f"{EMBEDDED_BASE_MODEL} (trl_ext's embedded copy)"
    return params


def _plot_lines(plots: Sequence[str | os.PathLike], out: Path) -> list[str]:
    """Markdown image lines for ``plots``, an absolute path made relative to ``out``."""
    lines = []
    for plot in map(Path, plots):
        rel = os.path.relpath(plot, out) if plot.is_absolute() else str(plot)
        lines += [f"![{plot.stem}]({rel})", ""]
    return lines


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
    project_git: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``output_dir/experiment.md`` and return its path.

    Args:
        output_dir: the run's output directory (where ``metrics.json`` is).
        title: first heading.
        configs: the run's config dataclasses; their non-default and important fields are listed
            (:func:`config_hyperparameters`), the embedded model by its Hub id.
        hyperparameters: extra or overriding name -> value pairs for the hyperparameter table.
        results: a mapping (two columns) or rows matching ``results_header`` (e.g. ``("accuracy", before, after)``).
        results_header: column titles of ``results``.
        plots: image paths (absolute or relative to ``output_dir``) embedded under "Plots".
        observations: sentences written first under "Observations".
        log_history: TRL's log; ``observe_training`` adds its observations.
        max_completion_length: the generation budget, for the length-limit observation.
        command: the command line that reproduces the run (default: ``trl_ext.run.command_line``).
        extra_markdown: appended at the end (e.g. a comparison table).
        git: trl_ext's ``trl_ext.run.git_state`` taken when the run started (default: now).
        project_git: the working directory's checkout when it is not trl_ext's (e.g. the course repository), or None.

    The record starts with the code it was made with (``trl_ext.run.describe_code``).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if git is None:
        git = git_state()
    params = _hyperparameters(configs, hyperparameters)
    command = command or command_line()
    lines = [
        f"# {title}",
        "",
        *[f"- {line}" for line in describe_code(git, project_git)],
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
        lines += ["## Plots", "", *_plot_lines(plots, out)]
    notes = list(observations) + (observe_training(log_history, max_completion_length) if log_history else [])
    if notes:
        lines += ["## Observations", "", *[f"- {n}" for n in notes], ""]
    if extra_markdown:
        lines += [extra_markdown.rstrip(), ""]
    path = out / "experiment.md"
    path.write_text("\n".join(lines))
    return path


def scalar_results(metrics: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The rows of a run's results table: the scalar entries of ``metrics`` (numbers and strings; not booleans,
    lists or mappings such as ``log_history``)."""
    return [(k, v) for k, v in metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]


COMPARISON_HEADER = ("arm", "held-out accuracy (final)", "SE (points)", "train reward (last 5)", "train seconds")
"""Columns of :func:`comparison_results`."""


def comparison_results(arms: Sequence[Mapping[str, Any]]) -> tuple[list[tuple], list[str]]:
    """Rows of :data:`COMPARISON_HEADER` (one per arm summary of ``trl_ext.compare.run_comparison``) and
    ``observe_training``'s observations of each arm's curves, prefixed with its name."""
    rows = [
        (
            a["name"],
            a.get("final_accuracy"),
            None if a.get("final_accuracy_se") is None else 100 * a["final_accuracy_se"],
            a.get("final_reward"),
            a.get("train_seconds"),
        )
        for a in arms
    ]
    notes = [
        f"{a['name']}: {note}" for a in arms for note in observe_training(_history_from_curves(a.get("curves", {})))
    ]
    return rows, notes


# ----------------------------------------------------------------------------------------- plots, table, card
def plot_curves(
    log_history: Sequence[Mapping[str, Any]],
    panels: Sequence[tuple[str, str]],
    path: str | Path,
    points: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> Path | None:
    """One panel per ``(log key, title)`` of the training log against the step; ``points`` adds marked values
    (e.g. ``{"eval_accuracy": [(0, 0.09), (40, 0.675)]}``) to the panel of that key. Panels with no data are
    left out; returns the PNG path, or None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = dict(points or {})
    series = {key: [(e["step"], e[key]) for e in log_history if key in e and "step" in e] for key, _ in panels}
    shown = [(key, title) for key, title in panels if series[key] or points.get(key)]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], shown):
        if series[key]:
            ax.plot(*zip(*series[key]), marker=".")
        if points.get(key):
            ax.plot(*zip(*points[key]), marker="o", linestyle="--", color="tab:red")
            for step, value in points[key]:
                ax.annotate(f"{value:.3g}", (step, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], console: Console | None = None
) -> Console:
    """Print a table (rich); return the console, for the closing lines (soft-wrapped: paths stay whole)."""
    console = console or Console(soft_wrap=True)
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    console.print(table)
    return console


def before_after_rows(before: Mapping[str, float], after: Mapping[str, float], keys: Sequence[str]) -> list[tuple]:
    """``(key, before, after)`` rows to 4 decimals: the held-out table of the SFT, reward-model and DPO recipes."""
    return [(key, f"{before[key]:.4f}", f"{after[key]:.4f}") for key in keys]


def held_out_metrics(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of held-out evaluations (``Task.evaluate`` results) before and after training: accuracy, exact
    accuracy, format rate and truncated responses of each, the problems (distinct, the task's note) and speed after."""
    metrics = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "exact_accuracy_before": before.get("exact_accuracy"),
        "exact_accuracy_after": after.get("exact_accuracy"),
        "format_rate_before": before["format_rate"],
        "format_rate_after": after["format_rate"],
        "truncated_before": before.get("num_truncated"),
        "truncated_after": after.get("num_truncated"),
        "n_eval": after["n"],
        "n_eval_distinct": after.get("distinct_prompts"),
        "eval_examples_per_second": after["examples_per_second"],
    }
    if after.get("held_out_note"):
        metrics["held_out_note"] = after["held_out_note"]
    return metrics


def held_out_caption(result: Mapping[str, Any]) -> str:
    """``"200 held-out problems"``, and how many are distinct when some repeat (``"100 held-out problems, 63
    distinct"``)."""
    n, distinct = result["n"], result.get("distinct_prompts")
    text = f"{n} held-out problem{'s' if n != 1 else ''}"
    return text + (f", {distinct} distinct" if distinct is not None and distinct != n else "")


def held_out_logs(result: Mapping[str, Any]) -> dict[str, float]:
    """A held-out evaluation (``Task.evaluate`` result) as logged at a step: ``{"eval_accuracy", "eval_format_rate"}``
    (TensorBoard shows them as ``eval/accuracy`` and ``eval/format_rate``; :func:`eval_curve` reads them back)."""
    return {"eval_accuracy": result["accuracy"], "eval_format_rate": result["format_rate"]}


def eval_curve(log_history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluations of a training log (:func:`held_out_logs`), in step order: ``[{"step", "accuracy",
    "format_rate"}, ...]``; a step logged twice keeps its last value."""
    points = {
        e["step"]: {"step": e["step"], "accuracy": e["eval_accuracy"], "format_rate": e.get("eval_format_rate")}
        for e in log_history
        if "eval_accuracy" in e and "step" in e
    }
    return [points[step] for step in sorted(points)]


def accuracy_table(what: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> ConsoleTable:
    """The console table (``caption, columns, rows``) of held-out accuracy and format rate before and after; with an
    ``exact`` column (answers scored 1) when some answer earned partial credit, and a ``cut`` column (responses the
    length limit cut) when some was cut."""
    results = (("before", before), ("after", after))
    partial = any(r.get("partial_credit_rows") for _, r in results)
    cut = any(r.get("num_truncated") for _, r in results)
    columns = ("", "accuracy", *(("exact",) if partial else ()), "format rate", *(("cut",) if cut else ()))
    rows = [
        (
            name,
            f"{r['accuracy']:.1%}",
            *((f"{r['exact_accuracy']:.1%}",) if partial else ()),
            f"{r['format_rate']:.1%}",
            *((r.get("num_truncated"),) if cut else ()),
        )
        for name, r in results
    ]
    return ConsoleTable(f"{what} ({held_out_caption(after)}, greedy)", columns, rows)


def write_model_card(trainer: Any, output_dir: str | Path, base_model: str | None, dataset: str | None = None) -> Path:
    """Write ``output_dir/README.md`` with TRL's model card template, naming the real base model
    (``trl_ext.models.base_model_id``) and the output folder as the model to load."""
    from trl.trainer.utils import generate_model_card

    base = base_model_id(base_model)
    embedded = base == EMBEDDED_BASE_MODEL and str(base_model) != EMBEDDED_BASE_MODEL  # our dequantized copy of it
    card = generate_model_card(
        base_model=base,
        model_name=Path(output_dir).name,
        hub_model_id=str(output_dir),
        dataset_name=None,
        tags=sorted(set(getattr(trainer, "_tag_names", [])) | {"trl", "trl_ext"}),
        wandb_url=None,
        trackio_url=None,
        trainer_name=getattr(trainer, "_name", type(trainer).__name__),
        trainer_citation=getattr(trainer, "_paper", {}).get("citation"),
        template_file=getattr(trainer, "_template_file", None),
        paper_title=getattr(trainer, "_paper", {}).get("title"),
        paper_id=getattr(trainer, "_paper", {}).get("id"),
    )
    text = str(card)
    if Path(base).exists():  # a local base model: no Hub link
        text = text.replace(f"[{base}](https://huggingface.co/{base})", f"`{base}` (local)")
    if embedded:
        text = text.replace(
            f"[{base}](https://huggingface.co/{base})",
            f"[{base}](https://huggingface.co/{base}) (trl_ext's embedded copy: its Q4_1 GGUF, dequantized)",
        )
    if dataset:
        text = text.replace("It has been trained using", f"Training data: {dataset}.\nIt has been trained using", 1)
    path = Path(output_dir) / "README.md"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- what a run leaves
class Records(NamedTuple):
    """Per-example records: file stem -> rows, each file written as JSON lines (``Records({"eval_after": rows})``
    -> ``eval_after.jsonl``)."""

    files: Mapping[str, Sequence[Mapping[str, Any]]]


class ModelCard(NamedTuple):
    """The model card, ``README.md`` (:func:`write_model_card`), naming the base model (None: the embedded model's
    source) and the dataset; the trainer given to :func:`finish` names the training method."""

    base_model: str | None
    dataset: str | None = None


class Curves(NamedTuple):
    """A plot of the training log (:func:`plot_curves`): ``file`` (``"training_curves.png"``), its ``(log key,
    title)`` panels and the points to mark; ``points`` None marks the held-out evaluations of the log
    (``metrics["eval_curve"]``)."""

    file: str
    panels: Sequence[tuple[str, str]]
    points: Mapping[str, Sequence[tuple[int, float]]] | None = None


class Record(NamedTuple):
    """``experiment.md`` (:func:`write_experiment_record`) under the heading ``title``: ``results`` is ``(header,
    rows)`` of its results table (None: the scalar entries of ``metrics``), ``observations`` sentences placed before
    ``observe_training``'s. A run without a ``Record`` writes no ``experiment.md``."""

    title: str
    results: tuple[Sequence[str], Sequence[Sequence[Any]]] | None = None
    observations: Sequence[str] = ()


class ConsoleTable(NamedTuple):
    """A table printed to the console (rich): ``(caption, columns, rows)``."""

    caption: str
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]


@dataclasses.dataclass(frozen=True, init=False)
class ConsoleLines:
    """Lines printed after the tables (a summary, examples), as given: ``ConsoleLines("line 1", "line 2")``."""

    lines: tuple[str, ...]

    def __init__(self, *lines: str):
        object.__setattr__(self, "lines", lines)


@dataclasses.dataclass(frozen=True, init=False)
class Written:
    """Files the recipe's library calls wrote themselves (``Written("responses.jsonl")``), named in the closing
    "Wrote" line."""

    files: tuple[str, ...]

    def __init__(self, *files: str):
        object.__setattr__(self, "files", files)


Output = Records | ModelCard | Curves | Record | ConsoleTable | ConsoleLines | Written
"""One thing :func:`finish` writes or prints; a run's outputs are one list of them."""

_AT_MOST_ONCE = (ModelCard, Record)  # one file each: a second would overwrite the first


def _by_kind(outputs: Sequence[Output]) -> dict[type, list]:
    """``{kind: [outputs of that kind, in the order given]}``; an unknown kind, or a second ``ModelCard`` or ``Record``,
    raises."""
    kinds: dict[type, list] = {kind: [] for kind in Output.__args__}
    for output in outputs:
        if type(output) not in kinds:
            raise TypeError(
                f"report.finish: outputs[{list(outputs).index(output)}] is a {type(output).__name__}; expected one of "
                + ", ".join(f"report.{kind.__name__}" for kind in kinds)
            )
        kinds[type(output)].append(output)
    for kind in _AT_MOST_ONCE:
        if len(kinds[kind]) > 1:
            raise ValueError(f"report.finish: {len(kinds[kind])} report.{kind.__name__} outputs; give at most one")
    return kinds


def _add_run_metrics(
    metrics: dict[str, Any], run: Any, trainer: Any, log_history: Any, speed: Mapping[str, Any] | None
) -> None:
    """What every run records in ``metrics``, unless given (see :func:`finish`): the training's steps, seconds,
    log, held-out curve and runtime (with a trainer); the roofline (when timed). :func:`finish` adds where the time
    went last, once the outputs are written."""
    if trainer is not None and hasattr(trainer, "state"):
        metrics.setdefault("train_steps", trainer.state.global_step)
        metrics.setdefault("train_seconds", run.phase_seconds.get("train"))
        metrics.setdefault("log_history", log_history)
        if eval_curve(log_history):  # held-out accuracy at each evaluated step
            metrics.setdefault("eval_curve", eval_curve(log_history))
        if hasattr(trainer, "accelerator"):
            accelerator = trainer.accelerator
            runtime = {"processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type)}
            metrics.setdefault("runtime", {**(speed or {}), **runtime})
    if run.timer.seconds:  # the profiler or an exclusive phase ran
        roofline = run.roofline_report()  # the optimizer's floor over the steps the profilers timed
        if roofline is not None:  # how far each phase ran from what the machine allows
            metrics.setdefault("roofline", roofline)


def _write_record(
    out: Path, record: Record, run: Any, metrics: Mapping[str, Any], log_history: Any, git: Mapping[str, Any]
) -> None:
    """``experiment.md`` of :class:`Record` ``record``: the run's configs, the results (default: the scalar
    metrics), every plot in ``out``, the observations and the generation budget the configs set."""
    configs = [c for c in run.configs.values() if dataclasses.is_dataclass(c) and not isinstance(c, type)]
    header, rows = record.results or (("metric", "value"), scalar_results(metrics))
    budget = next((c.max_completion_length for c in configs if getattr(c, "max_completion_length", None)), None)
    write_experiment_record(
        out,
        record.title,
        configs=configs,
        results=rows,
        results_header=header,
        plots=sorted(p.name for p in out.glob("*.png")),
        observations=record.observations,
        log_history=log_history,
        max_completion_length=budget,
        git=git,
        project_git=getattr(run, "project_git", None),
    )


def _print_summary(
    kinds: dict[type, list], run: Any, metrics: Mapping[str, Any], written: list[str], out: Path
) -> Console:
    """What :func:`finish` prints, in its order; returns the console."""
    console = Console(soft_wrap=True)
    for table in kinds[ConsoleTable]:
        print_table(*table, console=console)
    for line in (line for lines in kinds[ConsoleLines] for line in lines.lines):
        console.print(line, markup=False)
    for name in run.reused:
        console.print(f"({name} reused from the first run of this folder: {name}.json)", markup=False)
    if "time_breakdown" in metrics:
        breakdown, speed = metrics["time_breakdown"], metrics.get("runtime", {})
        how = f" ({speed['threads']} threads, {speed['precision']})" if "threads" in speed else ""
        console.print(f"Where the {breakdown['total']:.0f} s went{how}:\n{format_breakdown(breakdown)}", markup=False)
    if "roofline" in metrics:
        console.print(format_roofline(metrics["roofline"]), markup=False)
    saved = " and the trained model" if kinds[ModelCard] else ""
    console.print(f"Wrote {', '.join(written)}{saved} to {out}", markup=False)
    return console


def finish(
    run: Any,
    metrics: Mapping[str, Any],
    outputs: Sequence[Output],
    *,
    trainer: Any = None,
    log_history: Sequence[Mapping[str, Any]] | None = None,
    speed: Mapping[str, Any] | None = None,
    git: Mapping[str, Any] | None = None,
) -> Console | None:
    """Write everything a finished run leaves and print its summary; on the main process only (others: None).

    Written in this order: :class:`Records`, the :class:`ModelCard`, each :class:`Curves` plot, the :class:`Record`
    (``experiment.md``), ``metrics.json`` (last: its presence marks a finished run); then printed: each
    :class:`ConsoleTable` and :class:`ConsoleLines`, results reused on resume, where the time went, the roofline, and
    the closing "Wrote ..." line (naming :class:`Written`'s files too).

    Args:
        run: the ``trl_ext.run.RecipeRun`` (output folder, configs, provenance).
        metrics: the results; ``metrics.json`` adds ``run.provenance()`` and, unless given: with a ``trainer``,
            ``train_steps``, ``train_seconds``, ``log_history`` and ``eval_curve`` (:func:`eval_curve`); when the run
            timed exclusive phases, ``time_breakdown`` and, when it watched a model, ``roofline``.
        outputs: the :data:`Output` items, in any order.
        trainer: the trainer whose model card template names the training method; its ``state.log_history`` is
            the default ``log_history``.
        log_history: the training log for :class:`Curves` and for the record's observations.
        speed: what ``trl_ext.runtime.apply_speed_defaults`` chose; with a trainer, recorded as ``runtime`` with the
            number of processes and accelerate's distributed type, unless ``metrics`` has a ``runtime``.
        git: trl_ext's ``trl_ext.run.git_state`` (default: ``run.git``, taken when the run started).

    Returns:
        The console (for a recipe's own closing lines), or None on other processes.

    Raises:
        TypeError: an item of ``outputs`` that is no :data:`Output`.
        ValueError: more than one :class:`ModelCard` or :class:`Record`.
    """
    kinds = _by_kind(outputs)
    if not is_main_process():
        return None
    started = time.time()
    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = ["metrics.json", *(name for w in kinds[Written] for name in w.files)]
    for records in kinds[Records]:
        for stem, rows in records.files.items():
            with open(out / f"{stem}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    metrics = dict(metrics)
    if trainer is not None and hasattr(trainer, "state"):
        log_history = trainer.state.log_history if log_history is None else log_history
    _add_run_metrics(metrics, run, trainer, log_history, speed)
    for card in kinds[ModelCard]:
        write_model_card(trainer, out, card.base_model, card.dataset)
    for name, panels, points in kinds[Curves]:
        if points is None and metrics.get("eval_curve"):  # every held-out evaluation marked with its value
            points = {
                key: [(p["step"], p[field]) for p in metrics["eval_curve"] if p[field] is not None]
                for key, field in (("eval_accuracy", "accuracy"), ("eval_format_rate", "format_rate"))
            }
        plot = plot_curves(log_history or [], panels, out / name, points)
        written.append(plot.name if plot else "no plot")
    for record in kinds[Record]:
        _write_record(out, record, run, metrics, log_history, run.git if git is None else git)
        written.append("experiment.md")
    if run.timer.seconds and "time_breakdown" not in metrics:  # where the time went, writing the outputs included
        run.timer.add("finish", time.time() - started)
        metrics["time_breakdown"] = run.time_breakdown()
    run.write_metrics(metrics)  # last: its presence marks a finished run
    return _print_summary(kinds, run, metrics, written, out)


def finish_comparison(
    run: Any,
    results: Sequence[Mapping[str, Any]],
    setup: Mapping[str, Any],
    *,
    title: str,
    output_dir: str | os.PathLike | None = None,
    panels: Sequence[tuple[str, str]] | None = None,
    command: str | None = None,
    record: tuple[Sequence[str], Sequence[Sequence[Any]], Sequence[str]] | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    git: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """A comparison's files, in one call: ``comparison.json`` (setup, every arm's summary and the run's provenance),
    ``comparison.md`` and ``comparison.png`` (``trl_ext.compare.write_comparison``), ``experiment.md``; prints the
    table. Main process only.

    Args:
        run: the ``trl_ext.run.RecipeRun``.
        results: the arm summaries of ``trl_ext.compare.run_comparison``.
        setup: what every arm shares (model, data, budget), listed first in ``comparison.md``.
        title: heading of both files.
        output_dir: where (default ``run.output_dir``; the ablations write one folder per experiment).
        panels: the plot's ``(log key, title)`` panels (default ``trl_ext.compare.DEFAULT_PANELS``).
        command: the command that reproduces it.
        record: ``(header, rows, observations)`` of ``experiment.md`` (default :func:`comparison_results`).
        hyperparameters: extra rows of the record's hyperparameter table.
        git: trl_ext's ``trl_ext.run.git_state`` (default: ``run.git``, taken when the run started).

    Returns:
        ``{"json", "md", "png"}`` paths.
    """
    from trl_ext.compare import DEFAULT_PANELS, write_comparison  # comparisons only: compare loads TRL's trainers

    out = Path(output_dir if output_dir is not None else run.output_dir)
    paths = write_comparison(
        results, out, setup, title=title, panels=panels or DEFAULT_PANELS, command=command, provenance=run.provenance()
    )
    if record is None:
        rows, notes = comparison_results(results)
        header = COMPARISON_HEADER
    else:
        header, rows, notes = record
    configs = [c for c in run.configs.values() if dataclasses.is_dataclass(c) and not isinstance(c, type)]
    write_experiment_record(
        out,
        title,
        configs=configs,
        hyperparameters=hyperparameters,
        results=rows,
        results_header=header,
        plots=["comparison.png"],
        observations=notes,
        command=command,
        git=run.git if git is None else git,
        project_git=getattr(run, "project_git", None),
    )
    print(paths["md"].read_text(), flush=True)
    print(f"Wrote {', '.join(str(p) for p in paths.values())}", flush=True)
    return paths


# ------------------------------------------------------------------------------- recipes evaluated before and after
def before_after_table(
    caption: str, before: Mapping[str, float], after: Mapping[str, float], keys: Sequence[str]
) -> ConsoleTable:
    """The console table of a recipe evaluated before and after training (sft_instruct, reward_model, dpo): one row
    per name in ``keys`` (:func:`before_after_rows`).

    Raises:
        KeyError: a name missing from ``before`` or ``after``.
    """
    return ConsoleTable(caption, ("held-out", "before", "after"), before_after_rows(before, after, keys))


def before_after_metrics(
    run: Any,
    trainer: Any,
    train_output: Any,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    model: str | None,
    script_args: Any,
    **data: Any,
) -> dict[str, Any]:
    """The ``metrics`` of a recipe evaluated before and after training, keys in this order: ``recipe``, ``model``
    (None: the embedded model's name), ``data`` as given, ``train_seconds`` (to 0.1 s), ``train_steps`` and
    ``train_loss`` (from ``trainer.train()``'s output: a resumed run counts the steps before the resume),
    ``before``, ``after``, ``log_history`` and ``script_args`` (as a dict).

    Raises:
        KeyError: the run has no ``train`` phase yet.
    """
    return {
        "recipe": run.name,
        "model": model or DEFAULT_MODEL,
        **data,
        "train_seconds": round(run.phase_seconds["train"], 1),
        "train_steps": train_output.global_step,
        "train_loss": train_output.training_loss,
        "before": before,
        "after": after,
        "log_history": trainer.state.log_history,
        "script_args": dataclasses.asdict(script_args),
    }
