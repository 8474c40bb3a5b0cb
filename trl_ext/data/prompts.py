"""Prompt templates for math questions, in TRL's two prompt shapes.

:func:`format_prompt` gives a plain string (``"r1_zero"``, ``"question_only"``, a template text of your own) or a
conversation (``"chat"``, which TRL renders with the chat template); :func:`prompt_token_ids` is the one tokenization
of a prompt (exactly one BOS) that training, generation and evaluation share.
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("r1_zero", "question_only", "chat")
"""Names accepted by :func:`format_prompt`."""

R1_ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. The "
    "reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, "
    "i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)
"""Plain-text R1-Zero template: DeepSeek-R1 (2025) Table 1's instructions verbatim, in CS336's layout (question on
its own line, ``Assistant: <think>``); the course's ``r1_zero.prompt`` words them slightly differently (pass its path
as the template to train on it exactly). Grade with ``trl_ext.rewards.r1_zero_reward``."""

R1_ZERO_STOP = ("</answer>",)
"""Where an R1-Zero completion ends (kept in the text, as the course's vLLM ``stop``)."""


def template_stop_strings(template: str) -> tuple[str, ...]:
    """Where a template's completions end: :data:`R1_ZERO_STOP` for ``"r1_zero"`` and for a template text whose format
    closes the answer with ``</answer>`` (the course's ``r1_zero.prompt``); none for ``"chat"`` and
    ``"question_only"`` (a chat model ends its turn with EOS; a question alone states no format)."""
    if template == "r1_zero" or (template not in TEMPLATES and "</answer>" in template):
        return R1_ZERO_STOP
    return ()


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

    ``tokenizer.apply_chat_template(chat_messages(...), add_generation_prompt=True, tokenize=False)``, for where a
    plain string is needed; TRL trainers render the conversation itself the same way.

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
            question, then the instruction on a new line if given), ``"chat"`` (a conversation), or the text of a
            template of your own holding ``{question}`` (e.g. the course's ``r1_zero.prompt``; the question, plus the
            instruction, replaces that placeholder and nothing else, so other braces are kept as written).
        tokenizer: ``"chat"`` only: render to a string (:func:`render_chat_prompt`); None (default): the messages.
        system_prompt: optional system message; only ``"chat"`` has a system turn.
        instruction: optional text appended to the question on a new line (e.g. :data:`ANSWER_WITH_NUMBER`).

    Returns:
        A string, or for ``"chat"`` without tokenizer a list of ``{"role", "content"}`` dicts.

    Raises:
        ValueError: unknown ``template`` (neither a name nor a text with ``{question}``), empty ``question``, or
            ``system_prompt`` with a non-chat template.
    """
    if template not in TEMPLATES and "{question}" not in template:
        raise ValueError(f"template must be one of {TEMPLATES} or a text holding {{question}}, got {template!r}")
    if system_prompt is not None and template != "chat":
        raise ValueError(f"system_prompt is only supported by template='chat', not {template!r}")
    if template == "chat":
        if tokenizer is not None:
            return render_chat_prompt(tokenizer, question, system_prompt, instruction)
        return chat_messages(question, system_prompt, instruction)
    text = _user_text(question, instruction)
    if template == "question_only":
        return text
    return (R1_ZERO_TEMPLATE if template == "r1_zero" else template).replace("{question}", text)


# ---------------------------------------------------------------------------------------------- one BOS token
def adds_bos_token(tokenizer: Any) -> bool:
    """True when ``tokenizer(text)`` (special tokens on, as TRL tokenizes plain-text prompts) starts with its BOS token.

    Llama-3, Gemma and Mistral tokenizers do (``add_bos_token=True``); Qwen and the embedded SmolLM2 tokenizer do not.
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor holds its tokenizer
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def strip_leading_bos(text: str, tokenizer: Any, *, adds_bos: bool | None = None) -> str:
    """Drop the BOS token text that ``text`` starts with when the tokenizer adds BOS itself, so it gets exactly one.

    (A prompt rendered by a chat template that writes ``{{ bos_token }}`` would otherwise get two.) When the tokenizer
    adds none, a repeated leading BOS text is collapsed to one; other text is unchanged. ``adds_bos``:
    :func:`adds_bos_token` when already known.
    """
    bos = getattr(getattr(tokenizer, "tokenizer", tokenizer), "bos_token", None)
    if not bos or not isinstance(text, str) or not text.startswith(bos):
        return text
    return _strip_bos_text(text, bos, adds_bos_token(tokenizer) if adds_bos is None else adds_bos)


def _strip_bos_text(text: str, bos: str, adds_bos: bool) -> str:
    rest = text
    while rest.startswith(bos):
        rest = rest[len(bos) :]
    return rest if adds_bos else bos + rest


def prompt_token_ids(tokenizer: Any, prompt: str | list[dict[str, str]], **chat_template_kwargs: Any) -> list[int]:
    """The token ids trl_ext trains on for one prompt: the input of generation in GRPO and in :mod:`trl_ext.eval`.

    A string: ``tokenizer(strip_leading_bos(prompt))["input_ids"]`` (special tokens as TRL adds them: exactly one BOS
    where the tokenizer uses one); a conversation: ``apply_chat_template(prompt, add_generation_prompt=True,
    tokenize=True)``, as ``trl.GRPOTrainer._tokenize_prompts``.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt: a plain string or a list of ``{"role", "content"}`` messages.
        **chat_template_kwargs: passed to ``apply_chat_template`` for conversations (e.g. ``chat_template=``,
            ``tools=``, ``enable_thinking=``).

    Raises:
        ValueError: ``prompt`` is neither a string nor a list of messages.
    """
    if isinstance(prompt, str):
        return list(tokenizer(strip_leading_bos(prompt, tokenizer))["input_ids"])
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        out = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
        )
        return list(out["input_ids"])
    raise ValueError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def strip_leading_bos_columns(dataset: Any, tokenizer: Any, columns: tuple[str, ...]) -> Any:
    """Apply :func:`strip_leading_bos` to the string values of ``columns`` of a ``datasets`` dataset (others kept).

    The trl_ext trainers call it before TRL tokenizes a plain-text dataset; without those columns or a BOS token the
    dataset is returned as is.
    """
    bos = getattr(getattr(tokenizer, "tokenizer", tokenizer), "bos_token", None)
    present = [c for c in columns if c in (dataset.column_names or [])]
    if present:
        first = next(iter(dataset), {})
        present = [c for c in present if isinstance(first.get(c), str)]  # conversations are left to the template
    if not bos or not present:
        return dataset
    adds_bos = adds_bos_token(tokenizer)
    return dataset.map(_strip_bos_example, fn_kwargs={"bos": bos, "adds_bos": adds_bos, "columns": present})


def _strip_bos_example(example: dict[str, Any], bos: str, adds_bos: bool, columns: list[str]) -> dict[str, Any]:
    return {
        c: _strip_bos_text(example[c], bos, adds_bos)
        if isinstance(example[c], str) and example[c].startswith(bos)
        else example[c]
        for c in columns
    }
