"""A response that copies its prompt's example of the answer format has not used the format.

The R1-Zero prompt (DeepSeek-R1, Table 1; the course's ``r1_zero.prompt``) ends with ``<think> reasoning process here
</think> <answer> answer here </answer>``; a small model often repeats it, which ``r1_zero_reward_fn`` scores as well
formed (much of the 135M model's format rate on GSM8K). :func:`without_copied_format` wraps a grader so that a
response whose last ``<answer>`` tag holds the example's text (``answer here``, or nothing) gets ``format_reward`` 0;
``reward`` and ``answer_reward`` stay the grader's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def template_answer_examples(template: str) -> frozenset[str]:
    """The texts a prompt template shows inside its own ``<answer> </answer>`` tags, whitespace collapsed and case
    folded, the empty text of tags around nothing (``"enclosed within <answer> </answer> tags"``) included: a
    response that repeats that sentence answers nothing either. Empty for a template without the tags (``chat``,
    ``question_only``).

    Examples: trl_ext's ``r1_zero`` template and the course's ``r1_zero.prompt`` -> ``{"", "answer here"}``;
    ``"... <answer> final result </answer>"`` -> ``{"final result"}``.
    """
    return frozenset(map(_normalized, _ANSWER_TAG_RE.findall(template)))


def copies_template_example(response: str, examples: frozenset[str]) -> bool:
    """Whether the last ``<answer>...</answer>`` of ``response`` holds one of the template's ``examples`` (whitespace
    collapsed, case folded), i.e. the response repeated the prompt's example instead of answering."""
    found = _ANSWER_TAG_RE.findall(response)
    return bool(found) and _normalized(found[-1]) in examples


def without_copied_format(
    reward_fn: Callable[[str, str], Mapping[str, float]], template: str
) -> Callable[[str, str], dict[str, float]]:
    """``reward_fn(response, ground_truth)`` (the course shape), except that a response copying the template's own
    ``<answer>`` example (:func:`copies_template_example`) gets ``format_reward`` 0.0; ``reward`` and
    ``answer_reward`` are ``reward_fn``'s. ``reward_fn`` itself when ``template`` shows no example.

    Args:
        reward_fn: the grader, e.g. ``r1_zero_reward_fn`` or the course's ``drgrpo_grader.r1_zero_reward_fn``.
        template: the prompt template's text (``trl_ext.data.prompts.R1_ZERO_TEMPLATE``, a template file's text).
    """
    examples = template_answer_examples(template)
    if not examples:
        return reward_fn

    @functools.wraps(reward_fn)
    def graded(response: str, ground_truth: str) -> dict[str, float]:
        scores = dict(reward_fn(response, ground_truth))
        if scores.get("format_reward") and copies_template_example(response, examples):
            scores["format_reward"] = 0.0
        return scores

    return graded
