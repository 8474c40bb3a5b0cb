"""Verifiable rewards for math answers: R1-Zero format + answer, GSM8K / arithmetic last number, MATH boxed answers.

Each reward is written once in the course shape ``reward_fn(response, ground_truth) -> {"reward", "format_reward",
"answer_reward"}`` (CS336 assignment 5) and exported in TRL's shape by :func:`trl_ext.rewards.adapters.as_trl_reward`
(ground truth from the ``answer`` column). Symbolic equivalence is math-verify's, run in a worker process bounded by
:data:`MATH_VERIFY_TIMEOUT_S` (:mod:`trl_ext.rewards.verify_worker`), only where string or number comparison cannot
settle it.
"""

from __future__ import annotations

import re
from decimal import Decimal

from trl_ext.rewards.adapters import as_trl_reward
from trl_ext.rewards.verify_worker import verify_in_worker

MATH_VERIFY_TIMEOUT_S = 1.0
"""Time limit (seconds) for grading one answer with math-verify, in any thread: CPU seconds of the worker (Linux), at
most twice that in wall time. Read at each call, so it can be changed at run time."""

# The number rules are those of extract_last_number's docstring; a mantissa: "1,234", "3.50", ".25".
_MANTISSA = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)"
# Scientific notation (E notation, a power of ten, "10^3" alone; exponents of at most 6 digits) before plain numbers.
_SPACE = r"(?:[^\S\n]|\\[,;:! ]|~)*"  # spaces within a line, LaTeX spaces
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-")
_NUMBER_BODY = (
    rf"(?<![\w.])(?P<e_mantissa>{_MANTISSA})[eE](?P<e>[+-]?\d{{1,6}})(?!\w|\.\d)"
    rf"|(?:(?P<x_mantissa>{_MANTISSA}){_SPACE}(?:\\times|\\cdot|[×·⋅*xX]){_SPACE}|(?<![\w.]))"
    rf"10(?:{_SPACE}(?:\^|\*\*){_SPACE}(?:\{{\s*(?P<braced>[+-]?\d{{1,6}})\s*\}}|(?P<bare>[+-]?\d{{1,6}})(?!\d|\.\d))"
    rf"|(?P<sup>[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]{{1,6}}))"
    rf"|{_MANTISSA}"
)
_NUMBER_RE = re.compile(rf"(?P<sign>(?<![\w)\]])-)?(?:{_NUMBER_BODY})")
_WHOLE_NUMBER_RE = re.compile(rf"(?P<sign>-)?(?:{_NUMBER_BODY})")

# LaTeX thousands separators before a group of exactly three digits; the braced decimal point (normalize_number_text)
_LATEX_SPACE = r"(?:\\[,!:; ]|\\thinspace\s*|~)"
_LATEX_THOUSANDS_RE = re.compile(rf"(?<=\d)(?:(?:\{{,\}}|,){_LATEX_SPACE}*|{_LATEX_SPACE}+)(?=\d{{3}}(?!\d))")
_LATEX_DECIMAL_RE = re.compile(r"(?<=\d)\{\.\}(?=\d)")


def normalize_number_text(text: str) -> str:
    """Rewrite the LaTeX ways of writing numbers into plain ones, leaving everything else as is.

    ``"12{,}345"``, ``"12,\\!345"``, ``"12\\,345"`` (and the other LaTeX spaces between a digit and a group of three
    digits) -> ``"12,345"``; ``"0{.}25"`` -> ``"0.25"``; the Unicode minus ``"\u2212"`` -> ``"-"``. A thin space that
    does not separate thousands (``"2\\,5"``) is kept.
    """
    text = text.replace("\u2212", "-")
    if "\\" not in text and "{" not in text and "~" not in text:
        return text
    return _LATEX_DECIMAL_RE.sub(".", _LATEX_THOUSANDS_RE.sub(",", text))


def _plain_number(match: str) -> str:
    """ "1,234" -> "1234", ".25" -> "0.25", "-.5" -> "-0.5"."""
    number = match.replace(",", "")
    if number.startswith("."):
        return "0" + number
    return "-0" + number[1:] if number.startswith("-.") else number


def _number_value(match: re.Match) -> tuple[str, Decimal]:
    """A match of ``_NUMBER_RE``/``_WHOLE_NUMBER_RE`` as (normalized text, value).

    Scientific numbers are written out ("1.5e-3" -> "0.0015"), or in E notation beyond 100 digits ("1e500" ->
    "1e+500"), so no huge string is ever built.
    """
    exponent = match["e"] or match["braced"] or match["bare"] or (match["sup"] or "").translate(_SUPERSCRIPTS)
    if not exponent:
        text = _plain_number(match.group(0))
        return text, Decimal(text)
    mantissa = (match["e_mantissa"] or match["x_mantissa"] or "1").replace(",", "")
    value = Decimal(f"{'-' if match['sign'] else ''}{mantissa}E{int(exponent)}")
    return (format(value, "f") if abs(value.adjusted()) <= 100 else format(value, "e")), value


_ZERO = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


# ----------------------------------------------------------------------------------------------- number answers
def extract_last_number(text: str) -> str | None:
    """Return the last number written in ``text``, normalized, or ``None`` when there is none.

    Thousands commas are removed ("1,234" -> "1234"), also LaTeX ones ("12{,}345", "12,\\!345", "12\\,345" ->
    "12345", see :func:`normalize_number_text`); a sentence-final dot is not part of the number ("42." -> "42"); a
    leading minus is kept ("-7") unless it follows a word character or closing bracket ("5-3" -> "3"); the Unicode
    minus "\u2212" counts as "-"; decimals are kept as written ("3.50"), a missing leading zero is added
    (".25" -> "0.25"). Scientific notation is one number, written out: "1.5e3", "1.5E3", "1.5 \\times 10^{3}"
    -> "1500"; "2.5 × 10^3", "2.5x10^3" -> "2500"; "1.5\\cdot 10^{-3}" -> "0.0015"; "10^3" -> "1000" (E notation where
    the mantissa does not follow a letter and nothing but punctuation follows the exponent: "the3e5", "3e5a",
    "3eggs" stay plain; other powers such as "2^10" are not evaluated).

    Args:
        text: free text, e.g. a model response.

    Returns:
        The number as a string, e.g. ``extract_last_number("The answer is 1,234.") == "1234"``, or ``None``.
    """
    matches = list(_NUMBER_RE.finditer(normalize_number_text(text)))
    return _number_value(matches[-1])[0] if matches else None


def to_decimal(text: str) -> Decimal | None:
    """Parse a whole string as a decimal number ("72", "-3.50", "1,234", "42.", ".25"); ``None`` if it is not one.

    Numbers are read as in :func:`extract_last_number` (LaTeX separators, scientific notation: ``"3{,}000"``,
    ``"1.5e3"``). Surrounding whitespace and a trailing dot are ignored; nothing else is (``"$5"`` gives None).
    """
    match = _WHOLE_NUMBER_RE.fullmatch(normalize_number_text(text.strip()).removesuffix("."))
    return None if match is None else _number_value(match)[1]


def parse_gsm8k_ground_truth(answer_field: str) -> str:
    """Return the final answer of a GSM8K ``answer`` field, the number after the last ``"####"``.

    Args:
        answer_field: e.g. ``"Natalia sold 48/2 = 24 clips ...\\n#### 72"``.

    Returns:
        The normalized number as a string (commas and a trailing dot removed), e.g. ``"72"``.

    Raises:
        ValueError: there is no ``"####"`` marker, or what follows it is not a number.
    """
    if "####" not in answer_field:
        raise ValueError(
            f"expected a GSM8K answer ending in '#### <number>', found no '####' in {answer_field[-80:]!r}"
        )
    final = answer_field.rsplit("####", 1)[1].strip()
    match = _WHOLE_NUMBER_RE.fullmatch(normalize_number_text(final).removesuffix("."))
    if match is None:
        raise ValueError(f"expected a number after '####', got {final!r}")
    return _number_value(match)[0]


def numbers_equal(a: str, b: str) -> bool:
    """True when two number strings have the same value (``"3.50"`` == ``"3.5"``, ``"1,234"`` == ``"1234"``).

    Raises:
        ValueError: either string is not a plain number (see :func:`to_decimal`).
    """
    da, db = to_decimal(a), to_decimal(b)
    if da is None or db is None:
        raise ValueError(f"expected two numbers, got {a!r} and {b!r}")
    return da == db


def gsm8k_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Last-number reward for GSM8K and for the generated arithmetic problems (course-style ``reward_fn``).

    Rule: the predicted answer is :func:`extract_last_number` of the whole response.
    ``format_reward`` = 1.0 when a number was found, else 0.0; ``answer_reward`` = 1.0 when it equals the ground
    truth numerically (``"3.50"`` == ``"3.5"``), else 0.0; ``reward`` = ``answer_reward``.

    Args:
        response: the model's completion text.
        ground_truth: the final answer as a number string (``"72"``, the ``answer`` column of the loaders); a raw
            GSM8K answer field ending in ``"#### 72"`` is accepted too.

    Raises:
        ValueError: the ground truth is not a number.
    """
    truth = parse_gsm8k_ground_truth(ground_truth) if "####" in ground_truth else ground_truth
    if to_decimal(truth) is None:
        raise ValueError(f"ground_truth must be a number (e.g. '72'), got {ground_truth!r}")
    predicted = extract_last_number(response)
    if predicted is None:
        return dict(_ZERO)
    correct = float(numbers_equal(predicted, truth))
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


# ------------------------------------------------------------------------------------------------- MATH answers
def extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    ``"\\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``; the brace-less form ``"\\boxed 5"`` -> ``"5"``.
    Returns ``None`` when there is no box or the last one is never closed (e.g. a truncated generation).
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    box = _box_at(text, start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")))
    return None if box is None else box[1]


def _box_at(text: str, i: int) -> tuple[int, str | None] | None:
    """The box whose keyword (``\\boxed``/``\\fbox``) ends at ``i``: (end, content), content None when it is never
    closed (end = len(text)); None when no box follows the keyword (neither ``{`` nor a space)."""
    if i < len(text) and text[i] == " ":  # "\boxed 5"
        content = re.match(r"\s*([^\s$]+)", text[i:])
        return (i + content.end(), content.group(1)) if content else (len(text), None)
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1, text[i + 1 : j].strip()
    return len(text), None


_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
# What may stand between the boxes of one multi-part answer ("$\boxed{2}$ and $\boxed{4}$", "\boxed{1}, \boxed{3}"):
# math delimiters, LaTeX spaces, \text{...} wrappers and a list connector. Anything else is prose.
_GAP_MARKUP_RE = re.compile(r"\$|\\[()\[\]]|\\q?quad\b|\\[,;:! ]|\\text(?:rm)?\s*\{([^{}]*)\}|\s+")
_GAP_CONNECTORS = {"", ",", ";", "&", "and", "or", ",and", ",or", ";and"}
_GAP_ASSIGNMENT_RE = re.compile(r"[a-z](?:_\{?\w+\}?)?=$")


def _box_spans(text: str) -> list[tuple[int, int, str | None]]:
    """Every outermost box as (start, end, content); content None for a box never closed (end = len(text))."""
    spans: list[tuple[int, int, str | None]] = []
    position = 0
    for match in _BOX_RE.finditer(text):
        if match.start() < position:  # inside the previous box (a nested box)
            continue
        box = _box_at(text, match.end())
        if box is None:
            continue
        end, content = box
        # a box around a box ("\boxed{\boxed{3}}") means the inner answer
        if content is not None and text[match.end()] == "{" and _BOX_RE.search(content):
            content = extract_boxed_answer(content)
        spans.append((match.start(), end, content))
        position = end
    return spans


def extract_boxed_parts(text: str) -> tuple[list[str], int]:
    """Return the final group of ``\\boxed{}`` contents of ``text`` and the number of other boxes before it.

    A group is a run of boxes separated only by math delimiters, LaTeX spaces, a list connector (``","``, ``";"``,
    ``"and"``, ``"or"``, ``"&"``) and the unknown's name (``"x = \\boxed{2} or x = \\boxed{4}"``):
    ``"$\\boxed{2}$ and $\\boxed{4}$."`` -> ``(["2", "4"], 0)``. Earlier boxes separated by other text are counted:
    ``"First $\\boxed{3}$ is wrong; the answer is $\\boxed{4}$"`` -> ``(["4"], 1)``. A box in a box counts as its
    inner content.

    Returns:
        ``([], 0)`` when there is no box, or the last box is never closed (a truncated generation).
    """
    spans = _box_spans(text)
    if not spans or spans[-1][2] is None:
        return [], 0
    first = len(spans) - 1
    while first > 0 and spans[first - 1][2] is not None:
        gap = _GAP_MARKUP_RE.sub(lambda m: m.group(1) or "", text[spans[first - 1][1] : spans[first][0]])
        gap = _GAP_ASSIGNMENT_RE.sub("", "".join(gap.split()).lower())  # "x=": the name of the unknown
        if gap not in _GAP_CONNECTORS:
            break
        first -= 1
    return [content for _, _, content in spans[first:]], first


def extract_boxed_answer(text: str) -> str | None:
    """The final answer marked with ``\\boxed{}`` in ``text``: the parts of its final group joined by ``", "``.

    ``"$\\boxed{2}$ and $\\boxed{4}$"`` -> ``"2, 4"`` (graded as the set/tuple of both, so one part alone is wrong);
    ``"\\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``. ``None`` when there is no box or the last one is never
    closed. See :func:`extract_boxed_parts`.
    """
    parts, _ = extract_boxed_parts(text)
    return ", ".join(parts) if parts else None


def extract_answer_tag(text: str) -> str | None:
    """Return the stripped text between the last ``<answer>`` and the next ``</answer>``; ``None`` if absent/empty."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    end = text.find("</answer>", start)
    if end < 0:
        return None
    return text[start + len("<answer>") : end].strip() or None


def extract_math_answer(text: str) -> str | None:
    """Return the final answer of a MATH-style response, or ``None`` when none is marked.

    Order: the last ``<answer>...</answer>`` block (and the boxed answer inside it, if any); otherwise the boxed
    answer of the whole text (:func:`extract_boxed_answer`).
    """
    tagged = extract_answer_tag(text)
    if tagged is not None:
        return extract_boxed_answer(tagged) if _BOX_RE.search(tagged) else tagged
    return extract_boxed_answer(text)


def grade_math_answer(answer: str, ground_truth: str) -> bool:
    """True when ``answer`` is mathematically equivalent to ``ground_truth``.

    Checks in order: equal strings after stripping; equal values when both are numbers (:func:`to_decimal`);
    otherwise ``math_verify.verify(parse(ground_truth), parse(answer))`` (``"\\frac{1}{2}"`` vs ``"0.5"``) in a
    worker bounded by :data:`MATH_VERIFY_TIMEOUT_S`. Failures, expressions too large to evaluate (``9^{9^{9^{9}}}``)
    and timeouts count as not equivalent. Safe from any thread.

    Args:
        answer: the extracted model answer (no surrounding prose), LaTeX or plain text.
        ground_truth: the reference answer, LaTeX or plain text.
    """
    answer, ground_truth = answer.strip(), ground_truth.strip()
    if not answer or not ground_truth:
        return False
    if answer == ground_truth:
        return True
    a, g = to_decimal(answer), to_decimal(ground_truth)
    if a is not None and g is not None:
        return a == g
    # math-verify reads "3\,000" as 3*000 and "1.5e3" as 1.5*e*3: give it the numbers' values
    return verify_in_worker(_verify_text(ground_truth, g), _verify_text(answer, a), MATH_VERIFY_TIMEOUT_S)


def _verify_text(text: str, value: Decimal | None) -> str:
    """What math-verify is given for one side: a number (see :func:`to_decimal`) as its plain value ("1.5e3" ->
    "1500"; beyond 100 digits "15 \\times 10^{499}", which math-verify reads as a power), other text with its
    LaTeX number separators made plain (:func:`normalize_number_text`)."""
    if value is None:
        return normalize_number_text(text)
    if abs(value.adjusted()) <= 100:
        return format(value, "f")
    sign, digits, exponent = value.as_tuple()
    return f"{'-' if sign else ''}{''.join(map(str, digits))} \\times 10^{{{exponent}}}"


def math_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """MATH-style reward: marked final answer graded with math-verify (course-style ``reward_fn``).

    Rule: the predicted answer is :func:`extract_math_answer` of the response (``<answer>`` tags, else the last
    ``\\boxed{}``). ``format_reward`` = 1.0 when such an answer was found, else 0.0; ``answer_reward`` = 1.0 when
    :func:`grade_math_answer` accepts it, else 0.0 (also when nothing was found); ``reward`` = ``answer_reward``.

    Args:
        response: the model's completion text.
        ground_truth: the reference answer (e.g. ``"\\frac{1}{2}"``; the ``answer`` column of the loaders).
    """
    predicted = extract_math_answer(response)
    if predicted is None:
        return dict(_ZERO)
    correct = float(grade_math_answer(predicted, ground_truth))
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


# -------------------------------------------------------------------------------------------------- R1-Zero
def r1_zero_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """R1-Zero format + answer reward (semantics of CS336 assignment 5 ``r1_zero_reward_fn``).

    The prompt (``trl_ext.data`` template ``"r1_zero"``) ends with ``"<think>"``, so the response starts inside the
    reasoning and must look like ``"... reasoning ... </think> <answer> ANSWER </answer>"``.

    Rule:
      * well formed = the response contains ``"</think> <answer>"`` (exactly one space, as in the course) and a
        ``"</answer>"`` after its last ``"<answer>"``. Otherwise all three values are 0.0 (the answer is not
        graded).
      * ANSWER = the text between the last ``"<answer>"`` and the next ``"</answer>"``; if it contains a
        ``\\boxed{}``, the box content (an unclosed box grades as wrong).
      * ``format_reward`` = 1.0 when well formed; ``answer_reward`` = 1.0 when well formed and
        :func:`grade_math_answer` (string / numeric / math-verify equivalence) accepts ANSWER;
        ``reward`` = ``answer_reward``: 1.0 only when the format AND the answer are right (no partial credit for
        format, as in the course, so that format alone cannot be reward-hacked).

    One deliberate difference from the course code: text after ``"</answer>"`` is ignored (the course deletes
    ``"</answer>"`` and grades the rest); with generation stopped at ``"</answer>"``, as both do, they agree.

    Args:
        response: the model's completion (text after the prompt's ``"<think>"``).
        ground_truth: the reference answer (the ``answer`` column of the loaders).
    """
    if "</think> <answer>" not in response:
        return dict(_ZERO)
    start = response.rfind("<answer>")
    end = response.find("</answer>", start)
    if end < 0:
        return dict(_ZERO)
    answer: str | None = response[start + len("<answer>") : end]
    if _BOX_RE.search(answer):
        answer = extract_boxed_answer(answer)
    correct = float(answer is not None and grade_math_answer(answer, ground_truth))
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


# ------------------------------------------------------------------------------------------- TRL reward funcs
r1_zero_reward = as_trl_reward(r1_zero_reward_fn, name="r1_zero_reward")
gsm8k_reward = as_trl_reward(gsm8k_reward_fn, name="gsm8k_reward")
math_reward = as_trl_reward(math_reward_fn, name="math_reward")
# The generated arithmetic problems are graded exactly like GSM8K (last number in the response, numeric equality);
# this is the same function under its own name so TRL logs it as rewards/arithmetic_reward/mean.
arithmetic_reward = as_trl_reward(gsm8k_reward_fn, name="arithmetic_reward")
