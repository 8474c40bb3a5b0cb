"""Adapters between the course's reward shape, ``reward_fn(response, ground_truth) -> {"reward", "format_reward",
"answer_reward"}`` (CS336 assignment 5), and TRL 1.16's, ``reward_func(prompts, completions, **columns) ->
list[float | None]`` (every other dataset column as a keyword, one entry per completion, plus TRL's own keywords).

Rewards are written once, course style, and turned into TRL's shape by :func:`as_trl_reward` (or, scoring the whole
row, :func:`as_trl_row_reward`); :func:`as_course_reward_fn` goes the other way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trl_ext.logs import say_once

REWARD_KEYS = ("reward", "format_reward", "answer_reward")

CourseRewardFn = Callable[[str, str], dict[str, float]]
TrlRewardFunc = Callable[..., list[float | None]]


def completion_text(completion: str | Sequence[dict[str, Any]], row: int | None = None) -> str:
    """Return the text of one TRL completion.

    Args:
        completion: a string or a list of chat messages, whose LAST message's content is used (a content of
            ``[{"type": "text", "text": ...}, ...]`` parts has its text parts joined).
        row: the row index, only used in error messages.

    Returns:
        The completion text.

    Raises:
        ValueError: the completion is neither a string nor a non-empty list of messages with a ``"content"`` key.
    """
    where = f"completion {row}" if row is not None else "completion"
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and len(completion) > 0 and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        raise ValueError(f"{where}: last message has no string 'content' (got {type(content).__name__})")
    raise ValueError(
        f"{where}: expected a string or a non-empty list of chat messages, got {type(completion).__name__}"
    )


def as_trl_reward(
    reward_fn: CourseRewardFn,
    *,
    key: str = "reward",
    answer_column: str = "answer",
    name: str | None = None,
) -> TrlRewardFunc:
    """Turn a course-style ``reward_fn(response, ground_truth) -> dict`` into a TRL reward function.

    The result returns ``reward_fn(completion, columns[answer_column][i])[key]`` per completion (never ``None``) and
    logs as :func:`as_trl_row_reward` does.

    Args:
        reward_fn: course-style reward function.
        key: which entry of the dict to return: ``"reward"`` (default), ``"format_reward"`` or ``"answer_reward"``
            (a format-only reward with weight 0 in ``GRPOConfig.reward_weights`` logs without training on it).
        answer_column: dataset column holding the ground-truth string (default ``"answer"``).
        name: ``__name__`` of the returned function (TRL logs ``rewards/<__name__>/mean``); defaults to
            ``reward_fn.__name__`` with a trailing ``"_fn"`` removed.

    Returns:
        The TRL reward function.

    Raises:
        ValueError: at construction, ``key`` is not one of ``REWARD_KEYS``. At call time, ``answer_column`` is not
            among the columns, its length differs from ``completions``, or a row's ground truth is ``None`` or
            empty (the message names the row index and the column).
    """
    if name is None:
        name = reward_fn.__name__.removesuffix("_fn")

    def score(response: str, row: Mapping[str, Any]) -> dict[str, float]:
        truth = row[answer_column]
        if truth is None or (isinstance(truth, str) and not truth.strip()):
            raise ValueError(f"field {answer_column!r} is missing or empty")
        return reward_fn(response, str(truth))

    trl_reward = as_trl_row_reward(
        score, key=key, name=name, required_column=answer_column, hint="pass answer_column= to as_trl_reward"
    )
    trl_reward.__doc__ = (
        f"TRL reward function: ``{name}(prompts, completions, **columns) -> list[float]``; "
        f"returns ``{reward_fn.__name__}(completion, columns[{answer_column!r}][i])[{key!r}]`` per completion.\n\n"
        f"{reward_fn.__doc__ or ''}"
    )
    return trl_reward


TRL_REWARD_EXTRAS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
"""Keyword arguments TRL 1.16 passes to reward functions besides ``prompts``, ``completions`` and the dataset's
columns (``environments`` only with an ``environment_factory``)."""

TRUNCATION_KEYWORD = "completion_truncated"
"""The keyword ``trl_ext.GRPOTrainer`` adds to every reward call: per completion, whether the length limit cut it."""


def without_credit(scores: Mapping[str, float]) -> dict[str, float]:
    """The scores of a response the length limit cut, for a task that gives it no credit: ``reward`` and
    ``answer_reward`` at most 0, ``format_reward`` as scored (else the last number of a cut-off sentence, often the
    question's own, would be credited and a run would learn to echo)."""
    out = {k: float(v) for k, v in scores.items()}
    for key in ("reward", "answer_reward"):
        if key in out:
            out[key] = min(out[key], 0.0)
    return out


TRL_RESERVED_COLUMNS = (
    "completion",
    "completion_ids",
    "prompts",
    "completions",
    "trainer_state",
    "log_extra",
    "log_metric",
    "environments",
)
"""Dataset column names that cannot reach a reward function of TRL 1.16's ``GRPOTrainer`` as they are (removed,
clashing with its own keywords, or overwritten in ``_calculate_rewards``); carried under :data:`CARRIED_PREFIX`
(:func:`carry_reserved_columns`, :func:`restore_carried_columns`)."""

CARRIED_PREFIX = "trl_ext."
"""Prefix of the name under which a :data:`TRL_RESERVED_COLUMNS` column travels through TRL (``trl_ext.completion``)."""


def dataset_columns(dataset: Any) -> list[str]:
    """The column names of a ``datasets.Dataset`` or ``IterableDataset`` (a stream without declared features: its
    first row's keys)."""
    names = getattr(dataset, "column_names", None)
    if names is None:  # a streaming dataset without declared features: its first row says
        names = list(next(iter(dataset), {}))
    return list(names)


def carry_reserved_columns(dataset: Any, what: str = "the dataset") -> Any:
    """``dataset`` with each :data:`TRL_RESERVED_COLUMNS` column renamed to :data:`CARRIED_PREFIX` + its name, so
    that TRL hands it to reward functions unchanged; the same object when it has none.

    Args:
        dataset: a ``datasets.Dataset`` or ``IterableDataset``.
        what: the dataset, for messages (``"task 'mine': training rows"``).

    Raises:
        ValueError: a column to carry whose carried name is already a column (both named).
    """
    names = dataset_columns(dataset)
    renames = {c: CARRIED_PREFIX + c for c in names if c in TRL_RESERVED_COLUMNS}
    clash = [f"{c!r} and {n!r}" for c, n in renames.items() if n in names]
    if clash:
        raise ValueError(
            f"{what}: columns {', '.join(clash)}: the first is a name TRL keeps from reward functions, carried under "
            "the second, which is taken; rename one of them"
        )
    return dataset.rename_columns(renames) if renames else dataset


def restore_carried_columns(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """``row`` with its carried columns (:func:`carry_reserved_columns`) under their own names again; the same mapping
    when it has none."""
    if not any(k.startswith(CARRIED_PREFIX) for k in row):
        return row
    return {k.removeprefix(CARRIED_PREFIX) if k.startswith(CARRIED_PREFIX) else k: v for k, v in row.items()}


def as_trl_row_reward(
    score: Callable[[str, Mapping[str, Any]], Mapping[str, float]],
    *,
    key: str = "reward",
    name: str = "reward",
    required_column: str | None = None,
    hint: str = "add it to the dataset",
    expected_columns: Sequence[str] = (),
    log_scores: bool = False,
    answer: Callable[[Mapping[str, Any]], Any] | None = None,
    credit_truncated: bool = True,
    stop_strings: Sequence[str] = (),
) -> TrlRewardFunc:
    """Turn a row scorer ``score(response, row) -> {"reward", "format_reward", "answer_reward"}`` into a TRL reward
    function that scores each completion against its whole dataset row (``trl_ext.tasks.Task.reward_funcs``).

    The row of completion ``i`` is rebuilt as ``{"prompt": prompts[i], column: columns[column][i], ...}`` (TRL's own
    keywords, :data:`TRL_REWARD_EXTRAS`, left out). When TRL passes ``log_metric``, the batch means of
    ``format_reward`` and ``answer_reward`` are logged as ``rewards/<name>/format_reward`` and ``.../answer_reward``
    (a NaN format reward, not measured, is not).

    Args:
        score: the row scorer.
        key: which score to return: ``"reward"`` (default), ``"format_reward"`` or ``"answer_reward"``.
        name: ``__name__`` of the returned function (TRL logs ``rewards/<name>/mean``).
        required_column: a column that must be among the dataset's (checked once per call, named when absent).
        hint: what the missing-column message suggests.
        expected_columns: the rows' columns: when TRL passes none of them the call fails naming the likely cause,
            ``remove_unused_columns=True``.
        log_scores: when TRL passes ``log_extra``, add each completion's scores (NaN: None) and, with ``answer``,
            its row's answer to TRL's completions table; give it to one function of a trainer only.
        answer: ``answer(row)``, the row's reference answer, for that table.
        credit_truncated: False: a completion the length limit cut earns no credit (:func:`without_credit`); which
            were cut comes from :data:`TRUNCATION_KEYWORD` (``trl_ext.GRPOTrainer``), else from upstream TRL's
            ``clipped_ratio`` rule (last token neither EOS nor pad), else none is known (one warning). Default True.
        stop_strings: the stop strings the task's completions should end with (``trl_ext.GRPOTrainer`` uses them
            when its ``stop_strings`` is unset). Default none.

    Returns:
        The TRL reward function ``(prompts, completions, **columns) -> list[float]``, with the attributes
        ``credit_truncated`` and ``stop_strings`` (tuple).

    Raises:
        ValueError: at construction, ``key`` is not one of ``REWARD_KEYS``. At call time, ``required_column`` is
            absent, or every one of ``expected_columns``, a column's length differs from ``completions``, or
            ``score`` raises (the row index and prompt named, the original as ``__cause__``).
    """
    if key not in REWARD_KEYS:
        raise ValueError(f"key must be one of {REWARD_KEYS}, got {key!r}")

    def trl_reward(prompts: list | None = None, completions: list | None = None, **columns: Any) -> list[float]:
        if completions is None:
            raise ValueError(f"{name}: missing argument 'completions'")
        data = _row_columns(name, columns, len(completions), required_column, hint, expected_columns)
        cut = None if credit_truncated else _truncated(name, columns, len(completions))
        results, rows = [], []
        for i, completion in enumerate(completions):
            row = {"prompt": prompts[i] if prompts is not None else None, **{k: v[i] for k, v in data.items()}}
            rows.append(row)
            scores = _scored(name, score, completion_text(completion, row=i), row, i)
            results.append(without_credit(scores) if cut is not None and cut[i] else scores)
        _log_scores(name, columns, results, rows if log_scores else None, answer)
        return [float(r[key]) for r in results]

    trl_reward.__name__ = trl_reward.__qualname__ = name
    cut_note = "" if credit_truncated else " (0 at most for a completion the length limit cut)"
    trl_reward.__doc__ = (
        f"TRL reward function: ``{name}(prompts, completions, **columns) -> list[float]``; returns the {key!r} "
        f"score of each completion against its row{cut_note}."
    )
    trl_reward.credit_truncated = credit_truncated
    trl_reward.stop_strings = tuple(stop_strings)
    return trl_reward


def _row_columns(
    name: str,
    columns: Mapping[str, Any],
    n: int,
    required_column: str | None,
    hint: str,
    expected_columns: Sequence[str],
) -> dict[str, Any]:
    """The dataset columns among TRL's keywords (its own and :data:`TRUNCATION_KEYWORD` left out), checked as
    :func:`as_trl_row_reward` says (``required_column``, ``expected_columns``, one entry per completion)."""
    data = {k: v for k, v in columns.items() if k not in TRL_REWARD_EXTRAS and k != TRUNCATION_KEYWORD}
    if required_column is not None and required_column not in data:
        raise ValueError(
            f"{name}: no ground-truth column {required_column!r} among the dataset columns {sorted(data)}; {hint}"
        )
    if expected_columns and not any(c in data for c in expected_columns):
        raise ValueError(
            f"{name}: TRL passed none of the rows' columns {list(expected_columns)}: a trainer with "
            "remove_unused_columns=True drops every column but prompt/image/images (pass --remove_unused_columns "
            "false, GRPO's default)"
        )
    for column, values in data.items():
        if len(values) != n:
            raise ValueError(f"{name}: column {column!r} has {len(values)} entries but there are {n} completions")
    return data


def _scored(name: str, score: Callable, text: str, row: Mapping[str, Any], i: int) -> Mapping[str, float]:
    """``score(text, row)``; whatever it raises becomes a ValueError naming batch row ``i`` and its prompt."""
    try:
        return score(text, row)
    except Exception as err:  # noqa: BLE001 -- whatever a scorer raises is named with its row
        prompt = _short(row["prompt"])
        detail = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"{name}: row {i} (0-based): {detail} (the batch's row with prompt {prompt})") from err


def _log_scores(
    name: str, columns: Mapping[str, Any], results: list, rows: list | None, answer: Callable | None
) -> None:
    """Log to TRL's ``log_extra`` (with ``rows``) and ``log_metric``, as :func:`as_trl_row_reward` says."""
    log_extra = columns.get("log_extra")
    if rows is not None and log_extra is not None and results:  # TRL's completions table: each completion's scores
        for k in REWARD_KEYS:
            log_extra(k, [None if math.isnan(float(r[k])) else float(r[k]) for r in results])
        if answer is not None:
            log_extra("answer", [answer(row) for row in rows])
        flags = columns.get(TRUNCATION_KEYWORD)
        if flags is not None and len(flags) == len(results):  # which were cut, so a reader sees why 0 was given
            log_extra("truncated", [bool(flag) for flag in flags])
    log_metric = columns.get("log_metric")
    if log_metric is not None and results:
        for k in ("format_reward", "answer_reward"):
            mean = sum(float(r[k]) for r in results) / len(results)
            if not math.isnan(mean):
                log_metric(f"rewards/{name}/{k}", mean)


def _truncated(name: str, columns: Mapping[str, Any], n: int) -> list[bool] | None:
    """Per completion, whether the length limit cut it (see ``credit_truncated`` of :func:`as_trl_row_reward`), or
    None when the caller does not say (warned once per reward name)."""
    flags = columns.get(TRUNCATION_KEYWORD)
    if flags is not None:
        if len(flags) != n:
            raise ValueError(f"{name}: {TRUNCATION_KEYWORD} has {len(flags)} entries but there are {n} completions")
        return [bool(f) for f in flags]
    trainer = getattr(columns.get("log_metric"), "__self__", None)  # TRL passes its trainer's bound _log_metric
    ids = columns.get("completion_ids")
    eos = getattr(trainer, "eos_token_ids", None)
    tokenizer = getattr(trainer, "_tokenizer", None)
    if eos is not None and tokenizer is not None and ids is not None and len(ids) == n:
        ends = {*eos, tokenizer.pad_token_id}
        return [not c or c[-1] not in ends for c in ids]  # trl.GRPOTrainer._generate's is_truncated
    say_once(
        f"{name}: this task gives no credit to a completion the length limit cut, but its caller did not say "
        f"which were cut ({TRUNCATION_KEYWORD}=...; trl_ext.GRPOTrainer and trl.GRPOTrainer do): every "
        "completion is credited",
        key=("unknown truncation", name),
    )
    return None


def _short(prompt: Any, limit: int = 60) -> str:
    """A prompt for messages: its last message's text (a conversation) or the text, shortened to ``limit``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content")
    text = repr(prompt)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def as_course_reward_fn(
    reward_func: TrlRewardFunc,
    *,
    format_reward_func: TrlRewardFunc | None = None,
    answer_column: str = "answer",
    conversational: bool = False,
    name: str | None = None,
) -> CourseRewardFn:
    """Turn a TRL reward function into a course-style ``reward_fn(response, ground_truth) -> dict``.

    The TRL function is called on a batch of one, ``reward_func(prompts=[""], completions=[response],
    completion_ids=None, **{answer_column: [ground_truth]})`` (a one-message conversation when ``conversational``);
    its number is both ``"reward"`` and ``"answer_reward"``; ``"format_reward"`` comes from ``format_reward_func``,
    else ``nan`` (never measured).

    Args:
        reward_func: TRL-style reward function.
        format_reward_func: optional TRL-style function giving the format reward.
        answer_column: keyword under which the ground truth is passed (e.g. ``"solution"`` for
            ``trl.rewards.accuracy_reward``).
        conversational: pass the response as a one-message list instead of a string.
        name: ``__name__`` of the returned function; defaults to ``reward_func.__name__ + "_fn"``.

    Returns:
        The course-style reward function.

    Raises:
        ValueError: at call time, the TRL function returns ``None`` (it skipped the row) or not exactly one value.
    """
    if name is None:
        name = getattr(reward_func, "__name__", "reward") + "_fn"

    def call(func: TrlRewardFunc, response: str, ground_truth: str) -> float:
        completion: str | list[dict[str, str]] = response
        prompt: str | list = ""
        if conversational:
            completion, prompt = [{"role": "assistant", "content": response}], []
        out = func(prompts=[prompt], completions=[completion], completion_ids=None, **{answer_column: [ground_truth]})
        if len(out) != 1 or out[0] is None:
            raise ValueError(
                f"{name}: {getattr(func, '__name__', func)} returned {out!r} for one completion; expected one float"
            )
        return float(out[0])

    def reward_fn(response: str, ground_truth: str) -> dict[str, float]:
        reward = call(reward_func, response, ground_truth)
        fmt = call(format_reward_func, response, ground_truth) if format_reward_func is not None else math.nan
        return {"reward": reward, "format_reward": fmt, "answer_reward": reward}

    reward_fn.__name__ = name
    reward_fn.__qualname__ = name
    return reward_fn
