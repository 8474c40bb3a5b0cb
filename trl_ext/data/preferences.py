"""Preference-pair data for reward models and DPO: JSON-lines loader and row validation.

File format, one JSON object per line (blank lines are ignored)::

    {"prompt": "What is the capital of France?", "chosen": "The capital of France is Paris.",
     "rejected": "The capital of France is Lyon.", "margin": 1.0}

* ``prompt`` (required): a non-empty string, or a conversation ``[{"role": ..., "content": ...}, ...]``.
* ``chosen``, ``rejected`` (required): the preferred and the dispreferred response, non-empty and different;
  strings, or (with a conversational prompt) assistant turns, which may call tools and hold tool results, as in TRL's
  conversational preference data.
* ``margin`` (optional number): how much the chosen reward should exceed the rejected one (Bradley-Terry with
  margin); rows without one get 0.0 when any row of the file has one.

These are TRL's preference columns (upstream's and trl_ext's reward and DPO trainers take them unchanged); all rows of
a file share one shape. A bad row raises ``ValueError`` naming the file, the row and the field (``skip_invalid=True``:
dropped, with one warning that counts them).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

from datasets import Dataset, IterableDataset

from trl_ext.data.instructions import collect_valid_rows
from trl_ext.errors import user_input

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
"""Required fields of a preference row."""


def _is_messages(value: Any) -> bool:
    """A conversation as TRL reads one (``is_conversational``): a non-empty list of dicts with a string ``role``."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def _part_says_something(part: Any) -> bool:
    """A content block says something when it is non-blank text or not text at all (an image, audio, ...)."""
    if isinstance(part, str):
        return bool(part.strip())
    if not isinstance(part, dict):
        return part is not None
    if part.get("type", "text") == "text":
        return isinstance(part.get("text"), str) and bool(part["text"].strip())
    return True


def _says_something(message: dict[str, Any]) -> bool:
    """Whether a message's ``content`` says something or it calls a tool (``tool_calls``, ``function_call``)."""
    content = message.get("content")
    if isinstance(content, str):
        text = bool(content.strip())
    elif isinstance(content, list):
        text = any(_part_says_something(part) for part in content)
    else:
        text = content is not None and bool(content)
    return text or bool(message.get("tool_calls")) or bool(message.get("function_call"))


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not any(_says_something(m) for m in value)


def _type_error(name: str, value: Any) -> str:
    expected = "expected a string or a conversation: a non-empty list of messages, dicts with a string 'role'"
    if isinstance(value, list) and value:
        index, bad = next(
            (i, m) for i, m in enumerate(value) if not (isinstance(m, dict) and isinstance(m.get("role"), str))
        )
        return f"field {name!r} message {index} is {bad!r}; {expected}"
    return f"field {name!r} is {'an empty list' if value == [] else type(value).__name__}; {expected}"


def validate_preference_row(
    row: dict[str, Any], require_prompt: bool = True
) -> tuple[dict[str, Any] | None, str | None]:
    """Check one preference row; return ``(row, None)`` or ``(None, error message naming the field)``.

    Accepts every row shape TRL's preference trainers train on. Checks: required fields present (``prompt`` only
    when ``require_prompt``), each a non-empty string or conversation, every message with a ``role``, prompt and
    responses of one shape, chosen different from rejected, and ``margin`` (if not None) a finite number.
    """
    required = PREFERENCE_FIELDS if require_prompt else PREFERENCE_FIELDS[1:]
    for name in required:
        if name not in row or row[name] is None:
            return None, f"missing required field {name!r}"
    present = [name for name in PREFERENCE_FIELDS if name in row and row[name] is not None]
    for name in present:
        value = row[name]
        if not isinstance(value, str) and not _is_messages(value):
            return None, _type_error(name, value)
        if _is_empty(value):
            return None, f"field {name!r} is empty; expected a non-empty {'response' if name != 'prompt' else 'prompt'}"
    shapes = {name: "a conversation" if _is_messages(row[name]) else "a string" for name in present}
    if len(set(shapes.values())) > 1:
        first, other = present[0], next(n for n in present if shapes[n] != shapes[present[0]])
        return None, (
            f"field {first!r} is {shapes[first]} but {other!r} is {shapes[other]}; expected all strings or all "
            "conversations (TRL joins the prompt and each response)"
        )
    if row["chosen"] == row["rejected"]:
        return None, "fields 'chosen' and 'rejected' are identical; a preference pair needs two different responses"
    margin = row.get("margin")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)
    ):
        return None, f"field 'margin' is {margin!r}; expected a finite number"
    return row, None


def load_preference_rows(path: str | os.PathLike, skip_invalid: bool = False) -> list[dict[str, Any]]:
    """Read and validate a preference JSON-lines file (format in the module docstring).

    Returns:
        the valid rows; when any row has a ``margin``, every row gets one (0.0 where absent), as a float.

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON, a missing/empty/mistyped field, chosen identical to rejected, a non-numeric margin,
        rows that mix plain-text and conversational prompts (each naming file, row and field), or no valid row.
    """
    rows = collect_valid_rows(path, validate_preference_row, skip_invalid, "preference")
    conversational = [_is_messages(row["prompt"]) for row in rows]
    if any(conversational) and not all(conversational):
        odd = conversational.index(not conversational[0])
        shape = {True: "conversational", False: "plain-text"}
        raise ValueError(
            f"{path}: valid row {odd} has a {shape[conversational[odd]]} prompt but valid row 0 has a "
            f"{shape[conversational[0]]} one; expected one shape for all rows"
        )
    if any(row.get("margin") is not None for row in rows):
        rows = [{**row, "margin": float(row.get("margin") or 0.0)} for row in rows]
    else:
        rows = [{k: v for k, v in row.items() if k != "margin"} for row in rows]
    return rows


def to_conversational(row: dict[str, Any]) -> dict[str, Any]:
    """Wrap a plain-text row as a conversation: the prompt as a user turn, each response as an assistant turn."""
    if _is_messages(row["prompt"]):
        return row
    return {
        **row,
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }


def load_preference_dataset(
    path: str | os.PathLike, conversational: bool = False, skip_invalid: bool = False
) -> Dataset:
    """Load a preference file as a ``datasets.Dataset`` with ``prompt``, ``chosen``, ``rejected`` (and ``margin``).

    Args:
        path: the ``.jsonl`` file.
        conversational: wrap plain-text rows as conversations (:func:`to_conversational`) so TRL renders them with
            the chat template (default False: keep the file's shape).
        skip_invalid: drop bad rows with one counting warning instead of raising.

    Raises:
        as :func:`load_preference_rows`.
    """
    rows = load_preference_rows(path, skip_invalid)
    if conversational:
        rows = [to_conversational(row) for row in rows]
    keys = [k for k in ("prompt", "chosen", "rejected", "margin") if k in rows[0]]
    return Dataset.from_dict({k: [row[k] for row in rows] for k in keys})


def check_preference_dataset(dataset: Any, skip_invalid: bool = False, name: str = "train") -> Any:
    """Validate the rows of an untokenized preference dataset before a trainer tokenizes it.

    ``trl_ext.RewardTrainer`` and ``trl_ext.DPOTrainer`` apply it; tokenized and streaming datasets pass unchanged.

    Args:
        dataset: a ``datasets.Dataset`` (anything else is returned as is).
        skip_invalid: drop bad rows with one warning that counts them, instead of raising on the first.
        name: the dataset's name in messages (e.g. ``"train"``, ``"eval"``).

    Returns:
        the dataset, without the bad rows when ``skip_invalid``.

    Raises:
        ValueError: a bad row (missing or empty field, chosen identical to rejected, bad margin), naming the
        dataset, the row index and the field; or no valid row left.
    """
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
        return dataset
    columns = set(dataset.column_names)
    if not {"chosen", "rejected"} <= columns or "chosen_ids" in columns:
        return dataset
    keep_columns = [c for c in ("prompt", "chosen", "rejected", "margin") if c in columns]
    require_prompt = "prompt" in columns
    bad: list[int] = []
    for index, row in enumerate(dataset.select_columns(keep_columns)):
        _, error = validate_preference_row(row, require_prompt=require_prompt)
        if error is None:
            continue
        if not skip_invalid:
            raise ValueError(f"{name} dataset row {index}: {error} (set skip_invalid_pairs=True to drop such rows)")
        bad.append(index)
    if not bad:
        return dataset
    if len(bad) == len(dataset):
        raise ValueError(f"{name} dataset: all {len(bad)} rows are invalid")
    warnings.warn(
        f"{name} dataset: skipped {len(bad)} invalid preference row(s) "
        f"(rows {bad[:10]}{'...' if len(bad) > 10 else ''})",
        stacklevel=2,
    )
    bad_set = set(bad)
    return dataset.select([i for i in range(len(dataset)) if i not in bad_set])


# ------------------------------------------------------------------------------------------- what the recipes read
def load_training_pairs(
    path: str | os.PathLike, conversational: bool = False, skip_invalid: bool = False, margin: bool = True
) -> Dataset:
    """A preference file as recipes/reward_model.py and recipes/dpo.py train and evaluate on it.

    :func:`load_preference_dataset`, then for plain text (``conversational`` False) a newline at the end of every
    prompt: TRL appends each response to the prompt as it is, so ``"Capital of France?"`` + ``"Paris."`` would be one
    run-on line. :func:`unique_prompts` gives the same prompts to recipes/rlhf.py.

    Args:
        path: the ``.jsonl`` file (format in the module docstring).
        conversational: wrap plain-text rows as chat turns (:func:`to_conversational`); no newline is added then.
        skip_invalid: drop bad rows with one counting warning instead of raising.
        margin: keep the ``margin`` column, when the file has one (False: DPO, which has no margin, and
            ``--use_margin false`` of the reward model).

    Returns:
        a ``datasets.Dataset`` with ``prompt``, ``chosen``, ``rejected`` (and ``margin``), one row per valid row.

    Raises:
        as :func:`load_preference_rows`.
    """
    dataset = load_preference_dataset(path, conversational, skip_invalid)
    if not conversational:
        dataset = dataset.map(lambda row: {"prompt": row["prompt"] + "\n"})
    if not margin and "margin" in dataset.column_names:
        dataset = dataset.remove_columns("margin")
    return dataset


def load_pair_files(
    train_file: str | os.PathLike, test_file: str | os.PathLike, **options: Any
) -> tuple[Dataset, Dataset]:
    """A recipe's training and held-out pairs (:func:`load_training_pairs` of each file, with ``options``).

    Raises:
        RecipeError: what is wrong with a file, after the flag that names it (``--train_file: ...``).
    """
    with user_input("--train_file: "):
        train = load_training_pairs(train_file, **options)
    with user_input("--test_file: "):
        test = load_training_pairs(test_file, **options)
    return train, test


def unique_prompts(path: str | os.PathLike) -> list[str]:
    """The distinct prompts of a plain-text preference file, in file order, each followed by a newline: the prompts
    as :func:`load_training_pairs` shows them to a reward model (recipes/rlhf.py's RL and held-out prompts).

    Raises:
        as :func:`load_preference_rows`.
    """
    return list(dict.fromkeys(row["prompt"] + "\n" for row in load_preference_rows(path)))
