"""reasoning-gym generators as tasks, the parts that need no Task: importing the library, checking a generator's
name, drawing held-out entries with distinct questions, and reading an answer from a response in the format the
prompt asks for (``answer_format``). ``trl_ext.tasks.reasoning_gym_task`` builds the task from these.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from trl_ext import rewards
from trl_ext.data.prompts import ANSWER_WITH_NUMBER
from trl_ext.errors import RecipeError

REASONING_GYM_PREFIX = "reasoning_gym:"
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
