"""Transition shim (removed once every recipe is ported to the new layout): the old names of what every recipe
shared, now in :mod:`trl_ext.cli` (flags, checks, the command line), :mod:`trl_ext.run` (output folder, resume,
signals) and :mod:`trl_ext.report` (metrics.json, experiment.md, plots, console table, model card)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from trl_ext.cli import (  # noqa: F401
    COMPARISON_HELP,
    MODEL_NAME_HELP,
    RecipeArguments,
    RecipeError,
    check_fills_one_step,
    check_model_options,
    check_model_source,
    user_input,
)
from trl_ext.cli import main as recipe_main  # noqa: F401
from trl_ext.cli import parse as parse_recipe_args  # noqa: F401
from trl_ext.models import EMBEDDED_ALIAS, EMBEDDED_BASE_MODEL  # noqa: F401
from trl_ext.report import before_after_rows, plot_curves, print_table, write_model_card  # noqa: F401
from trl_ext.run import RecipeRun as _RecipeRun
from trl_ext.run import (  # noqa: F401
    check_output_dir,
    file_digest,
    refuse_resume,
    resolve_resume,
    resume_command,
)


class RecipeRun(_RecipeRun):
    def make_current(self) -> None:
        pass


def refuse_comparison_resume(training_args: Any) -> None:
    refuse_resume(training_args.resume_from_checkpoint, "a comparison trains every arm from scratch", "comparison")


def add_provenance(json_path: str | Path, run: RecipeRun) -> None:
    path = Path(json_path)
    data = json.loads(path.read_text())
    data.update(run.provenance())
    path.write_text(json.dumps(data, indent=2, default=str))


def print_before_after(title: str, before: Mapping[str, float], after: Mapping[str, float], keys: Sequence[str]) -> Console:
    return print_table(title, ("held-out", "before", "after"), before_after_rows(before, after, keys))


def write_report(output_dir, report, title, before, after, keys, run=None) -> Console:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    run.write_metrics(report)
    return print_before_after(title, before, after, keys)
