"""Greedy evaluation of a causal LM on held-out rows, graded by a task's scorer or a course-style reward function.

:func:`evaluate_rows` / :func:`evaluate_math` generate (HF ``generate`` for a ``torch.nn.Module``, vLLM for a
``vllm.LLM``: :func:`load_eval_model`) and grade (:func:`score_rows`); :func:`write_jsonl` saves the records. The
course supplement's parsers are here too: :func:`parse_gsm8k_response` and :func:`parse_mmlu_response`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteriaList

from trl_ext import machine
from trl_ext.data.prompts import prompt_token_ids
from trl_ext.rewards.adapters import without_credit
from trl_ext.rewards.math_answers import extract_last_number
from trl_ext.speed.packed_linear import PackedLinearWeights
from trl_ext.speed.shared_prompts import accepts_position_ids, cache_argument, generate_with_shared_prompts
from trl_ext.stop_strings import StopAtStrings, check_stop_strings, cut_at_stop

BACKENDS = ("auto", "hf", "vllm")
"""Generation backends accepted by :func:`resolve_backend` / :func:`load_eval_model`."""

MMLU_LETTERS = ("A", "B", "C", "D")


# ------------------------------------------------------------------------------------------------------- parsers
def parse_gsm8k_response(model_output: str) -> str | None:
    """The last number in ``model_output`` as a string, or ``None`` when it holds no number (course supplement).

    Read by :func:`trl_ext.rewards.extract_last_number` (``"1,234"`` -> ``"1234"``, ``"42."`` -> ``"42"``,
    ``"2.5 × 10^3"`` -> ``"2500"``).
    """
    return extract_last_number(model_output)


# The letter of an answer statement: a capital A-D standing alone, optionally in brackets ("(C)", "[C]").
_LETTER = r"[(\[{]?\s*([A-D])\s*[)\]}]?(?![A-Za-z0-9])"
# An answer statement: "answer is B", "Answer: (C)", "final answer - D", "correct option is D", "the best choice: A".
_MMLU_STATED_RE = re.compile(
    r"(?i:\banswer|\b(?:correct|right|best|final)\s+(?:option|choice))"
    r"\s*(?:(?i:is|would\s+be|will\s+be)\b)?\s*[:\-]?\s*" + _LETTER
)
# A bare mention of an option: "option B", "choice (C)".
_MMLU_MENTION_RE = re.compile(r"(?i:\boption|\bchoice)\s*(?:(?i:is)\b)?\s*[:\-]?\s*" + _LETTER)
_MMLU_LONE_LETTER_RE = re.compile(r"^\s*\(?([A-D])\)?[.:)]?\s*$")
# Markup around a letter: LaTeX text/math commands, LaTeX math delimiters, markdown emphasis and code.
_LATEX_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|boxed|emph|fbox)\s*\{([^{}]*)\}")
_LATEX_MATH_RE = re.compile(r"\\[()\[\]]|\$")
_EMPHASIS_RE = re.compile(r"(?<![A-Za-z0-9])[*_`]+|[*_`]+(?![A-Za-z0-9])")


def strip_markup(text: str) -> str:
    """``text`` with LaTeX and markdown markup around words removed, for reading option letters.

    ``\\text{D}``, ``\\textbf{D}``, ``\\boxed{D}`` (and ``\\mathrm``, ``\\mathbf``, ``\\emph``, ...) keep their content;
    ``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``$`` become spaces; markdown emphasis and code marks (``*D*``, ``**D**``,
    ``_D_``, `` `D` ``) are dropped. Underscores and asterisks inside words (``snake_case``, ``2*3``) stay.
    """
    previous = None
    while previous != text:  # nested commands: \boxed{\text{D}}
        previous, text = text, _LATEX_WRAPPER_RE.sub(r"\1", text)
    return _EMPHASIS_RE.sub("", _LATEX_MATH_RE.sub(" ", text))


def parse_mmlu_response(mmlu_example: Mapping[str, Any], model_output: str) -> str | None:
    """The option letter ``"A"``-``"D"`` that ``model_output`` picks for ``mmlu_example``, or ``None`` (course
    supplement).

    The output is read with its markup removed (:func:`strip_markup`: ``"Answer: *D*"``, ``"Answer: \\(D\\)"``,
    ``"**Answer:** $\\text{D}$"`` all read as ``"Answer: D"``). Rules, first match wins:

    1. an answer statement: ``"answer"`` (any case; ``"The answer is C"``, ``"Answer: (C)"``, ``"final answer -
       D"``) or ``"correct/right/best/final option/choice"``, optionally followed by ``"is"``/``"would be"`` and
       ``":"``, then a capital letter A-D standing alone, optionally in brackets. The LAST statement counts (a
       revised answer wins), and a statement wins over any mere mention of another option:
       ``"The answer is C. Option B is tempting but wrong."`` -> ``"C"``;
    2. the whole output is one letter (``"B"``, ``"(B)"``, ``"B."``);
    3. bare mentions ``"option X"`` / ``"choice X"`` that all name the same letter;
    4. exactly one option's text appears in the output (case-insensitive), e.g. the model copied the option.

    Args:
        mmlu_example: an MMLU example with ``options``, a sequence of 4 option strings (other keys, such as
            ``subject``, ``question`` and ``answer``, are not used).
        model_output: the model's response text.

    Returns:
        ``"A"``, ``"B"``, ``"C"``, ``"D"`` or ``None`` when the output names no single option.

    Raises:
        ValueError: ``mmlu_example`` has no ``options`` field holding 4 strings.
    """
    options = mmlu_example.get("options") if isinstance(mmlu_example, Mapping) else None
    if (
        not isinstance(options, Sequence)
        or isinstance(options, str)
        or len(options) != 4
        or not all(isinstance(o, str) for o in options)
    ):
        raise ValueError(f"mmlu_example['options'] must be a sequence of 4 strings, got {options!r}")
    text = strip_markup(model_output)
    stated = _MMLU_STATED_RE.findall(text)
    if stated:
        return stated[-1]
    lone = _MMLU_LONE_LETTER_RE.match(text)
    if lone:
        return lone.group(1)
    mentioned = set(_MMLU_MENTION_RE.findall(text))
    if len(mentioned) == 1:
        return mentioned.pop()
    if mentioned:
        return None
    lowered = model_output.lower()
    found = [
        letter for letter, option in zip(MMLU_LETTERS, options) if option.strip() and option.strip().lower() in lowered
    ]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------------------------------------------- generation
def render_prompts(tokenizer: Any, prompts: Sequence[str | list[dict[str, str]]]) -> list[str]:
    """Strings stay as they are; conversations are rendered with the chat template and the generation prompt."""
    return [
        p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str | list[dict[str, str]]],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "generating",
    disable_progress: bool = False,
    prepack_linear_weights: bool = True,
    *,
    stop_strings: Sequence[str] = (),
) -> tuple[list[str], list[bool]]:
    """Greedy completions for ``prompts`` (plain strings or chat conversations), in order, with HF ``generate``.

    Args:
        model: causal LM (put in eval mode for the call, then restored).
        tokenizer: its tokenizer; must have a pad token.
        prompts: N prompts.
        max_new_tokens: generation budget per completion (>= 1).
        batch_size: prompts per ``generate`` call (>= 1).
        desc: progress-bar label.
        disable_progress: hide the progress bar.
        prepack_linear_weights: on a CPU in fp32, run ``nn.Linear`` on weights packed once for the call
            (:mod:`trl_ext.speed.packed_linear`; rounding may differ; off, in one log line, where it cannot apply).
            Default True.
        stop_strings: a completion ends with the first of these it writes, kept in the text (the handout's
            ``stop=["</answer>"], include_stop_str_in_output=True``). Default none.

    Prompts are tokenized as the trainers tokenize them (:func:`trl_ext.data.prompt_token_ids`) and left-padded; the
    prefix every prompt of a batch shares is prefilled once (:mod:`trl_ext.speed.shared_prompts`).

    Returns:
        ``(texts, cut)``: N decoded completions without special tokens, and for each whether the length limit cut
        it (no EOS of the model's generation config or the tokenizer, no stop string).

    Raises:
        ValueError: when ``max_new_tokens`` or ``batch_size`` is < 1.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}; expected both >= 1")
    stop_strings = check_stop_strings(stop_strings)
    end_ids = _eos_ids(model, tokenizer)
    token_ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    device = next(model.parameters()).device
    outputs: list[str] = []
    cut: list[bool] = []
    generate = generate_with_shared_prompts(model.generate, model, cache_argument(model), accepts_position_ids(model))
    packed = PackedLinearWeights() if prepack_linear_weights else None
    with _generating(model, tokenizer):
        with packed.fixed_weights() if packed is not None else nullcontext():
            for start in tqdm(range(0, len(token_ids), batch_size), desc=desc, disable=disable_progress):
                batch = tokenizer.pad(
                    {"input_ids": token_ids[start : start + batch_size]}, padding=True, return_tensors="pt"
                )
                batch = {k: v.to(device) for k, v in batch.items()}
                rows, prompt_length = batch["input_ids"].shape
                stopping = _stopping_option(tokenizer, stop_strings, prompt_length)
                with packed.applied(model, rows=rows) if packed is not None else nullcontext():
                    generated = generate(
                        **batch,
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id,
                        **stopping,
                    )
                texts, cuts = _decoded(generated[:, prompt_length:], tokenizer, stop_strings, end_ids)
                outputs += texts
                cut += cuts
    return outputs, cut


@contextmanager
def _generating(model: torch.nn.Module, tokenizer: Any) -> Iterator[None]:
    """``model`` in eval mode and ``tokenizer`` padding on the left for the block; both as they were after it."""
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side


def _stopping_option(tokenizer: Any, stop_strings: Sequence[str], prompt_length: int) -> dict[str, Any]:
    """``generate``'s ``stopping_criteria`` that end a row at a stop string (none without stop strings)."""
    if not stop_strings:
        return {}
    return {"stopping_criteria": StoppingCriteriaList([StopAtStrings(tokenizer, stop_strings, prompt_length)])}


def _decoded(
    new_tokens: torch.Tensor, tokenizer: Any, stop_strings: Sequence[str], end_ids: set[int]
) -> tuple[list[str], list[bool]]:
    """Texts of the generated tokens (B, T) -- cut after the first stop string -- and for each whether the length
    limit cut it (no stop string, no end-of-sequence token)."""
    texts, cut = [], []
    for row, text in zip(new_tokens.tolist(), tokenizer.batch_decode(new_tokens, skip_special_tokens=True)):
        stop = cut_at_stop(row, tokenizer, stop_strings) if stop_strings else None
        texts.append(stop.text if stop is not None else text)
        cut.append(stop is None and not any(t in end_ids for t in row))
    return texts, cut


def generate_completions(*args: Any, **kwargs: Any) -> list[str]:
    """The texts of :func:`generate_responses` (same arguments): N greedy completions, in order."""
    return generate_responses(*args, **kwargs)[0]


generate_completions.__signature__ = inspect.signature(generate_responses).replace(return_annotation="list[str]")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the model's ``generation_config.eos_token_id`` (id or list), the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def resolve_backend(backend: str = "auto") -> str:
    """Map ``"auto"`` to ``"vllm"`` when this machine can run vLLM (``trl_ext.machine.can_run``) on a CUDA GPU, else
    ``"hf"`` (vLLM's CPU build only when asked for: it reserves its own memory and KV cache); check an explicit
    choice.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        ImportError: ``"vllm"`` requested but the package is not installed.
        RuntimeError: ``"vllm"`` requested but no CUDA GPU is visible.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "vllm" if machine.can_run("vllm") and machine.cuda_available() else "hf"
    if backend == "vllm":
        machine.require("vllm", "backend='vllm'", "pass `backend='hf'`")
    return backend


def load_eval_model(
    model_args: Any, backend: str = "auto", *, gpu_memory_utilization: float = 0.85, seed: int = 0
) -> tuple[Any, Any, str]:
    """Load a model for :func:`evaluate_math` from a ``trl.ModelConfig``: ``(model, tokenizer, backend)``.

    ``"hf"``: :func:`trl_ext.models.load_model_and_tokenizer` (LoRA ignored: evaluate a merged checkpoint), moved to
    the GPU when present; ``"vllm"``: a ``vllm.LLM`` over the same checkpoint; ``"auto"``: :func:`resolve_backend`.

    Raises:
        see :func:`resolve_backend`.
    """
    # here, not at the top: trl_ext.eval (and trl_ext.cs336) load without TRL, which trl_ext.models imports
    from trl_ext.models import is_embedded, load_model_and_tokenizer, load_tokenizer, resolve_model_name_or_path

    backend = resolve_backend(backend)
    if backend == "vllm":
        from vllm import LLM

        tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
        dtype = model_args.dtype if model_args.dtype not in (None, "auto") else "auto"
        llm = LLM(
            model=resolve_model_name_or_path(model_args.model_name_or_path),
            revision=None if is_embedded(model_args.model_name_or_path) else model_args.model_revision,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enable_prefix_caching=True,
        )
        return llm, tokenizer, backend
    model, tokenizer, _ = load_model_and_tokenizer(model_args)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model, tokenizer, backend


def generate_responses_vllm(
    llm: Any,
    tokenizer: Any,
    prompts: Sequence[str | list[dict[str, str]]],
    max_new_tokens: int,
    *,
    stop_strings: Sequence[str] = (),
) -> tuple[list[str], list[bool]]:
    """Greedy completions with a ``vllm.LLM``, in order, from the same token ids as :func:`generate_completions`;
    ``stop_strings`` kept in the text. Returns ``(texts, cut)``, cut where ``finish_reason == "length"``.

    Raises:
        ValueError: when ``max_new_tokens`` < 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected >= 1")
    from vllm import SamplingParams

    stop_strings = check_stop_strings(stop_strings)
    stop = {"stop": list(stop_strings), "include_stop_str_in_output": True} if stop_strings else {}
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, **stop)
    # token ids, not text: vLLM would add its own special tokens to text (see trl_ext.data.prompt_token_ids)
    outputs = llm.generate([{"prompt_token_ids": prompt_token_ids(tokenizer, p)} for p in prompts], params)
    return [out.outputs[0].text for out in outputs], [out.outputs[0].finish_reason == "length" for out in outputs]


def generate_completions_vllm(*args: Any, **kwargs: Any) -> list[str]:
    """The texts of :func:`generate_responses_vllm` (same arguments): N greedy completions, in order."""
    return generate_responses_vllm(*args, **kwargs)[0]


generate_completions_vllm.__signature__ = inspect.signature(generate_responses_vllm).replace(
    return_annotation="list[str]"
)


def _is_vllm_engine(model: Any) -> bool:
    return type(model).__module__.split(".")[0] == "vllm"


# ----------------------------------------------------------------------------------------------------- scoring
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


NOT_EXTRACTED = "not reported: this task's grader returns its scores, not the answer it read"
"""``extracted_note`` of a record whose task does not say which answer it read (``extracted`` is then None): a
course-shaped ``--reward package.module:function``, the sort task, a task of your own without an extractor."""


def _checked_scores(
    score: Callable[[str, Mapping[str, Any]], Mapping[str, float]], response: str, row: Mapping[str, Any], i: int
) -> dict[str, float]:
    """``score(response, row)`` as floats; anything else (or a raise) is a ValueError naming row ``i``."""
    try:
        scores = score(response, row)
    except Exception as err:  # noqa: BLE001 -- whatever a scorer raises is named with its row
        detail = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"held-out row {i} (0-based): {detail}") from err
    missing = [k for k in ("reward", "format_reward", "answer_reward") if k not in (scores or {})]
    if missing:
        raise ValueError(f"the scorer returned {scores!r} for row {i}; missing keys {missing}")
    try:
        return {k: float(v) for k, v in scores.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"the scorer returned {scores!r} for row {i}; expected numbers ({err})") from None


def _summary(records: list[dict[str, Any]], num_examples: int, truncation_known: bool) -> dict[str, Any]:
    """:func:`score_rows`'s dict from its scored records."""
    format_measured = not any(math.isnan(r["format_reward"]) for r in records)
    breakdown = {  # the course's categories; a score counts as 1 when >= 0.5
        f"format{fmt}_answer{ans}": (
            sum((r["format_reward"] >= 0.5) == fmt and (r["answer_reward"] >= 0.5) == ans for r in records)
            if format_measured
            else None
        )
        for fmt in (1, 0)
        for ans in (1, 0)
    }
    unparsed = [r for r in records if r["format_reward"] < 0.5] if format_measured else []
    return {
        "accuracy": _mean([r["answer_reward"] for r in records]),
        "exact_accuracy": _mean([float(r["answer_reward"] >= 1.0) for r in records]),
        "partial_credit_rows": sum(0.0 < r["answer_reward"] < 1.0 for r in records),
        "format_rate": _mean([r["format_reward"] for r in records]),
        "reward": _mean([r["reward"] for r in records]),
        "n": len(records),
        "distinct_prompts": len({json.dumps(r["prompt"], sort_keys=True, default=str) for r in records}),
        "num_truncated": sum(r["truncated"] for r in records) if truncation_known else None,
        "breakdown": breakdown,
        "num_unparsed": len(unparsed) if format_measured else None,
        "unparsed_examples": unparsed[:num_examples],
        "examples": records[:num_examples],
        "records": records,
    }


def score_rows(
    rows: Sequence[Mapping[str, Any]],
    responses: Sequence[str],
    score: Callable[[str, Mapping[str, Any]], Mapping[str, float]],
    num_examples: int = 3,
    *,
    answer: Callable[[Mapping[str, Any]], Any] | None = None,
    extract: Callable[[str, Mapping[str, Any]], Any] | None = None,
    truncated: Sequence[bool] | None = None,
    credit_truncated: bool = True,
) -> dict[str, Any]:
    """Grade each response against its whole row and aggregate the scores (no generation, no timing).

    Args:
        rows: N held-out rows (mappings; each holds at least ``prompt``).
        responses: N responses, one per row.
        score: ``score(response, row) -> {"reward", "format_reward", "answer_reward"}`` (``trl_ext.tasks.Task.score``);
            a NaN ``format_reward`` (not measured) makes ``format_rate`` NaN and the format counts ``None``.
        num_examples: how many records to keep in ``examples`` and ``unparsed_examples``.
        answer: the row's reference answer, as recorded (default: its ``answer`` column, when it has one).
        extract: the answer the scorer read (recorded as ``extracted``); without it ``extracted`` is None and
            ``extracted_note`` is :data:`NOT_EXTRACTED`.
        truncated: per response, whether the length limit cut it (recorded as ``truncated``); None: not known.
        credit_truncated: False: a cut response's ``reward`` and ``answer_reward`` are at most 0
            (:func:`trl_ext.rewards.without_credit`). Default True.

    Returns:
        dict with ``accuracy`` (mean answer_reward), ``exact_accuracy`` (share with answer_reward 1),
        ``partial_credit_rows`` (0 < answer_reward < 1), ``format_rate``, ``reward`` (means), ``n``,
        ``distinct_prompts``, ``num_truncated`` (None when not known), ``breakdown`` (the course's counts
        ``format{1,0}_answer{1,0}``, a score >= 0.5 counting as 1), ``num_unparsed`` (format_reward < 0.5),
        ``unparsed_examples``, ``examples`` (first ``num_examples``) and ``records`` (prompt, response, answer,
        extracted answer and scores of every row).

    Raises:
        ValueError: ``rows`` and ``responses`` differ in length or are empty; ``score`` raises (kept as
            ``__cause__``) or returns no three numeric keys (the row is named).
    """
    if len(rows) != len(responses):
        raise ValueError(f"got {len(rows)} rows and {len(responses)} responses; expected one response per row")
    if len(responses) == 0:
        raise ValueError("nothing to score: expected at least one response")
    if truncated is not None and len(truncated) != len(responses):
        raise ValueError(f"got {len(truncated)} truncation flags for {len(responses)} responses; expected one each")
    records = []
    for i, (row, response) in enumerate(zip(rows, responses)):
        values = _checked_scores(score, response, row, i)
        record = {"prompt": row.get("prompt"), "response": response}
        record["answer"] = answer(row) if answer is not None else row.get("answer")
        if extract is not None:
            record["extracted"] = extract(response, row)
        else:  # what is known (the scores) and what is not: the answer the grader read
            record["extracted"], record["extracted_note"] = None, NOT_EXTRACTED
        if truncated is not None:
            record["truncated"] = bool(truncated[i])
            if truncated[i] and not credit_truncated:
                values = without_credit(values)
        records.append({**record, **values})
    return _summary(records, num_examples, truncation_known=truncated is not None)


def score_responses(
    prompts: Sequence[Any],
    responses: Sequence[str],
    answers: Sequence[str],
    reward_fn: Callable[[str, str], dict[str, float]],
    num_examples: int = 3,
    extract_fn: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """:func:`score_rows` for the course's grader shape: ``reward_fn(response, ground_truth)`` sees only the answer.

    Args:
        prompts, responses, answers: N each (prompts are only copied into the records).
        reward_fn: course-style ``reward_fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``.
        num_examples: see :func:`score_rows`.
        extract_fn: the grader's answer extraction (e.g. ``trl_ext.rewards.extract_last_number``), recorded as
            ``extracted``.

    Raises:
        ValueError: the three sequences differ in length or are empty, or as :func:`score_rows`.
    """
    if not (len(prompts) == len(responses) == len(answers)):
        raise ValueError(
            f"got {len(prompts)} prompts, {len(responses)} responses and {len(answers)} answers; expected equal counts"
        )
    rows = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    return score_rows(
        rows,
        responses,
        lambda response, row: reward_fn(response, row["answer"]),
        num_examples,
        extract=None if extract_fn is None else (lambda response, row: extract_fn(response)),
    )


def write_jsonl(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write one JSON object per line (UTF-8, non-ASCII kept); create parent directories; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return path


def evaluate_rows(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    score: Callable[[str, Mapping[str, Any]], Mapping[str, float]],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "evaluating",
    num_examples: int = 3,
    *,
    jsonl_path: str | os.PathLike | None = None,
    disable_progress: bool = False,
    answer: Callable[[Mapping[str, Any]], Any] | None = None,
    extract: Callable[[str, Mapping[str, Any]], Any] | None = None,
    stop_strings: Sequence[str] = (),
    credit_truncated: bool = True,
) -> dict[str, Any]:
    """Greedy accuracy of ``model`` on ``dataset``: one greedy response per row's ``prompt``, scored against the
    whole row (:func:`score_rows`).

    Args:
        model: a ``torch.nn.Module`` (HF ``generate``, ``batch_size`` prompts per call) or a ``vllm.LLM`` (one
            call), e.g. from :func:`load_eval_model`.
        tokenizer: the model's tokenizer (renders chat prompts, counts generated tokens).
        dataset: a ``datasets.Dataset`` or list of rows holding ``prompt`` and whatever ``score`` reads.
        score, num_examples, answer, extract, credit_truncated: as in :func:`score_rows`.
        max_new_tokens, batch_size, desc, disable_progress, stop_strings: as in :func:`generate_responses`.
        jsonl_path: when given, every record is written there (:func:`write_jsonl`).

    Returns:
        :func:`score_rows`'s dict plus ``backend`` (``"hf"`` or ``"vllm"``), ``seconds`` (generation wall time),
        ``examples_per_second``, ``generated_tokens`` (responses re-tokenized, special tokens excluded) and
        ``tokens_per_second``.

    Raises:
        ValueError: the rows lack a ``prompt`` or the dataset is empty.
    """
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError("dataset is empty; expected at least one row to evaluate")
    if "prompt" not in rows[0]:
        raise ValueError(f"dataset has columns {sorted(rows[0])}; expected a 'prompt' column")
    prompts = [row["prompt"] for row in rows]
    backend = "vllm" if _is_vllm_engine(model) else "hf"
    start = time.perf_counter()
    if backend == "vllm":
        responses, cut = generate_responses_vllm(model, tokenizer, prompts, max_new_tokens, stop_strings=stop_strings)
    else:
        responses, cut = generate_responses(
            model, tokenizer, prompts, max_new_tokens, batch_size, desc, disable_progress, stop_strings=stop_strings
        )
    seconds = time.perf_counter() - start
    result = score_rows(
        rows,
        responses,
        score,
        num_examples,
        answer=answer,
        extract=extract,
        truncated=cut,
        credit_truncated=credit_truncated,
    )
    tokens = sum(len(ids) for ids in tokenizer(responses, add_special_tokens=False)["input_ids"])
    result.update(backend=backend, seconds=seconds, examples_per_second=result["n"] / seconds, generated_tokens=tokens)
    result["tokens_per_second"] = tokens / seconds
    if jsonl_path is not None:
        write_jsonl(result["records"], jsonl_path)
    return result


def evaluate_math(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_fn: Callable[[str, str], dict[str, float]],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "evaluating",
    num_examples: int = 3,
    *,
    jsonl_path: str | os.PathLike | None = None,
    disable_progress: bool = False,
    extract_fn: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """:func:`evaluate_rows` with the course's grader shape, ``reward_fn(response, ground_truth)``, on a dataset with
    ``prompt`` and ``answer`` columns (the course's ``evaluate_vllm``).

    Raises:
        ValueError: the dataset lacks a ``prompt`` or ``answer`` column or is empty.
    """
    for column in ("prompt", "answer"):
        if column not in dataset.column_names:
            raise ValueError(f"dataset has columns {dataset.column_names}; expected a '{column}' column")
    return evaluate_rows(
        model,
        tokenizer,
        dataset,
        lambda response, row: reward_fn(response, row["answer"]),
        max_new_tokens,
        batch_size,
        desc,
        num_examples,
        jsonl_path=jsonl_path,
        disable_progress=disable_progress,
        extract=None if extract_fn is None else (lambda response, row: extract_fn(response)),
    )
