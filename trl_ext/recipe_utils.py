"""Plumbing shared by the recipes: default-config parsing and the before/after report."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trl
from rich.console import Console
from rich.table import Table


def parse_recipe_args(dataclass_types: Sequence[type], default_config: str | Path, argv: Sequence[str] | None = None):
    """``trl.TrlParser(dataclass_types).parse_args_and_config`` with ``--config default_config`` when none is given.

    Flags on the command line (``argv``, default ``sys.argv[1:]``) override the config's values, as in TRL scripts.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        argv = ["--config", str(default_config), *argv]
    return trl.TrlParser(tuple(dataclass_types)).parse_args_and_config(argv)


def write_report(
    output_dir: str | Path,
    report: dict[str, Any],
    title: str,
    before: dict[str, float],
    after: dict[str, float],
    keys: Sequence[str],
) -> Console:
    """Write ``report`` to ``output_dir/metrics.json`` and print a before/after table of ``keys``.

    Returns the console, for the recipe's closing lines.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.json").write_text(json.dumps(report, indent=2))
    table = Table(title=title)
    for column in ("held-out", "before", "after"):
        table.add_column(column)
    for key in keys:
        table.add_row(key, f"{before[key]:.4f}", f"{after[key]:.4f}")
    console = Console()
    console.print(table)
    return console
