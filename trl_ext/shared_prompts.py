"""Run each distinct prompt once and let all of its completions reuse its key/value cache.

GRPO samples ``num_generations`` completions of every prompt, and TRL 1.16 repeats the prompt in each of those rows:
generation prefills the same prompt G times, and the log-prob forward (and backward) runs it G times. Under causal
attention a prompt's keys and values do not depend on what follows, so computing them once per distinct prompt and
indexing them into every row gives the same log-probs and the same gradients (the gradient of a shared key/value is
the sum over its rows, which autograd forms through the index), up to float rounding. On the CPU main job (47 prompt
+ 20 completion tokens, G = 8) this removes ~60% of the forward/backward tokens and ~85% of the prefill.

Both helpers fall back to the plain call when nothing is shared (every prompt distinct, a one-token prompt) or the
model returns no cache (e.g. gradient checkpointing turns ``use_cache`` off).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

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
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} differ in shape")
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


def _forward_parameters(model: Any):
    """Parameters of the underlying model's ``forward``, past a DDP/accelerate wrapper (``module``) and PEFT."""
    base = getattr(model, "module", model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    return inspect.signature(base.forward).parameters


def cache_argument(model: Any) -> str:
    """Name of the key/value cache argument of ``model.forward``: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier releases; later ones still accept it with a deprecation warning)."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


def accepts_position_ids(model: Any) -> bool:
    """Whether the underlying model's forward takes ``position_ids``."""
    return "position_ids" in _forward_parameters(model)


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row, (B, T) -> (B, T); 0 on padding.

    The rule of transformers' ``GenerationMixin._prepare_position_ids_for_generation`` (cumsum of the mask - 1), so a
    left-padded prompt gets the positions it has alone and in generation.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def common_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Number of leading columns on which every row of ``input_ids`` and ``attention_mask`` (B, S) agrees."""
    same = ((input_ids == input_ids[:1]) & (attention_mask == attention_mask[:1])).all(dim=0)  # (S,)
    return int(same.long().cumprod(0).sum())


# A separate forward for the prefix every prompt shares (a system prompt) is worth its fixed cost (~30 small kernels
# per layer) only when it saves at least this many token positions.
MIN_SHARED_POSITIONS = 64


def _call(model: Callable, cache_name: str, input_ids, attention_mask, position_ids, cache=None):
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True, "logits_to_keep": 1}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if cache is not None:
        inputs[cache_name] = cache
    outputs = model(**inputs)  # the prefix's logits are not needed: keep one position
    cache = getattr(outputs, "cache", None) if cache_name == "cache" else getattr(outputs, "past_key_values", None)
    return cache if hasattr(cache, "batch_select_indices") else None


def prefill(
    model: Callable, cache_name: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
):
    """Key/value cache of ``input_ids`` (B, S) computed once per distinct row, indexed into every row.

    Two levels: the columns every row shares (``common_prefix_length``, e.g. a system prompt; used when it saves at
    least ``MIN_SHARED_POSITIONS`` positions) run for one row, then the rest for each distinct row
    (``group_rows``). Differentiable: called with gradients enabled, each shared key/value receives the sum of its
    rows' gradients.

    Returns:
        A ``transformers.Cache`` holding S positions for all B rows, or None when no row repeats and no prefix is
        worth sharing, or the model keeps no cache (then the caller runs the plain forward).
    """
    first, inverse = group_rows(input_ids, attention_mask)
    distinct, rows = first.numel(), input_ids.size(0)
    common = min(common_prefix_length(input_ids, attention_mask), input_ids.size(1) - 1)
    split_common = common > 0 and distinct > 1 and (distinct - 1) * common >= MIN_SHARED_POSITIONS
    if distinct == rows and not split_common:
        return None
    ids, mask = input_ids[first], attention_mask[first]
    positions = None if position_ids is None else position_ids[first]
    if split_common:
        cache = _call(model, cache_name, ids[:1, :common], mask[:1, :common], None if positions is None else positions[:1, :common])
        if cache is None:
            return None
        cache.batch_select_indices(torch.zeros(distinct, dtype=torch.long, device=ids.device))
        cache = _call(model, cache_name, ids[:, common:], mask, None if positions is None else positions[:, common:], cache)
    else:
        cache = _call(model, cache_name, ids, mask, positions)
    if cache is not None and distinct < rows:
        cache.batch_select_indices(inverse)  # (distinct, ...) -> (B, ...); differentiable indexing
    return cache


def forward_with_shared_prompts(
    model: Callable, prompt_length: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None, *, cache_name: str = "past_key_values", prefill_model: Callable | None = None,
    **kwargs: Any,
):
    """``model(input_ids, attention_mask, position_ids, **kwargs)`` restricted to what the last ``T - prompt_length
    + 1`` positions produce, with each distinct prompt's first ``prompt_length - 1`` tokens run once.

    Used for TRL's fused LM head call (``labels`` -100 on the prompt, ``fused_lm_head=True``): the second forward
    gets the last prompt token plus the completion, so its per-token outputs are the log-probs (and entropies) of the
    completion tokens, shape (B, T - prompt_length), i.e. exactly the ``[:, -logits_to_keep:]`` slice upstream takes.

    Args:
        model: the (possibly DDP-wrapped) causal LM; runs the completion forward, once, as the plain call would.
        prefill_model: what runs the prompt prefill (default ``model``). Under DDP pass the unwrapped module: DDP's
            forward broadcasts buffers, a collective, so every rank must make the same number of wrapped calls,
            whatever its prompts; gradients through the unwrapped prefill still reach DDP's hooks (autograd sums both
            paths into each parameter before its hook fires). Not for parameter-sharding setups (FSDP, ZeRO-3),
            whose every forward gathers parameters collectively.
        prompt_length: P, number of leading columns that are prompt (left-padded); the rest is completion.
        input_ids, attention_mask: (B, T).
        position_ids: (B, T) or None (the model then numbers positions after the cache).
        cache_name: the model's cache argument (``cache_argument``).
        **kwargs: passed to the completion forward; ``labels`` (B, T) is sliced like the inputs.

    Returns:
        The second forward's output, or the plain full forward's when no prompt repeats or no cache comes back.
    """
    def plain():
        extra = {} if position_ids is None else {"position_ids": position_ids}
        return model(input_ids=input_ids, attention_mask=attention_mask, **extra, **kwargs)

    if prompt_length < 2 or prompt_length >= input_ids.size(1):
        return plain()
    split = prompt_length - 1  # the last prompt token stays in the second forward: its output scores token P
    prefix_positions = None if position_ids is None else position_ids[:, :split]
    cache = prefill(prefill_model or model, cache_name, input_ids[:, :split], attention_mask[:, :split], prefix_positions)
    if cache is None:
        return plain()
    if "labels" in kwargs and kwargs["labels"] is not None:
        kwargs["labels"] = kwargs["labels"][:, split:]
    extra = {} if position_ids is None else {"position_ids": position_ids[:, split:]}
    return model(input_ids=input_ids[:, split:], attention_mask=attention_mask, **extra, **{cache_name: cache}, **kwargs)


def generate_with_shared_prompts(generate: Callable, model: Callable, cache_name: str, use_positions: bool):
    """Wrap ``model.generate`` so each distinct prompt is prefilled once and its cache indexed into every row.

    Only text prompts are handled (``input_ids``, ``attention_mask``, ``generation_config`` and generation options
    such as ``max_new_tokens``); other model inputs (tensors such as ``pixel_values``), a cache of the caller's or a
    static cache go to ``generate`` unchanged. Prefill positions follow generation's
    rule (cumsum of the mask - 1) when ``use_positions``; generation then continues from the last prompt token, so
    sampling draws the same random numbers in the same order as without the cache.
    """
    def wrapped(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        call = dict(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs)
        config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        cache_impl = getattr(config, "cache_implementation", None)  # e.g. a model whose defaults ask for a static cache
        model_inputs = [k for k, v in kwargs.items() if torch.is_tensor(v) or k in ("cache", "past_key_values", "cache_implementation")]
        if (
            model_inputs or input_ids is None or attention_mask is None or input_ids.size(1) < 2
            or cache_impl not in (None, "dynamic")
        ):
            return generate(**call)
        prefix_ids, prefix_mask = input_ids[:, :-1], attention_mask[:, :-1]
        positions = position_ids_from_attention_mask(prefix_mask) if use_positions else None
        with torch.no_grad():
            cache = prefill(model, cache_name, prefix_ids, prefix_mask, positions)
        if cache is None:
            return generate(**call)
        return generate(**call, **{cache_name: cache})

    return wrapped
