"""Stop strings: a completion ends where the prompt's format ends (``</answer>`` for the R1-Zero prompt).

CS336 A5 samples with vLLM's ``SamplingParams(stop=["</answer>"], include_stop_str_in_output=True)`` (``min_tokens=4``
for rollouts); this module gives every generation path the same rule:

* :class:`StopAtStrings`: the ``StoppingCriteria`` of a transformers ``generate`` call;
* :func:`cut_at_stop`: where a generated completion ends, applied after every backend's generation;
* :func:`find_stop`: the first stop string in a text.

``min_tokens`` follows vLLM 0.30 (vllm-project/vllm#22014): stop strings are checked only past ``min_tokens`` tokens, on
the text after them. The token completing a stop string may carry more text (``">."``): it stays in the tokens and the
loss; the completion's text ends exactly at the stop string, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteria, StopStringCriteria

DEFAULT_MIN_TOKENS_WITH_STOP = 4
"""Tokens a sampled completion has at least when stop strings are set: the handout's ``sampling_min_tokens = 4``
(its rollouts: "disallow empty string responses")."""


def check_stop_strings(stop_strings: Sequence[str] | str | None, what: str = "stop_strings") -> tuple[str, ...]:
    """``stop_strings`` as a tuple of distinct non-empty strings, in order (None or empty: no stop string).

    Raises:
        ValueError: a bare string (a list of strings is expected: ``["</answer>"]``), or an entry that is not a
            non-empty string (named with ``what``).
    """
    if stop_strings is None:
        return ()
    if isinstance(stop_strings, str):
        raise ValueError(f"{what}={stop_strings!r}: expected a list of strings, e.g. [{stop_strings!r}]")
    out: list[str] = []
    for s in stop_strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{what}={list(stop_strings)!r}: every entry must be a non-empty string, got {s!r}")
        if s not in out:
            out.append(s)
    return tuple(out)


def find_stop(text: str, stop_strings: Sequence[str], after: int = 0) -> int | None:
    """The end (character index, exclusive) of the first stop string in ``text`` that ends after character
    ``after``, or None. "First" is the one that ends earliest: the one generation would have stopped at.

    Args:
        text: a completion's text.
        stop_strings: the stop strings.
        after: occurrences ending at or before this index do not count (the text of the first ``min_new_tokens``
            generated tokens, where vLLM checks no stop).
    """
    ends = []
    for stop in stop_strings:
        start = text.find(stop, max(0, after - len(stop) + 1))
        if start >= 0:
            ends.append(start + len(stop))
    return min(ends) if ends else None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    # as TRL decodes completions (batch_decode(..., skip_special_tokens=True)) and trl_ext.eval decodes responses
    return tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class StopCut:
    """Where a completion ends at a stop string: its first ``num_tokens`` tokens, whose text cut at the stop string
    is ``text`` (ending exactly with the stop string)."""

    num_tokens: int
    text: str


def cut_at_stop(
    completion_ids: Sequence[int], tokenizer: Any, stop_strings: Sequence[str], min_new_tokens: int = 0
) -> StopCut | None:
    """Where ``completion_ids`` end at the first stop string, or None when no stop string is in them.

    The token completing the first stop string (:func:`find_stop`) past the first ``min_new_tokens`` tokens' text ends
    it; its text is cut right after the stop string.

    Args:
        completion_ids: one completion's token ids (no prompt; padding or later tokens may follow).
        tokenizer: its tokenizer (decodes with ``skip_special_tokens=True``, as TRL does).
        stop_strings: the stop strings (:func:`check_stop_strings`).
        min_new_tokens: vLLM's ``min_tokens`` (0: none held back).

    Returns:
        :class:`StopCut` (``num_tokens`` >= 1), or None."""
    if not stop_strings or not completion_ids:
        return None
    ids = list(completion_ids)
    if len(ids) <= min_new_tokens:  # vLLM checks stop strings only once more than min_tokens tokens are out
        return None
    after = len(_decode(tokenizer, ids[:min_new_tokens])) if min_new_tokens > 0 else 0
    if find_stop(_decode(tokenizer, ids), stop_strings, after) is None:
        return None
    # the fewest tokens whose text holds the stop: "holds a stop" only turns true as tokens are added
    low, high = min_new_tokens + 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if find_stop(_decode(tokenizer, ids[:mid]), stop_strings, after) is None:
            low = mid + 1
        else:
            high = mid
    text = _decode(tokenizer, ids[:low])
    return StopCut(num_tokens=low, text=text[: find_stop(text, stop_strings, after)])


class StopAtStrings(StoppingCriteria):
    """Stop a row of a transformers ``generate`` call once its generated text, past ``min_new_tokens`` tokens, holds a
    stop string: transformers' ``StopStringCriteria`` (stop strings spanning tokens), confirmed on the decoded text
    (:func:`find_stop`).

    Args:
        tokenizer: the tokenizer of the model.
        stop_strings: the stop strings (:func:`check_stop_strings`).
        prompt_length: the (left-padded) prompt length of the batch: generated tokens start there.
        min_new_tokens: vLLM's ``min_tokens`` rule (no stop before more than this many generated tokens)."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], prompt_length: int, min_new_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop_strings = check_stop_strings(stop_strings)
        self.prompt_length = prompt_length
        self.min_new_tokens = min_new_tokens
        self._inner = StopStringCriteria(tokenizer, list(self.stop_strings))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids.size(1) - self.prompt_length
        done = self._inner(input_ids, scores, **kwargs)
        if generated < 1 or generated <= self.min_new_tokens or not done.any():
            return torch.zeros_like(done)
        for row in done.nonzero().flatten().tolist():
            generated_ids = input_ids[row, self.prompt_length :].tolist()
            done[row] = cut_at_stop(generated_ids, self.tokenizer, self.stop_strings, self.min_new_tokens) is not None
        return done


def ends_truncated(completion_ids: Sequence[int], end_ids: Sequence[int], stopped: bool) -> bool:
    """True when a generated completion was cut by the length limit: it did not end at a stop string, and its last
    token is not one of ``end_ids`` (EOS tokens and the pad token: TRL's rule, ``ids[-1] not in eos_and_pad``, in
    ``trl.GRPOTrainer._generate``); an empty completion counts as cut."""
    return not stopped and (not completion_ids or completion_ids[-1] not in set(end_ids))
