"""Padding-free forwards: the real tokens of a batch's rows in one sequence, a 4D attention mask letting each token see
exactly what it sees in the padded forward, at the positions generation gave it.

GRPO's log-prob forward runs each distinct prompt once and no padding, exact up to float rounding, in one of two ways:
:func:`packed_forward` (the distinct prompts' cache from ``trl_ext.speed.shared_prompts.prefill_distinct``, then the
completions' real tokens in one sequence) or :func:`forward_in_one_sequence` (prompts and completions in ONE cache-free
forward, which activation checkpointing recomputes exactly). Both need attention that reads a boolean 4D mask as is
(sdpa) and no recurrent state across rows; ``trl_ext.speed.shared_prompts.savings_decision`` decides per model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def group_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct prompts of a batch and, for every row, which one it is.

    Args:
        prompt_ids: (B, P) token ids, left-padded.
        prompt_mask: (B, P) attention mask (1 = token); two rows are the same prompt only if both ids and mask agree.

    Returns:
        ``first`` (U,) the index of each distinct prompt's first row, in order of appearance, and ``inverse`` (B,)
        the position in ``first`` of every row's prompt, so ``prompt_ids[first][inverse] == prompt_ids``.
    """
    if prompt_ids.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} differ in shape"
        )
    key = torch.cat([prompt_ids.long(), prompt_mask.long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.size(0), device=key.device)
    # first row of each distinct prompt (scatter_reduce 'amin'), then renumber in order of appearance
    first_of = torch.full((int(inverse.max()) + 1,), key.size(0), dtype=torch.long, device=key.device)
    first_of = first_of.scatter_reduce(0, inverse, rows, reduce="amin")
    order = torch.argsort(first_of)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return first_of[order], rank[inverse]


def canonical_order(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the permutation that sorts the rows of ``input_ids`` and ``attention_mask`` (B, T) lexicographically
    (ids, then mask): rows that are equal stay in their order, and any order of the same rows sorts the same.

    A packed forward runs its rows in this order, so TRL's shuffled training batch computes bit for bit what the
    generation-order batch did (a packed token's attention sums over the whole sequence's layout).
    """
    key = torch.cat([input_ids.long(), attention_mask.long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    return torch.argsort(inverse, stable=True)


def _unpack(outputs: Any, real: torch.Tensor, offset: int = 0, order: torch.Tensor | None = None):
    """The packed forward's output with every per-token tensor back in the rows' shape.

    ``real`` (B, C) marks the rows' tokens, row-major after ``offset`` tokens that are no row's; ``order`` (B,) where
    each row came from. Unshifted fields (``logits``) come back (B, C, ...), the fused head's shifted ones (B, C - 1,
    ...); zeros on padding; other values pass through.
    """
    rows_count, width = real.shape
    device = real.device
    rows = torch.arange(rows_count, device=device).unsqueeze(1).expand(rows_count, width)[real]  # (Q,)
    cols = torch.arange(width, device=device).expand(rows_count, width)[real]  # (Q,)
    q = rows.numel()
    next_real = cols[1:] > 0  # shifted fields: packed position j scores packed token j + 1, when it is of the same row
    target = rows if order is None else order[rows]  # each packed token's row in the caller's order

    def unpack(value):
        if not torch.is_tensor(value) or value.dim() < 2 or value.size(0) != 1:
            return value
        if value.size(1) == offset + q:
            return value.new_zeros((rows_count, width, *value.shape[2:])).index_put((target, cols), value[0, offset:])
        if value.size(1) == offset + q - 1:
            return value.new_zeros((rows_count, width - 1, *value.shape[2:])).index_put(
                (target[1:][next_real], cols[1:][next_real] - 1), value[0, offset:][next_real]
            )
        return value

    return type(outputs)(**{key: unpack(value) for key, value in outputs.items()})


def packed_forward(
    model: Callable,
    cache_name: str,
    cache: Any,
    inverse: torch.Tensor,
    prompt_mask: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    order: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The completion forward without its padding: every row's real tokens in one sequence (padding-free).

    The rows' real tokens form one row of Q tokens; the U distinct prompts' cache (S positions each) becomes one row
    of U x S; a 4D mask lets each token see exactly the real positions of its own prompt and its own row up to itself,
    at generation's positions, so each is the same function of the same inputs as in the padded forward.

    Args:
        model: the causal LM (sdpa attention, key/value cache layers: ``savings_decision(model).pack`` is None).
        cache_name: its cache argument (``cache_argument``).
        cache: the U distinct prompts' cache; its layers are reshaped in place to one row.
        inverse: (B,) each row's prompt (index into the cache's rows).
        prompt_mask: (B, S) the rows' prompt attention mask.
        input_ids, attention_mask, position_ids: (B, C) the completion forward's inputs -- the last prompt token and
            the completion, right-padded (mask 0 after the end).
        order: (B,) where each row came from, when the caller sorted them (``canonical_order``): the outputs go back
            to those rows.
        **kwargs: passed to the forward; ``labels`` (B, C) is packed like the inputs (TRL's fused LM head).

    Returns:
        The model's output with every per-token tensor back in the rows' shape: (B, C, ...) for unshifted fields
        (``logits``), (B, C - 1) for the fused head's shifted ones (``log_probs``, ``entropy``, ...); zeros on padding.
    """
    rows_count, width = input_ids.shape
    device = input_ids.device
    real = attention_mask.bool()
    rows = torch.arange(rows_count, device=device).unsqueeze(1).expand(rows_count, width)[real]  # (Q,)
    cols = torch.arange(width, device=device).expand(rows_count, width)[real]  # (Q,)
    distinct = int(inverse.max()) + 1
    first = torch.full((distinct,), rows_count, dtype=torch.long, device=device).scatter_reduce(
        0, inverse, torch.arange(rows_count, device=device), reduce="amin"
    )
    own_prompt = (inverse[rows].unsqueeze(1) == torch.arange(distinct, device=device)).unsqueeze(2)
    sees_prompt = own_prompt & prompt_mask[first].bool()
    sees_row = (rows.unsqueeze(1) == rows.unsqueeze(0)) & (cols.unsqueeze(0) <= cols.unsqueeze(1))
    mask = torch.cat([sees_prompt.reshape(rows.numel(), -1), sees_row], dim=1)[None, None]  # (1, 1, Q, U*S + Q)
    for layer in cache.layers:  # (U, H, S, d) -> (1, H, U*S, d): prompt u's positions at u*S .. u*S + S - 1
        layer.keys = layer.keys.transpose(0, 1).reshape(1, layer.keys.size(1), -1, layer.keys.size(-1))
        layer.values = layer.values.transpose(0, 1).reshape(1, layer.values.size(1), -1, layer.values.size(-1))
    if kwargs.get("labels") is not None:
        kwargs["labels"] = kwargs["labels"][real].unsqueeze(0)
    outputs = model(
        input_ids=input_ids[real].unsqueeze(0),
        attention_mask=mask,
        position_ids=position_ids[real].unsqueeze(0),
        **{cache_name: cache},
        **kwargs,
    )
    return _unpack(outputs, real, order=order)


def one_sequence_inputs(
    prompt_length: int, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The inputs of :func:`forward_in_one_sequence`: ``(ids (L,), positions (L,), mask (L, L) bool, N)``.

    The sequence holds each distinct prompt's real tokens of the first ``prompt_length - 1`` columns (N tokens), then
    every row's real tokens from there on (Q tokens): L = N + Q. ``mask[i, j]``: token i attends to token j, exactly
    the real keys it attends to in the padded causal forward. Positions are the given ``position_ids``.
    """
    split = prompt_length - 1
    first, inverse = group_rows(input_ids[:, :split], attention_mask[:, :split])
    prompts_real = attention_mask[first, :split].bool()  # (U, split)
    rows_real = attention_mask[:, split:].bool()  # (B, C)
    prompt_of_token, prompt_cols = prompts_real.nonzero(as_tuple=True)  # row-major: prompt after prompt
    row_of_token, row_cols = rows_real.nonzero(as_tuple=True)
    # every token's (prompt, row or -1 for a prompt token, column in the padded batch)
    prompt = torch.cat([prompt_of_token, inverse[row_of_token]])
    row = torch.cat([torch.full_like(prompt_of_token, -1), row_of_token])
    col = torch.cat([prompt_cols, row_cols + split])
    earlier = col.unsqueeze(0) <= col.unsqueeze(1)  # [i, j]: key j is at or before query i
    prompt_key = (row.unsqueeze(0) == -1) & (prompt.unsqueeze(0) == prompt.unsqueeze(1))
    own_row_key = (row.unsqueeze(0) == row.unsqueeze(1)) & (row.unsqueeze(0) >= 0)
    mask = earlier & (prompt_key | own_row_key)
    ids = torch.cat([input_ids[first, :split][prompts_real], input_ids[:, split:][rows_real]])
    positions = torch.cat([position_ids[first, :split][prompts_real], position_ids[:, split:][rows_real]])
    return ids, positions, mask, prompt_of_token.numel()


def forward_in_one_sequence(
    model: Callable,
    prompt_length: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    **kwargs: Any,
):
    """``model(input_ids, attention_mask, position_ids, **kwargs)`` restricted to the last ``T - prompt_length + 1``
    columns (as ``forward_with_shared_prompts`` returns it), in ONE padding-free, cache-free forward under a 4D mask
    (:func:`one_sequence_inputs`), rows in ``canonical_order``; activation checkpointing recomputes it exactly.

    Args:
        model: the causal LM (possibly DDP-wrapped: one call) whose attention reads a boolean 4D mask (sdpa) and has
            no mask of its own (``savings_decision(model).sequence`` is None).
        prompt_length: P, number of leading columns that are prompt (left-padded); the rest is completion.
        input_ids, attention_mask, position_ids: (B, T); ``position_ids`` as generation numbered the tokens.
        **kwargs: passed to the forward; ``labels`` (B, T) is packed like the inputs (-100 on the prompt tokens:
            TRL's fused LM head).

    Returns:
        The output with per-token tensors in the rows' shape: (B, T - P + 1, ...) for unshifted fields (``logits``),
        (B, T - P) for the fused head's shifted ones (``log_probs``, ``entropy``); zeros on padding. Where
        ``prompt_length`` leaves no prompt to share (< 2) or no completion (>= T), the plain forward's output.
    """
    if prompt_length < 2 or prompt_length >= input_ids.size(1):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    split = prompt_length - 1
    order = canonical_order(input_ids, attention_mask)  # the same rows in any order: the same sequence
    input_ids, attention_mask, position_ids = input_ids[order], attention_mask[order], position_ids[order]
    ids, positions, mask, prompt_tokens = one_sequence_inputs(prompt_length, input_ids, attention_mask, position_ids)
    real = attention_mask[:, split:].bool()
    labels = kwargs.pop("labels", None)
    if labels is not None:
        packed = torch.full_like(ids, -100)
        packed[prompt_tokens:] = labels[order][:, split:][real]
        kwargs["labels"] = packed.unsqueeze(0)
    outputs = model(
        input_ids=ids.unsqueeze(0), attention_mask=mask[None, None], position_ids=positions.unsqueeze(0), **kwargs
    )
    return _unpack(outputs, real, offset=prompt_tokens, order=order)
