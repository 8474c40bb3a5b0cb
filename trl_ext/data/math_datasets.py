"""Loaders for math question datasets (GSM8K, MATH and saved arithmetic problems) in TRL's prompt format.

Every loader returns a ``datasets.Dataset`` with a ``prompt`` column (see :mod:`trl_ext.data.prompts`) and an
``answer`` column holding the normalized final answer string, which is exactly the ground truth the reward
functions of :mod:`trl_ext.rewards` read (TRL passes dataset columns to reward functions as keyword arguments).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset

from trl_ext import machine
from trl_ext.data.prompts import format_prompt
from trl_ext.errors import read_text
from trl_ext.rewards.math_answers import extract_boxed_parts, parse_gsm8k_ground_truth, to_decimal

KINDS = ("gsm8k", "math", "arithmetic")
"""Dataset kinds understood by :func:`load_math_dataset`."""

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local file suffix -> ``datasets`` builder name."""

HUB_DEFAULT_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}
"""Config used for a hub id when ``config_name`` is not given (GSM8K has no default config)."""


class _BadRow(ValueError):
    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def json_line(line: str, where: str) -> Any:
    """One line of a JSON-lines file, parsed; invalid JSON raises ValueError ``"<where>: invalid JSON (...)"``."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg})") from None


def _read_json_rows(path: Path) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Rows of a local JSON file: JSON lines (.jsonl, or a .json holding one object per line), or a .json array
    of objects (or ``{"data": [...]}``, as ``datasets`` reads it). Errors name the file, the line and the problem.
    Returns the rows and, for JSON lines, each row's line number."""
    text = read_text(path)  # UTF-8, a byte-order mark dropped; another encoding refused naming the file
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; expected one JSON object per row")
    if path.suffix.lower() == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            if text.lstrip()[:1] == "[":
                raise ValueError(f"{path} line {err.lineno}: invalid JSON ({err.msg})") from None
            value = None  # maybe JSON lines in a .json file
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            value = value["data"]
        if isinstance(value, list):
            for i, row in enumerate(value):
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: row {i} (0-based) is a {type(row).__name__}; expected a JSON object")
            if not value:
                raise ValueError(f"{path}: the JSON array is empty; expected one object per row")
            return value, None
    rows, lines = [], []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = json_line(line, f"{path} line {line_number}")
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(line_number)
    return rows, lines


def _read_parquet_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a damaged or non-parquet file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    if table.num_rows == 0:
        raise ValueError(f"{path}: the file has no rows")
    return table.to_pylist(), None


def _load_raw(name_or_path: str | Path, split: str, config_name: str | None) -> tuple[Any, str, list[int] | None]:
    """A local .jsonl/.json/.parquet file (read whole, as a list of row dicts) or a hub dataset split (a
    ``datasets.Dataset``); returned with a name for messages and the file line of each row (JSON lines only)."""
    path = Path(name_or_path)
    suffix = path.suffix.lower()
    if suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
        rows, lines = _read_parquet_rows(path) if LOCAL_FORMATS[suffix] == "parquet" else _read_json_rows(path)
        return rows, str(path), lines
    if path.exists():
        raise ValueError(
            f"unsupported local dataset {str(path)!r}: expected a file ending in {sorted(LOCAL_FORMATS)} "
            "or a hub dataset id"
        )
    name = str(name_or_path)
    config = config_name if config_name is not None else HUB_DEFAULT_CONFIGS.get(name)
    dataset = load_dataset(name, config, split=split)
    return dataset, f"{name}" + (f" (config {config!r})" if config else "") + f" split {split!r}", None


def _column_names(raw: Any) -> list[str]:
    if isinstance(raw, list):  # local rows: every key any row has, in first-seen order
        return list(dict.fromkeys(key for row in raw for key in row))
    return raw.column_names


def infer_kind(column_names: list[str]) -> str | None:
    """``"math"`` when there is a ``problem`` column, ``"gsm8k"`` for ``question`` + ``answer``, else ``None``."""
    columns = set(column_names)
    if "problem" in columns:
        return "math"
    if {"question", "answer"} <= columns:
        return "gsm8k"
    return None


def _text(row: dict[str, Any], field: str) -> str:
    value = row[field]
    if value is None:
        raise _BadRow(field, "is missing (null)")
    text = str(value).strip()
    if not text:
        raise _BadRow(field, "is empty")
    return text


def _ground_truth(row: dict[str, Any], kind: str, answer_field: str) -> str:
    text = _text(row, answer_field)
    if kind == "gsm8k":
        try:
            return parse_gsm8k_ground_truth(text)
        except ValueError as err:
            raise _BadRow(
                answer_field,
                f"{err} (for bare-number answers set the kind to 'arithmetic': --dataset_kind arithmetic, "
                "kind='arithmetic')",
            ) from None
    if kind == "arithmetic":
        number = to_decimal(text)
        if number is None or number != number.to_integral_value():
            raise _BadRow(answer_field, f"expected an integer, got {text!r}")
        return str(int(number))
    if answer_field == "solution":  # math without an answer column: the final group of \boxed{} of the solution
        parts, _ = extract_boxed_parts(text)
        if not parts or not all(parts):
            raise _BadRow(answer_field, f"has no complete \\boxed{{...}} answer: ...{text[-80:]!r}")
        return ", ".join(parts)
    return text


def _fields(kind: str | None, columns: list[str], source: str) -> tuple[str, str, str]:
    """``(kind, question field, answer field)`` of data with ``columns``: the kind inferred when None, a math answer
    from ``answer`` or else ``solution``; a kind not inferable or a field absent raises ValueError naming ``source``."""
    if kind is None:
        kind = infer_kind(columns)
        if kind is None:
            raise ValueError(
                f"{source}: cannot infer the dataset kind from columns {columns}: expected 'problem' (+ 'answer' or "
                "'solution') for math, or 'question' + 'answer' for gsm8k; or set the kind (recipes: --dataset_kind, "
                "Python: kind=)"
            )
    question_field = "problem" if kind == "math" else "question"
    answer_field = ("answer" if "answer" in columns else "solution") if kind == "math" else "answer"
    for field in (question_field, answer_field):
        if field not in columns:
            wanted = "'answer' or 'solution'" if kind == "math" and field == answer_field else repr(field)
            raise ValueError(f"{source}: {kind} data needs a column {wanted}; found columns {columns}")
    return kind, question_field, answer_field


def _checked_rows(
    raw: Any,
    columns: list[str],
    kind: str,
    question_field: str,
    answer_field: str,
    source: str,
    lines: list[int] | None,
    skip_bad_rows: bool,
) -> tuple[list[int], list[str]]:
    """The indices of the usable rows of ``raw`` and their ground truths (:func:`load_math_dataset`'s bad rows:
    raised, or skipped with one warning; a math answer taken among boxes separated by text warned about once)."""
    keep: list[int] = []
    answers: list[str] = []
    bad: list[tuple[int, str, str]] = []
    several_boxes: list[int] = []  # rows whose answer box was chosen among boxes separated by text
    for i, row in enumerate(raw):
        if isinstance(raw, list):
            row = {name: row.get(name) for name in columns}
        try:
            _text(row, question_field)
            answers.append(_ground_truth(row, kind, answer_field))
            keep.append(i)
            if answer_field == "solution" and kind == "math" and extract_boxed_parts(row[answer_field])[1] > 0:
                several_boxes.append(i)
        except _BadRow as err:
            if not skip_bad_rows:
                line = f" line {lines[i]}," if lines else ""
                raise ValueError(f"{source}:{line} row {i} (0-based), field {err.field!r}: {err}") from None
            bad.append((i, err.field, str(err)))
    if bad:
        i, field, problem = bad[0]
        warnings.warn(
            f"{source}: skipped {len(bad)} bad row(s) of {len(raw)}; first: row {i} (0-based), field {field!r}: "
            f"{problem}",
            UserWarning,
            stacklevel=3,
        )
    if not keep:
        raise ValueError(f"{source}: no usable rows (read {len(raw)})")
    if several_boxes:
        warnings.warn(
            f"{source}: {len(several_boxes)} row(s) of {len(raw)} have other \\boxed{{}} before the final answer, "
            "separated from it by text (a retracted guess or a boxed intermediate result?); their last box (group) "
            f"was taken as the answer. First: row {several_boxes[0]} (0-based): "
            f"...{raw[several_boxes[0]][answer_field][-120:]!r}",
            UserWarning,
            stacklevel=3,
        )

    return keep, answers


def load_math_dataset(
    name_or_path: str | Path,
    split: str = "train",
    *,
    kind: str | None = None,
    template: str = "chat",
    tokenizer: Any | None = None,
    system_prompt: str | None = None,
    instruction: str | None = None,
    config_name: str | None = None,
    skip_bad_rows: bool = False,
    max_rows: int | None = None,
) -> Dataset:
    """Load GSM8K, MATH or arithmetic questions and format them for TRL.

    Input rows by ``kind``: ``"gsm8k"``: ``question``, ``answer`` ending in ``"#### N"`` (ground truth N, the text kept
    as ``solution``); ``"math"``: ``problem`` and ``answer`` if present, else ``solution``'s final ``\\boxed{...}``
    (several joined boxes are one multi-part answer, ``trl_ext.rewards.extract_boxed_parts``); ``"arithmetic"``:
    ``question`` and an integer ``answer``. Output: every input column plus ``prompt`` (``format_prompt``) and
    ``answer``, the normalized ground truth the reward functions grade against.

    Args:
        name_or_path: a local ``.jsonl``/``.json``/``.parquet`` file (the whole file is the split) or a hub id.
        split: hub split name (default ``"train"``).
        kind: ``"gsm8k"``, ``"math"``, ``"arithmetic"``, or None (default) to infer: ``problem`` -> math, ``question`` +
            ``answer`` -> gsm8k.
        template, tokenizer, system_prompt, instruction: for :func:`trl_ext.data.prompts.format_prompt` (default
            ``"chat"``).
        config_name: hub config; default from :data:`HUB_DEFAULT_CONFIGS`.
        skip_bad_rows: False (default): the first bad row raises; True: bad rows dropped with one ``UserWarning``.
        max_rows: read only the first ``max_rows`` source rows (default: all).

    Returns:
        A ``datasets.Dataset``.

    Raises:
        FileNotFoundError: a local path with a supported suffix does not exist.
        ValueError: unsupported path, unknown ``kind``, missing column, ``max_rows`` < 1, no usable rows, or a bad
            row (named by file, 0-based row and field)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"dataset kind {kind!r} is not supported (--dataset_kind, kind=); expected one of {KINDS}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be None or >= 1, got {max_rows}")
    raw, source, lines = _load_raw(name_or_path, split, config_name)
    if max_rows is not None and max_rows < len(raw):
        raw = raw[:max_rows] if isinstance(raw, list) else raw.select(range(max_rows))

    columns = _column_names(raw)
    kind, question_field, answer_field = _fields(kind, columns, source)
    keep, answers = _checked_rows(raw, columns, kind, question_field, answer_field, source, lines, skip_bad_rows)
    if isinstance(raw, list):
        data = {name: [raw[i].get(name) for i in keep] for name in columns}
    else:
        data = raw.select(keep).to_dict()
    if kind == "gsm8k" and "solution" not in data:
        data["solution"] = data["answer"]
    data["answer"] = answers
    data["prompt"] = [
        format_prompt(q, template, tokenizer, system_prompt=system_prompt, instruction=instruction)
        for q in data[question_field]
    ]
    try:
        return Dataset.from_dict(data)
    except (TypeError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError: a column mixes types
        raise ValueError(f"{source}: a column mixes value types across rows ({err})") from None


def _dataset_cached(name: str) -> bool:
    """Whether ``datasets`` can load hub dataset ``name`` offline: its files in the Hub cache, or a prepared copy in
    the ``datasets`` cache."""
    from datasets.config import HF_DATASETS_CACHE
    from huggingface_hub.constants import HF_HUB_CACHE

    hub = Path(HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
    prepared = Path(HF_DATASETS_CACHE) / name.replace("/", "___")
    return (hub.is_dir() and any(hub.iterdir())) or prepared.is_dir()


def dataset_source_problem(name: str | None, flag: str = "--dataset_name") -> str | None:
    """Why a dataset is neither a local file nor a Hub dataset this machine can load; None when it is (or is unset).

    A name ending in .jsonl/.json/.parquet, or a path, must be an existing file. A Hub id must be in the local cache,
    or -- unless ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set -- answer one Hub request (10 s timeout, no
    retries: ``datasets`` itself would retry for most of a minute, then print a long traceback).
    """
    if name is None or Path(name).exists():
        return None  # unset (generated data), or an existing path: the loader reads it and names what is wrong
    name = str(name)
    if name.lower().endswith(tuple(LOCAL_FORMATS)) or machine.looks_local(name):
        return f"{flag} {name}: no such file"
    return machine.hub_source_problem(
        name,
        "dataset",
        f"{flag} {name}: not a local file",
        f"; download it where the Hub is reachable, or pass a local {'/'.join(LOCAL_FORMATS)} file with the same "
        "columns",
        cached=lambda: _dataset_cached(name),
        offline_vars=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
    )
