"""Prompt templates for math questions, in TRL's two prompt shapes.

TRL datasets carry a ``prompt`` column that is either a plain string (the model continues the text as is) or a
conversation ``[{"role": "user", "content": ...}]`` (TRL applies the tokenizer's chat template itself and adds
the generation prompt). :func:`format_prompt` produces either, by template name:

* ``"r1_zero"``: plain text asking for reasoning in ``<think> </think>`` and the final answer in
  ``<answer> </answer>``, ending with ``"Assistant: <think>"`` so the completion starts inside the reasoning
  (the R1-Zero setup of DeepSeek-R1 and CS336 assignment 5, in our own words). Grade with
  ``trl_ext.rewards.r1_zero_reward``.
* ``"question_only"``: the question text itself, plus an optional instruction on a new line.
* ``"chat"``: a conversation with an optional system message and the question (plus instruction) as the user turn.
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("r1_zero", "question_only", "chat")
"""Names accepted by :func:`format_prompt`."""

R1_ZERO_TEMPLATE = (
    "Below is a dialogue in which a User gives an Assistant a problem to solve. The Assistant reasons step by "
    "step inside <think> </think> tags and then gives only the final result inside <answer> </answer> tags, "
    "laid out as: <think> step-by-step reasoning </think> <answer> final result </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)
"""Plain-text R1-Zero template; ``{question}`` is replaced by the question (and instruction, if any)."""

ANSWER_WITH_NUMBER = "Answer with just the number."
"""A ready-made ``instruction`` for questions with a numeric answer."""


def _user_text(question: str, instruction: str | None) -> str:
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    if instruction is not None and not isinstance(instruction, str):
        raise ValueError(f"instruction must be a string or None, got {type(instruction).__name__}")
    question = question.strip()
    return f"{question}\n{instruction.strip()}" if instruction and instruction.strip() else question


def chat_messages(
    question: str, system_prompt: str | None = None, instruction: str | None = None
) -> list[dict[str, str]]:
    """Return the conversation ``[{"role": "system", ...}?, {"role": "user", "content": question[\\ninstruction]}]``.

    Raises:
        ValueError: ``question`` is empty or not a string.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": _user_text(question, instruction)}]


def render_chat_prompt(
    tokenizer: Any, question: str, system_prompt: str | None = None, instruction: str | None = None
) -> str:
    """Render a question with the tokenizer's chat template, ending with the assistant generation prompt.

    Equivalent to ``tokenizer.apply_chat_template(chat_messages(...), add_generation_prompt=True,
    tokenize=False)``. Use it where a plain string is needed (vLLM, ``model.generate``); for TRL trainers prefer
    the conversation itself (``format_prompt(..., template="chat")``), which TRL renders the same way.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        question: the question text.
        system_prompt: optional system message.
        instruction: optional text appended to the question on a new line.

    Raises:
        ValueError: the tokenizer has no chat template, or ``question`` is empty.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat_template; use template='r1_zero' or 'question_only'"
        )
    return tokenizer.apply_chat_template(
        chat_messages(question, system_prompt, instruction), add_generation_prompt=True, tokenize=False
    )


def format_prompt(
    question: str,
    template: str,
    tokenizer: Any | None = None,
    *,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> str | list[dict[str, str]]:
    """Turn a question into the ``prompt`` value of a TRL dataset row.

    Args:
        question: the question text (stripped).
        template: ``"r1_zero"`` (plain string ending in ``"Assistant: <think>"``), ``"question_only"`` (the
            question, then the instruction on a new line if given) or ``"chat"`` (a conversation).
        tokenizer: only used by ``"chat"``: when given, the conversation is rendered to a string with
            :func:`render_chat_prompt`; when ``None`` (default), the message list is returned for TRL to render.
            Ignored by the other templates, which are already plain text.
        system_prompt: optional system message; only ``"chat"`` has a system turn.
        instruction: optional text appended to the question on a new line (e.g. :data:`ANSWER_WITH_NUMBER`).

    Returns:
        A string, or for ``"chat"`` without tokenizer a list of ``{"role", "content"}`` dicts.

    Raises:
        ValueError: unknown ``template``, empty ``question``, or ``system_prompt`` with a non-chat template.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if system_prompt is not None and template != "chat":
        raise ValueError(f"system_prompt is only supported by template='chat', not {template!r}")
    if template == "chat":
        if tokenizer is not None:
            return render_chat_prompt(tokenizer, question, system_prompt, instruction)
        return chat_messages(question, system_prompt, instruction)
    text = _user_text(question, instruction)
    return R1_ZERO_TEMPLATE.format(question=text) if template == "r1_zero" else text
