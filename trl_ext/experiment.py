"""Transition shim (removed once every recipe is ported to the new layout): now :mod:`trl_ext.report`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trl_ext.report import (  # noqa: F401
    comparison_results,
    config_hyperparameters,
    git_state,
    observe_training,
    scalar_results,
    write_experiment_record,
)


def write_recipe_record(output_dir: str | os.PathLike, title: str, *configs: Any, command: str | None = None) -> Path:
    out = Path(output_dir)
    metrics_path, comparison_path = out / "metrics.json", out / "comparison.json"
    log_history, observations = None, []
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        rows: list[Sequence[Any]] = scalar_results(metrics)
        header: Sequence[str] = ("metric", "value")
        log_history = metrics.get("log_history")
    elif comparison_path.exists():
        from trl_ext.report import COMPARISON_HEADER

        rows, observations = comparison_results(json.loads(comparison_path.read_text())["arms"])
        header = COMPARISON_HEADER
    else:
        raise FileNotFoundError(f"{out} holds neither metrics.json nor comparison.json; write the recipe's results first")
    budget = next((c.max_completion_length for c in configs if getattr(c, "max_completion_length", None)), None)
    return write_experiment_record(
        out, title, configs=configs, results=rows, results_header=header, plots=sorted(p.name for p in out.glob("*.png")),
        observations=observations, log_history=log_history, max_completion_length=budget, command=command,
    )
