"""Reports of a comparison: the Markdown table, the curves plot, and the files written."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trl_ext.models import DEFAULT_MODEL


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _fmt_num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _settings_text(arm: Mapping[str, Any]) -> str:
    task = [f"task={arm['task']}"] if arm.get("task") else []
    return ", ".join(task + [f"{k}={v}" for k, v in arm["settings"].items()])


def _fmt_accuracy(r: Mapping[str, Any]) -> str:
    se = r.get("final_accuracy_se")
    return _fmt_pct(r["final_accuracy"]) + (f" ± {100 * se:.1f}" if se is not None else "")


def comparison_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table with one row per arm: accuracy (final, ± its standard error in points when the number of
    problems is known; best@step), final train reward, median s/step, peak memory (GiB), generated tokens/s and the
    arm's settings."""
    lines = [
        "| arm | trainer | held-out acc. (final) | best (step) | train reward (last 5) | s/step (median) | peak mem "
        "(GiB) " + "| gen. tok/s | settings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] is not None else None
        best = f"{_fmt_pct(r['best_accuracy'])} ({r['best_step']})" if r["best_accuracy"] is not None else "n/a"
        lines.append(
            f"| {r['name']} | {r['trainer']} | {_fmt_accuracy(r)} | {best} | "
            f"{_fmt_num(r['final_reward'], '.3f')} | {_fmt_num(r['median_step_seconds'], '.2f')} | "
            f"{_fmt_num(mem, '.2f')} | {_fmt_num(r['gen_tokens_per_second'], '.1f')} | {_settings_text(r)} |"
        )
    return "\n".join(lines)


DEFAULT_PANELS = (
    ("reward", "train reward (batch mean)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
)
"""(logged metric, panel title) plotted next to the held-out accuracy panel by default."""


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _saved(fig: Any, path: str | os.PathLike) -> Path:
    """``fig`` written to ``path`` (folders made, 120 dpi) and closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_comparison(
    results: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "",
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    accuracy_title: str = "held-out accuracy (greedy)",
    smooth: int = 5,
) -> Path:
    """Plot held-out accuracy and the logged ``panels`` per arm (one color per arm; upstream arms dashed).

    Logged curves are drawn raw (faint) and as a running mean over ``smooth`` steps (bold). Saves a PNG and returns
    its path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 1 + len(panels)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.6 * rows), squeeze=False)
    axes = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        # Later arms are drawn thinner and on top, so arms whose curves coincide stay visible as nested lines and
        # markers; upstream arms are dashed and drawn over everything, so an arm with the same math shows through
        # the gaps of the upstream curve.
        upstream = r["trainer"] == "trl"
        style = "--" if upstream else "-"
        z, width, marker = (100 if upstream else 2) + i, max(1.2, 3.2 - 0.6 * i), max(3.0, 9.0 - 2.0 * i)
        label = f"{r['name']} ({r['trainer']})"
        acc = r["accuracy_curve"]
        if acc:
            axes[0].plot(
                [s for s, _ in acc],
                [a for _, a in acc],
                style,
                marker="o",
                color=color,
                label=label,
                zorder=z,
                linewidth=width,
                markersize=marker,
            )
        for ax, (key, _) in zip(axes[1:], panels):
            curve = r["curves"].get(key, [])
            if not curve:
                continue
            steps, values = [s for s, _ in curve], [v for _, v in curve]
            ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=1, zorder=z)
            ax.plot(steps, _running_mean(values, smooth), style, color=color, linewidth=width, label=label, zorder=z)
    axes[0].set_title(accuracy_title)
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for ax, (_, panel_title) in zip(axes[1:], panels):
        ax.set_title(panel_title + (f" ({smooth}-step mean)" if smooth > 1 else ""))
    for ax in axes[:n]:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[n:]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels() if n > 1 else ([], [])
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4) or 1, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _saved(fig, path)


def seconds_to_gain(result: Mapping[str, Any], gain: float) -> float | None:
    """Training seconds an arm took to first reach ``gain`` (e.g. 0.55 = 55 points) of held-out accuracy over its
    step-0 evaluation, at one of its evaluated steps; None if it never did (or was not evaluated at step 0)."""
    curve = result.get("accuracy_by_seconds") or []
    steps = result.get("accuracy_curve") or []
    if not curve or not steps or steps[0][0] != 0:
        return None
    start = curve[0][1]
    return next((seconds for seconds, accuracy in curve if accuracy - start >= gain - 1e-9), None)


def plot_accuracy_against_seconds(
    results: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "", gain: float | None = None
) -> Path:
    """Held-out accuracy of each arm against its training wall seconds (``accuracy_by_seconds``; evaluations take
    none of them); with ``gain``, a dotted line at step 0's accuracy + gain. Saves a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for r in results:
        curve = r.get("accuracy_by_seconds") or []
        if curve:
            ax.plot(
                [s for s, _ in curve],
                [a for _, a in curve],
                "--" if r["trainer"] == "trl" else "-",
                marker="o",
                label=f"{r['name']} ({r['trainer']})",
            )
    if gain is not None:
        starts = [r["accuracy_by_seconds"][0][1] for r in results if r.get("accuracy_by_seconds")]
        if starts:
            ax.axhline(starts[0] + gain, linestyle=":", color="gray", label=f"step 0 + {gain * 100:.0f} points")
    ax.set_xlabel("training wall seconds (held-out evaluations excluded)")
    ax.set_title(title or "held-out accuracy (greedy) against training time")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return _saved(fig, path)


def write_comparison(
    results: Sequence[Mapping[str, Any]],
    output_dir: str | os.PathLike,
    setup: Mapping[str, Any],
    *,
    title: str = "",
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    command: str | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``comparison.json`` (setup + every arm's summary + ``provenance``: the command, configs, versions and
    phase times of ``trl_ext.run.RecipeRun.provenance``), ``comparison.md`` (setup, command, table),
    ``comparison.png`` (:func:`plot_comparison`) and, when arms were evaluated during training,
    ``comparison_seconds.png`` (:func:`plot_accuracy_against_seconds`) into ``output_dir``; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "comparison.json", "md": out / "comparison.md", "png": out / "comparison.png"}
    data = {"setup": dict(setup), "arms": list(results), **(provenance or {})}
    paths["json"].write_text(json.dumps(data, indent=2, default=str))
    md = [f"# {title or 'Comparison'}", ""]
    md += [f"- {k}: {v}" for k, v in setup.items()]
    if command:
        md += ["", "Reproduce with:", "", f"    {command}"]
    md += ["", comparison_table(results), "", "![comparison](comparison.png)", ""]
    if any(len(r.get("accuracy_by_seconds") or []) > 1 for r in results):  # accuracy against training time too
        paths["seconds_png"] = plot_accuracy_against_seconds(results, out / "comparison_seconds.png", title=title)
        md += ["![accuracy against training seconds](comparison_seconds.png)", ""]
    paths["md"].write_text("\n".join(md))
    plot_comparison(results, paths["png"], title=title, panels=panels)
    return paths


def setup_summary(
    training_args: Any,
    model_args: Any,
    eval_steps: Sequence[int],
    speed: Mapping[str, Any] | None = None,
    first: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What every arm of a comparison shares, for the top of ``comparison.md``: ``first`` (the recipe's own
    entries: experiment, data, task), then the model, step budget, evaluation steps, completions per step (per
    device x accumulation x processes), group size, completion budget, learning rate, temperature, seed, device and
    -- set once for every arm by ``trl_ext.runtime`` -- threads and precision."""
    from accelerate import PartialState

    state, first = PartialState(), dict(first or {})
    return {
        **first,
        "model": first.get("model") or model_args.model_name_or_path or DEFAULT_MODEL,
        "steps per arm": training_args.max_steps,
        "held-out evaluation at steps": list(eval_steps),
        "completions per step": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * state.num_processes,
        "num_generations": training_args.num_generations,
        "max_completion_length": training_args.max_completion_length,
        "learning_rate": training_args.learning_rate,
        "temperature": training_args.temperature,
        "seed": training_args.seed,
        "device": str(state.device) + (f" x {state.num_processes}" if state.num_processes > 1 else ""),
        **({"threads": speed["threads"], "precision": speed["precision"]} if speed else {}),
    }
