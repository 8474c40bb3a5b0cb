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


def seconds_to_gain(result: Mapping[str, Any], gain: float, key: str = "accuracy_by_seconds") -> float | None:
    """Training seconds an arm took to first reach ``gain`` (e.g. 0.55 = 55 points) of held-out accuracy over its
    step-0 evaluation, at one of its evaluated steps; None if it never did (or was not evaluated at step 0).
    ``key`` picks the clock: ``"accuracy_by_seconds"`` (wall) or ``"accuracy_by_cpu_seconds"`` (CPU)."""
    curve = result.get(key) or []
    steps = result.get("accuracy_curve") or []
    if not curve or not steps or steps[0][0] != 0:
        return None
    start = curve[0][1]
    return next((seconds for seconds, accuracy in curve if accuracy - start >= gain - 1e-9), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def time_to_reference_gain(results: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The time each arm took to reach the reference arm's final gain, on the wall and the CPU clock.

    The reference is the first upstream arm (``trainer == "trl"``), else the first arm; its gain is its last
    evaluation's accuracy minus its step-0 accuracy (issue 47's measure: "trl_ext reaches upstream's final gain in
    at most 0.4x of upstream's time"). Each arm's times are :func:`seconds_to_gain` at that gain (its first
    evaluation at least that far over its own step 0; the reference's own is where it first got there, which may be
    before its last step), and each ratio is the arm's time over the reference's.

    Returns:
        ``{"reference", "gain", "arms": [{"name", "trainer", "gain", "wall_seconds", "cpu_seconds", "wall_ratio",
        "cpu_ratio"}, ...]}`` (a time None where the arm never got there or was not timed, a ratio None where
        either time is), or None when no arm was evaluated at step 0 and after it.
    """
    evaluated = [r for r in results if len(r.get("accuracy_curve") or []) > 1 and r["accuracy_curve"][0][0] == 0]
    if not evaluated:
        return None
    ref = next((r for r in evaluated if r["trainer"] == "trl"), evaluated[0])
    gain = ref["accuracy_curve"][-1][1] - ref["accuracy_curve"][0][1]
    out: dict[str, Any] = {"reference": ref["name"], "gain": gain, "arms": []}
    if gain <= 0:
        return out  # nothing to reach: the reference did not gain
    ref_wall, ref_cpu = seconds_to_gain(ref, gain), seconds_to_gain(ref, gain, "accuracy_by_cpu_seconds")
    for r in evaluated:
        wall, cpu = seconds_to_gain(r, gain), seconds_to_gain(r, gain, "accuracy_by_cpu_seconds")
        out["arms"].append(
            {
                "name": r["name"],
                "trainer": r["trainer"],
                "gain": r["accuracy_curve"][-1][1] - r["accuracy_curve"][0][1],
                "wall_seconds": wall,
                "cpu_seconds": cpu,
                "wall_ratio": _ratio(wall, ref_wall),
                "cpu_ratio": _ratio(cpu, ref_cpu),
            }
        )
    return out


def time_to_gain_table(summary: Mapping[str, Any] | None) -> str:
    """Markdown for :func:`time_to_reference_gain`'s result: one row per arm (its own final gain, the training wall
    and CPU seconds to the reference's gain and their ratios to the reference's), or one line saying why not."""
    if summary is None:
        return "Time to a gain: no arm was evaluated at step 0 and after it."
    gain, ref = summary["gain"], summary["reference"]
    if gain <= 0:
        return f"Time to a gain: the reference arm {ref!r} did not gain ({100 * gain:+.1f} points), nothing to reach."
    lines = [
        f"Time to {ref!r}'s final gain ({100 * gain:+.1f} points over step 0; training seconds, evaluations "
        "excluded; ratio = arm / reference):",
        "",
        "| arm | trainer | own final gain | wall s to the gain | ratio | CPU s to the gain | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in summary["arms"]:
        lines.append(
            f"| {a['name']} | {a['trainer']} | {100 * a['gain']:+.1f} | {_fmt_num(a['wall_seconds'], '.1f')} | "
            f"{_fmt_num(a['wall_ratio'], '.3f')} | {_fmt_num(a['cpu_seconds'], '.1f')} | "
            f"{_fmt_num(a['cpu_ratio'], '.3f')} |"
        )
    return "\n".join(lines)


def plot_accuracy_against_seconds(
    results: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "", gain: float | None = None
) -> Path:
    """Held-out accuracy of each arm against its training wall seconds (``accuracy_by_seconds``; evaluations take
    none of them) and, where recorded, against its training CPU seconds (``accuracy_by_cpu_seconds``, a second
    panel); with ``gain``, a dotted line at the first arm's step-0 accuracy + gain. Saves a PNG and returns its
    path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clocks = [("accuracy_by_seconds", "training wall seconds (held-out evaluations excluded)")]
    if any(r.get("accuracy_by_cpu_seconds") for r in results):
        clocks.append(("accuracy_by_cpu_seconds", "training CPU seconds (user + system, all threads)"))
    fig, axes = plt.subplots(1, len(clocks), figsize=(7.0 * len(clocks), 4.2), squeeze=False)
    starts = [r["accuracy_by_seconds"][0][1] for r in results if r.get("accuracy_by_seconds")]
    for ax, (key, label) in zip(axes[0], clocks):
        for r in results:
            curve = r.get(key) or []
            if curve:
                ax.plot(
                    [s for s, _ in curve],
                    [a for _, a in curve],
                    "--" if r["trainer"] == "trl" else "-",
                    marker="o",
                    label=f"{r['name']} ({r['trainer']})",
                )
        if gain is not None and starts:
            ax.axhline(starts[0] + gain, linestyle=":", color="gray", label=f"step 0 + {gain * 100:.0f} points")
        ax.set_xlabel(label)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
    fig.suptitle(title or "held-out accuracy (greedy) against training time")
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
    ``comparison_seconds.png`` (:func:`plot_accuracy_against_seconds`) into ``output_dir``; return their paths.
    Both the JSON (``time_to_gain``) and the Markdown hold :func:`time_to_reference_gain`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "comparison.json", "md": out / "comparison.md", "png": out / "comparison.png"}
    to_gain = time_to_reference_gain(results)
    data = {"setup": dict(setup), "arms": list(results), "time_to_gain": to_gain, **(provenance or {})}
    paths["json"].write_text(json.dumps(data, indent=2, default=str))
    md = [f"# {title or 'Comparison'}", ""]
    md += [f"- {k}: {v}" for k, v in setup.items()]
    if command:
        md += ["", "Reproduce with:", "", f"    {command}"]
    md += ["", comparison_table(results), "", time_to_gain_table(to_gain), "", "![comparison](comparison.png)", ""]
    if any(len(r.get("accuracy_by_seconds") or []) > 1 for r in results):  # accuracy against training time too
        gain = to_gain["gain"] if to_gain and to_gain["gain"] > 0 else None
        paths["seconds_png"] = plot_accuracy_against_seconds(
            results, out / "comparison_seconds.png", title=title, gain=gain
        )
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
    -- set once for every arm by ``trl_ext.runtime`` (``speed``: its ``apply_speed_defaults``) -- threads, precision
    and allocator."""
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
        **({key: speed[key] for key in ("threads", "precision", "allocator")} if speed else {}),
    }
