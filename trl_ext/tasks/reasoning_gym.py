"""reasoning-gym generators as tasks, the parts that need no Task: importing the library, checking a generator's
name, drawing held-out entries with distinct questions, and reading an answer from a response in the format the
prompt asks for (``answer_format``). ``trl_ext.tasks.reasoning_gym_task`` builds the task from these.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from trl_ext import rewards
from trl_ext.data.prompts import ANSWER_WITH_NUMBER, format_prompt, template_stop_strings
from trl_ext.errors import RecipeError
from trl_ext.tasks.base import Task
from trl_ext.tasks.math import resolve_template, template_label
from trl_ext.tasks.options import (
    EVERY_TASK,
    PROMPT,
    register_task,
)

REASONING_GYM = "reasoning_gym"
REASONING_GYM_PREFIX = f"{REASONING_GYM}:"
REASONING_GYM_EXTRA = "reasoning-gym is not installed: `uv sync --extra tasks` (or `pip install reasoning-gym`)"
ANSWER_FORMATS = ("auto", "answer_tag", "answer_tag_or_whole", "last_number", "last_line")
"""How a reasoning-gym task reads the answer from a response (``answer_format`` in ``--task_config``; see
:func:`reasoning_gym_task`)."""


def generator_problem(rg: Any, dataset_name: str) -> str | None:
    """The problem of a reasoning-gym generator name that does not exist (with the closest names), or None."""
    if dataset_name in rg.factory.DATASETS:
        return None
    close = difflib.get_close_matches(dataset_name, sorted(rg.factory.DATASETS), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else f"; {len(rg.factory.DATASETS)} exist, e.g. chain_sum"
    return f"--task {REASONING_GYM_PREFIX}{dataset_name}: no such reasoning-gym dataset{hint}"


def import_reasoning_gym(flag: str = "--task") -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise RecipeError(f"{flag}: {REASONING_GYM_EXTRA}") from None
    return reasoning_gym


def _is_number(text: Any) -> bool:
    return isinstance(text, (int, float)) or (isinstance(text, str) and re.fullmatch(r"-?\d+(\.\d+)?", text.strip()))


_ANSWER_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE)


def extract_last_line(response: str) -> str | None:
    """The last non-empty line of ``response``, without an "Answer:"/"The answer is" prefix, surrounding quotes,
    backticks, markdown emphasis or a final period; None when the response is blank."""
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return None
    line = _ANSWER_PREFIX.sub("", lines[-1]).strip().strip("*`").strip()
    line = line[:-1] if line.endswith(".") and not re.search(r"\d\.$", line[-3:]) else line
    return line.strip().strip("\"'").strip() or None


@contextlib.contextmanager
def seeded_global_generators(seed: int):
    """Python's and NumPy's global generators seeded with ``seed`` inside the block and restored after it: a
    reasoning-gym generator that draws from them (``list_functions`` calls ``random.randint``) then makes the same
    entries whatever ran before, and the user's generators are left as they were."""
    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


MAX_DRAWS_PER_HELD_OUT_ROW = 16
"""A reasoning-gym task draws at most this many entries per held-out row asked for while it looks for distinct
questions (:func:`distinct_entries`)."""


def distinct_entries(
    rg: Any, dataset_name: str, num_eval: int, seed: int, config: Mapping[str, Any]
) -> tuple[Any, list[Mapping[str, Any]], int]:
    """``num_eval`` entries of a reasoning-gym generator with distinct questions, when it has that many:
    ``(dataset, entries, entries drawn)``.

    ``num_eval`` entries are drawn with ``seed``; while fewer than ``num_eval`` of their questions differ, twice as
    many are drawn (same seed), until enough differ, a doubling brings no new question (the generator's questions
    are exhausted, e.g. lcm with max_value 12) or :data:`MAX_DRAWS_PER_HELD_OUT_ROW` x ``num_eval`` were drawn. The
    first entry of each question is kept, in the order drawn; a generator whose first ``num_eval`` entries all
    differ gives exactly those.
    """
    size, known = num_eval, -1
    while True:
        with seeded_global_generators(seed):
            data = rg.create_dataset(dataset_name, size=size, seed=seed, **config)
            entries = [data[i] for i in range(len(data))]
        distinct: dict[str, Mapping[str, Any]] = {}
        for entry in entries:
            distinct.setdefault(json.dumps(entry["question"], default=str), entry)
        found = len(distinct)
        if found >= num_eval or found == known or size >= MAX_DRAWS_PER_HELD_OUT_ROW * num_eval:
            return data, list(distinct.values())[:num_eval], size
        size, known = size * 2, found


RG_INSTRUCTIONS = {
    "last_number": ANSWER_WITH_NUMBER,
    "last_line": "Answer with just the answer, on one line.",
    "answer_tag_or_whole": "If you write anything besides the answer, put the answer inside <answer> </answer> tags.",
    "answer_tag": "Put the final answer inside <answer> </answer> tags.",
}
"""The answer-format instruction appended to a reasoning-gym question, by ``answer_format``. Each says how the answer
is read and none contradicts a question that asks for "only your answer" or for a multi-line layout."""


def answer_extractor(answer_format: str) -> Callable[[str], str | None]:
    """The function that reads an answer from a response under ``answer_format`` (:data:`ANSWER_FORMATS` but
    ``auto``); None from it means no answer was found."""
    if answer_format in ("answer_tag", "answer_tag_or_whole"):
        from reasoning_gym.utils import extract_answer

        if answer_format == "answer_tag":
            return lambda response: extract_answer(response)
        return lambda response: (
            (extract_answer(response) if re.search(r"<answer>.*</answer>", response, re.DOTALL) else response.strip())
            or None
        )
    if answer_format == "last_number":
        return rewards.extract_last_number
    return extract_last_line


def as_instructed(answer_format: str, answer: str) -> str:
    """The response that gives ``answer`` the way the instruction of ``answer_format`` asks (:data:`RG_INSTRUCTIONS`):
    the answer itself, or inside ``<answer> </answer>`` tags."""
    return f"<answer>{answer}</answer>" if answer_format.startswith("answer_tag") else answer


def choose_answer_format(
    entries: list[Mapping[str, Any]], score_answer: Callable[..., float], template: str = "chat"
) -> str:
    """``answer_format="auto"`` for a reasoning-gym generator: ``answer_tag`` under the ``r1_zero`` template and
    template files; else the first of ``last_number`` (when every gold answer is a number), ``last_line`` and
    ``answer_tag_or_whole`` under which every entry's gold answer, given alone and given as the instruction asks
    (:func:`as_instructed`), is read back to what ``score_answer(answer=gold, entry=entry)`` gives it (entries
    without a gold answer -- ``answer`` None: the generator verifies solutions -- are not checked).
    ``answer_tag_or_whole`` when none does (it reads a response that is exactly the gold answer as that answer).

    Args:
        entries: the generator's entries this run uses (held-out and training).
        score_answer: the generator's ``score_answer(answer=..., entry=...)``.
        template: the prompt template (a name, or a template file's text).
    """
    if template not in ("chat", "question_only"):
        return "answer_tag"
    golds = [e for e in entries if e.get("answer") is not None]

    def full_credit(answer_format: str, entry: Mapping[str, Any]) -> bool:
        extract, gold = answer_extractor(answer_format), str(entry["answer"])
        try:
            target = float(score_answer(answer=gold, entry=entry))
            for response in (gold, as_instructed(answer_format, gold)):
                read = extract(response)
                if read is None or float(score_answer(answer=read, entry=entry)) < target - 1e-9:
                    return False
        except Exception:  # noqa: BLE001 -- a generator whose scorer fails on a reading has not read it back
            return False
        return True

    numeric = bool(golds) and all(_is_number(e["answer"]) for e in golds)
    for answer_format in ("last_number", "last_line") if numeric else ("last_line",):
        if all(full_credit(answer_format, e) for e in golds):
            return answer_format
    return "answer_tag_or_whole"


# --------------------------------------------------------------------------------------------------- reasoning-gym
def reasoning_gym_task(
    dataset_name: str,
    options: Any,
    max_new_tokens: int,
    train: bool = True,
    template: str | None = None,
    **config: Any,
) -> Task:
    """A ``reasoning-gym`` generator as a task, scored by the generator's own ``score_answer(answer=...,
    entry=...)`` on the full entry (question, answer and metadata).

    Rows: ``--num_train_problems`` training entries drawn with ``seed`` (default 0) and ``--num_eval`` held-out
    entries with distinct questions drawn with ``seed + 1`` (more are drawn while questions repeat,
    :func:`distinct_entries`; a generator with fewer distinct questions gives fewer held-out rows, and the task's
    ``held_out_note`` says so); training entries whose question is also a held-out question are dropped, so the
    two are disjoint (the source says how many). Each row holds ``prompt`` (the question, plus the answer-format
    instruction, in the ``--template``: a chat conversation by default), ``answer``, ``question``, ``entry_id`` and
    ``entry`` (the whole entry as JSON, for records and for your inspection); the scorer finds the generator's own
    entry by ``entry_id`` (so metadata keeps its types), else decodes ``entry``.

    ``options`` are the recipe's task options (``template`` replaces ``--template``). ``config``
    (``--task_config``) goes to ``reasoning_gym.create_dataset`` except trl_ext's keys:

    * ``seed`` (default 0): the training rows' seed; held-out rows use ``seed + 1``;
    * ``answer_format``: how the answer is read from a response -- ``"last_number"``, ``"last_line"``
      (:func:`extract_last_line`), ``"answer_tag"`` (reasoning-gym's ``<answer>...</answer>`` convention,
      ``reasoning_gym.utils.extract_answer``; no tags, no answer), ``"answer_tag_or_whole"`` (the tags' content, else
      the whole response: a response that is only the answer needs no tags), or ``"auto"`` (default), chosen per
      generator by :func:`choose_answer_format` so that every row's gold answer gets the credit ``score_answer``
      gives it: ``answer_tag`` under the ``r1_zero`` template and template files (their text asks for tags); else the
      first of ``last_number`` (numeric answers), ``last_line`` and ``answer_tag_or_whole`` that reads every gold
      answer of this run's rows -- written alone and written as the instruction asks -- back to its full credit
      (multi-line grids and move lists, sentences whose final period counts, take ``answer_tag_or_whole``);
    * ``instruction``: replaces the answer-format instruction (default: :data:`RG_INSTRUCTIONS` of the format:
      "Answer with just the number." / "Answer with just the answer, on one line." / "If you write anything besides
      the answer, put the answer inside <answer> </answer> tags." / "Put the final answer inside <answer> </answer>
      tags."; none under the ``r1_zero`` template and template files, which say how to answer).

    Rewards: ``format_reward`` is 1 when an answer was found, ``answer_reward`` is ``score_answer``'s value (partial
    credit where the generator gives it; evaluation reports the exact answers beside it), ``reward`` =
    ``answer_reward``. Under every format but ``answer_tag`` the answer is read from the end of the response, so a
    response the length limit cut earns nothing (``credit_truncated=False``; ``--credit_truncated true`` to credit
    it); under the ``r1_zero`` template and template files that close the answer with ``</answer>``, generation stops
    there.

    Raises:
        RecipeError: reasoning-gym missing (naming the ``tasks`` extra), an unknown generator (naming ``--task``), a
            configuration the generator refuses (naming ``--task_config``).
    """
    args = replace(options, template=template) if template is not None else options
    rg = import_reasoning_gym()
    problem = generator_problem(rg, dataset_name)
    if problem:
        raise RecipeError(problem)
    config = dict(config)
    seed = config.pop("seed", 0)
    answer_format = config.pop("answer_format", "auto")
    instruction = config.pop("instruction", None)
    if answer_format not in ANSWER_FORMATS:
        raise RecipeError(f"--task_config: answer_format={answer_format!r}; expected one of {list(ANSWER_FORMATS)}")
    try:  # entries are drawn when indexed; some generators draw from Python's global generator (list_functions)
        test_data, test_entries, drawn = distinct_entries(rg, dataset_name, args.num_eval, seed + 1, config)
        with seeded_global_generators(seed):
            train_data = (
                rg.create_dataset(dataset_name, size=args.num_train_problems, seed=seed, **config) if train else None
            )
            train_entries = [train_data[i] for i in range(len(train_data))] if train else []
    except Exception as err:  # noqa: BLE001 -- the generator validates its own configuration
        raise RecipeError(
            f"--task_config {json.dumps(dict(config))}: reasoning-gym's {dataset_name} refused it "
            f"({type(err).__name__}: {err})"
        ) from None
    text = resolve_template(getattr(args, "template", "chat"))
    if answer_format == "auto":
        answer_format = choose_answer_format(test_entries + train_entries, test_data.score_answer, text)
    if instruction is None:
        given = getattr(args, "instruction", None)
        instruction = given if given is not None else RG_INSTRUCTIONS[answer_format]
        if text not in ("chat", "question_only") and given is None:
            instruction = None  # the template's text says how to answer
    extract = answer_extractor(answer_format)
    entries: dict[str, Mapping[str, Any]] = {}
    held_out_note = ""
    if len(test_entries) < args.num_eval:
        held_out_note = (
            f"{len(test_entries)} distinct questions, not --num_eval {args.num_eval}: {drawn} entries of "
            f"reasoning-gym's {dataset_name}" + (f" {json.dumps(dict(config))}" if config else "") + " held no more"
        )

    def rows(split: str, split_entries: list[Mapping[str, Any]], skip: set[str]) -> list[dict[str, Any]]:
        out = []
        for i, entry in enumerate(split_entries):
            if entry["question"] in skip:
                continue
            entry_id = f"{split}:{i}"
            entries[entry_id] = entry
            prompt = format_prompt(
                entry["question"],
                text,
                system_prompt=getattr(args, "system_prompt", None),
                instruction=instruction or None,
            )
            out.append(
                {
                    "prompt": prompt,
                    "answer": str(entry["answer"]),
                    "question": entry["question"],
                    "entry_id": entry_id,
                    "entry": json.dumps(entry, default=str),
                }
            )
        return out

    from datasets import Dataset

    held_out = rows("test", test_entries, set())
    questions = {e["question"] for e in test_entries}
    train_rows = rows("train", train_entries, questions) if train else None
    dropped = len(train_entries) - len(train_rows) if train else 0

    def score(response: str, row: Mapping[str, Any]) -> dict[str, float]:
        entry = entries.get(row.get("entry_id")) or json.loads(row["entry"])
        answer = extract(response)
        value = float(test_data.score_answer(answer=answer, entry=entry)) if answer is not None else 0.0
        return {"reward": value, "format_reward": float(answer is not None), "answer_reward": value}

    score.__qualname__ = f"reasoning_gym.{dataset_name}.score_answer"
    source = f"--task {REASONING_GYM_PREFIX}{dataset_name} --num_train_problems {args.num_train_problems}"
    if dropped:
        source += f" ({dropped} training rows dropped: their question is held out)"
    return Task(
        name=f"{REASONING_GYM_PREFIX}{dataset_name}",
        train=Dataset.from_list(train_rows) if train else None,
        test=Dataset.from_list(held_out),
        scorer=score,
        extractor=lambda response, row: extract(response),
        rewards=((f"{dataset_name}_reward", "reward"),),
        dataset=f"reasoning-gym {dataset_name}" + (f" {json.dumps(dict(config))}" if config else ""),
        source=source,
        description=f"{template_label(text)} prompt, {answer_format}, reasoning-gym score_answer",
        template=text,
        max_new_tokens=max_new_tokens,
        batch_size=getattr(args, "eval_batch_size", 50),
        stop=template_stop_strings(text),
        credit_truncated=answer_format == "answer_tag",  # the other formats read the end of the response
        held_out_note=held_out_note,
    )


@register_task(
    REASONING_GYM,
    "reasoning_gym",
    "any reasoning-gym generator; `uv sync --extra tasks`",
    options=(*EVERY_TASK, *PROMPT, "num_train_problems"),
    rows="the generator makes its rows and its own score_answer scores them",
    family="DATASET",
)
def reasoning_gym_generator(dataset_name: str) -> Callable[..., Task]:
    """``--task reasoning_gym:DATASET``: the factory of that generator's task (:func:`reasoning_gym_task`).

    Raises:
        RecipeError: reasoning-gym is not installed, or has no generator ``dataset_name`` (with the closest names).
    """
    problem = generator_problem(import_reasoning_gym(), dataset_name)
    if problem:
        raise RecipeError(problem)
    return functools.partial(reasoning_gym_task, dataset_name)
