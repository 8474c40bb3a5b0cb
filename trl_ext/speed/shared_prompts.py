"""Run each distinct prompt once and let all of its completions reuse its key/value cache.

TRL 1.16 repeats each prompt in its ``num_generations`` rows; under causal attention a prompt's keys and values do not
depend on what follows, so computing them once per distinct prompt and indexing them into every row gives the same
log-probs and gradients up to rounding (CPU main job, G = 8: ~60% fewer forward/backward tokens, ~85% less prefill).
Pieces: :func:`forward_with_shared_prompts` (log-prob forward), :func:`generate_with_shared_prompts`,
:func:`savings_decision` (exact or off, per model: static checks and a small probe, with one log line saying why) and
:func:`generation_blocker` (per generate call). Under activation checkpointing (no cache) the log-prob forwards share
prompts through ``trl_ext.speed.packing.forward_in_one_sequence`` instead (``SavingsDecision.sequence``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_ext.logs import say_once
from trl_ext.quantized import bitsandbytes_modules
from trl_ext.speed.packing import canonical_order, forward_in_one_sequence, group_rows, packed_forward
from trl_ext.speed.rng import model_devices, preserved_rng, unpreservable

logger = logging.getLogger("trl_ext")

CACHED_FORWARD_BUGS = {
    "mpt": "MPT's ALiBi bias in transformers ignores the cache offset: from the second new token on, generation given "
    "a prefix cache is 0.07-0.22 logits away from the full forward",
}
"""Architectures (``config.model_type``) whose cached forward transformers computes wrongly; sharing is off there."""

ROW_INDEXED_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
"""Cache layers that can be indexed by row (``batch_select_indices``), which sharing needs; recurrent-state layers
(linear attention, state space: LFM2, Mamba2, Qwen3-Next, Falcon-H1) run the plain computation."""

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope", "su")
"""``rope_type`` values whose frequencies depend on the sequence length: dynamic-NTK (and its variants) and
LongRoPE (Phi-3 long context; ``su`` is its old name)."""

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest |log-prob difference| the probe accepts. Half precision: 5e-2 + 8 x machine epsilon x the largest |logit|
(``_tolerance``), greedy tokens not compared: it still catches crashes, dropped rows, wrong positions (several nats)."""


def _tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    if dtype in PROBE_TOLERANCE:
        return PROBE_TOLERANCE[dtype]
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1e-2
    return 5e-2 + 8 * eps * logits.float().abs().max().item()


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
    """Position of each token among its row's real tokens, (B, T) -> (B, T); 0 on padding.

    The rule of transformers' ``GenerationMixin._prepare_position_ids_for_generation`` (cumsum of the mask - 1)."""
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


def prefill_distinct(
    model: Callable,
    cache_name: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor] | None:
    """Key/value cache of each distinct row of ``input_ids`` (B, S), computed once, and which one every row is.

    Columns every row shares (``common_prefix_length``, when at least ``MIN_SHARED_POSITIONS``) run once, then the rest
    once per distinct row (``group_rows``). Differentiable: a shared key/value gets the sum of its rows' gradients.

    Returns:
        ``(cache, inverse)``: a ``transformers.Cache`` of S positions for the U distinct rows (first-appearance order)
        and ``inverse`` (B,); or None when nothing is worth sharing or the model keeps no cache."""
    first, inverse = group_rows(input_ids, attention_mask)
    distinct, rows = first.numel(), input_ids.size(0)
    common = min(common_prefix_length(input_ids, attention_mask), input_ids.size(1) - 1)
    split_common = common > 0 and distinct > 1 and (distinct - 1) * common >= MIN_SHARED_POSITIONS
    if distinct == rows and not split_common:
        return None
    ids, mask = input_ids[first], attention_mask[first]
    positions = None if position_ids is None else position_ids[first]
    if split_common:
        cache = _call(
            model,
            cache_name,
            ids[:1, :common],
            mask[:1, :common],
            None if positions is None else positions[:1, :common],
        )
        if cache is None:
            return None
        cache.batch_select_indices(torch.zeros(distinct, dtype=torch.long, device=ids.device))
        cache = _call(
            model, cache_name, ids[:, common:], mask, None if positions is None else positions[:, common:], cache
        )
    else:
        cache = _call(model, cache_name, ids, mask, positions)
    return None if cache is None else (cache, inverse)


def prefill(
    model: Callable,
    cache_name: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
):
    """:func:`prefill_distinct`'s cache indexed into all B rows (differentiably), or None."""
    found = prefill_distinct(model, cache_name, input_ids, attention_mask, position_ids)
    if found is None:
        return None
    cache, inverse = found
    if inverse.numel() > int(inverse.max()) + 1:
        cache.batch_select_indices(inverse)  # (distinct, ...) -> (B, ...)
    return cache


def forward_with_shared_prompts(
    model: Callable,
    prompt_length: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    cache_name: str = "past_key_values",
    prefill_model: Callable | None = None,
    pack: bool = False,
    **kwargs: Any,
):
    """``model(input_ids, attention_mask, position_ids, **kwargs)`` restricted to the last ``T - prompt_length + 1``
    positions, each distinct prompt's first ``prompt_length - 1`` tokens run once.

    For TRL's fused LM head call (``labels`` -100 on the prompt): per-token outputs (B, T - prompt_length), exactly the
    ``[:, -logits_to_keep:]`` slice upstream takes.

    Args:
        model: the (possibly DDP-wrapped) causal LM; runs the completion forward once.
        prefill_model: runs the prompt prefill (default ``model``); under DDP the unwrapped module, so every rank makes
            the same number of wrapped (collective) calls. Not for FSDP or ZeRO-3.
        prompt_length: P, the number of leading (left-padded) prompt columns.
        input_ids, attention_mask: (B, T).
        position_ids: (B, T) or None (the model numbers positions after the cache).
        cache_name: the model's cache argument (``cache_argument``).
        pack: run the completion forward padding-free (:func:`packed_forward`); needs ``position_ids``.
        **kwargs: passed to the completion forward; ``labels`` (B, T) is sliced like the inputs.

    Returns:
        The second forward's output, or the plain forward's when no prompt repeats or no cache comes back."""

    def plain():
        extra = {} if position_ids is None else {"position_ids": position_ids}
        return model(input_ids=input_ids, attention_mask=attention_mask, **extra, **kwargs)

    if prompt_length < 2 or prompt_length >= input_ids.size(1):
        return plain()
    split = prompt_length - 1  # the last prompt token stays in the second forward: its output scores token P
    prefix_positions = None if position_ids is None else position_ids[:, :split]
    if pack and position_ids is not None:
        # rows (and so the distinct prompts' cache) in canonical order: the same rows in any order, the same bits
        order = canonical_order(input_ids, attention_mask)
        ids, mask, positions = input_ids[order], attention_mask[order], position_ids[order]
        found = prefill_distinct(
            prefill_model or model, cache_name, ids[:, :split], mask[:, :split], positions[:, :split]
        )
        if found is None:
            return plain()
        labels = kwargs.pop("labels", None)
        return packed_forward(
            model,
            cache_name,
            *found,
            mask[:, :split],
            ids[:, split:],
            mask[:, split:],
            positions[:, split:],
            order=order,
            labels=None if labels is None else labels[order][:, split:],
            **kwargs,
        )
    cache = prefill(
        prefill_model or model, cache_name, input_ids[:, :split], attention_mask[:, :split], prefix_positions
    )
    if cache is None:
        return plain()
    if "labels" in kwargs and kwargs["labels"] is not None:
        kwargs["labels"] = kwargs["labels"][:, split:]
    extra = {} if position_ids is None else {"position_ids": position_ids[:, split:]}
    return model(
        input_ids=input_ids[:, split:], attention_mask=attention_mask, **extra, **{cache_name: cache}, **kwargs
    )


def generate_with_shared_prompts(
    generate: Callable, model: Callable, cache_name: str, use_positions: bool, *, check_model: bool = True
):
    """Wrap ``model.generate`` so each distinct prompt is prefilled once and its cache indexed into every row.

    Only text prompts; other inputs (``pixel_values``), a caller's cache or a static cache go to ``generate``
    unchanged. Prefill positions follow generation's rule when ``use_positions``, so sampling draws the same random
    numbers. With ``check_model``, :func:`savings_decision` and :func:`generation_blocker` can send a call to the
    plain ``generate`` (one log line)."""

    def wrapped(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        call = dict(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs)
        config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        model_inputs = [k for k, v in kwargs.items() if torch.is_tensor(v) or k in ("cache", "past_key_values")]
        if model_inputs or input_ids is None or attention_mask is None or input_ids.size(1) < 2:
            return generate(**call)
        blocker = generation_blocker(config, kwargs)
        if blocker is None and check_model:
            reason = savings_decision(model).share_prompts or (training_noise(model) if model.training else None)
            if reason is not None:
                announce(model, SavingsDecision(share_prompts=reason), ("prompt sharing in generation", ""))
                return generate(**call)
        if blocker is not None:
            announce(
                model,
                SavingsDecision(share_prompts=f"this generate call has {blocker}"),
                ("prompt sharing in generation", ""),
            )
            return generate(**call)
        prefix_ids, prefix_mask = input_ids[:, :-1], attention_mask[:, :-1]
        positions = position_ids_from_attention_mask(prefix_mask) if use_positions else None
        with torch.no_grad():
            cache = prefill(model, cache_name, prefix_ids, prefix_mask, positions)
        if cache is None:
            return generate(**call)
        return generate(**call, **{cache_name: cache})

    return wrapped


# -- exact or off ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavingsDecision:
    """What the speed savings may do on one model: each field is None where that saving is exact, else why it is off.

    Attributes:
        share_prompts: ``share_prompt_cache`` (and evaluation's prefix sharing).
        skip_rows: ``skip_zero_advantage_rows``.
        pack: ``pack_completions`` (padding-free completion forward over the prompt cache).
        sequence: the one-sequence forward (``forward_in_one_sequence``), used under activation checkpointing."""

    share_prompts: str | None = None
    skip_rows: str | None = None
    pack: str | None = None
    sequence: str | None = None


def _base_model(model: Any) -> Any:
    base = getattr(model, "module", model)
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def activation_checkpointing(model: Any) -> bool:
    """Whether any module of the underlying model (past DDP/PEFT) has ``gradient_checkpointing = True``
    (transformers' ``PreTrainedModel.is_activation_checkpointing`` rule)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in _base_model(model).modules())


def _configs(model: Any) -> list[Any]:
    config = getattr(_base_model(model), "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _rope_types(config: Any) -> set[str]:
    types = set()
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        values = (
            value.values() if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()) else [value]
        )
        for params in values:  # per-layer-type parameters (e.g. Gemma 3: {"full_attention": {...}, ...}) or one dict
            if isinstance(params, dict):
                types.add(str(params.get("rope_type", params.get("type", "default"))))
    return types


def _noise_sources(model: Any) -> list[str]:
    """Dropout modules with p > 0 and config fields naming a dropout or jitter rate > 0: what can make a forward
    random in training (used to word ``training_noise``'s reason)."""
    sources = [
        f"{name} p={module.p:g}"
        for name, module in _base_model(model).named_modules()
        if isinstance(module, torch.nn.Dropout) and module.p > 0
    ][:1]
    sources += [
        f"{name}.{key}={value:g}"
        for name, module in _base_model(model).named_modules()
        if not isinstance(module, torch.nn.Dropout)
        for key, value in _rate_attributes(module)
        if value > 0
    ][:1]
    for config in _configs(model):
        for key, value in vars(config).items():
            if (
                ("dropout" in key or "jitter" in key)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > 0
            ):
                sources.append(f"config.{key}={value:g}")
    return sources


def training_noise(model: Any) -> str | None:
    """Why ``model``'s training forward is random (dropout, router jitter, ...), or None.

    Measured: the probe batch runs twice in training mode without gradient, every generator put back
    (``preserved_rng``); differing outputs mean noise (config-field dropout, which TRL's ``disable_dropout`` misses,
    counts too). Cached on the model with ``_noise_signature`` and measured again only when that changes.

    Returns:
        e.g. ``"the training forward is random (config.dropout=0.1)"``; None when two training forwards agree."""
    base = _base_model(model)
    signature = _noise_signature(model)
    remembered = base.__dict__.get("_trl_ext_noise")
    if remembered is not None and remembered[0] == signature:
        return remembered[1]
    reason = _measure_training_noise(model)
    base.__dict__["_trl_ext_noise"] = (signature, reason)
    return reason


def _rate_attributes(module: torch.nn.Module) -> list[tuple[str, float]]:
    """A module's own numeric attributes naming a dropout rate (e.g. Llama's ``self_attn.attention_dropout``, read
    at every forward: setting it after the model was built changes the training forward, as a config field does
    not)."""
    return [
        (key, value)
        for key, value in vars(module).items()
        if "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]


def _noise_signature(model: Any) -> tuple:
    """What ``training_noise`` depends on: the rate of every Dropout module and every module attribute naming a
    dropout rate (in module order), and the config fields naming a dropout or jitter rate."""
    rates = tuple(
        (m.p, *_rate_attributes(m)) if isinstance(m, torch.nn.Dropout) else tuple(_rate_attributes(m))
        for m in _base_model(model).modules()
    )
    fields = tuple(
        (key, value)
        for config in _configs(model)
        for key, value in sorted(vars(config).items())
        if ("dropout" in key or "jitter" in key) and isinstance(value, (int, float))
    )
    return rates, fields


def _measure_training_noise(model: Any) -> str | None:
    try:
        parameter = next(model.parameters())
    except (StopIteration, AttributeError):
        return None
    devices = model_devices(model)
    unsaved = unpreservable(devices)
    if unsaved is not None:  # the forwards would draw from a generator that could not be put back: not run
        return f"the training forward cannot be checked for noise without drawing from {unsaved}'s generator"
    ids, mask = _probe_batch(model, parameter.device)
    was_training = model.training
    try:  # dropout draws from the global generators of every device the model computes on: all put back
        with preserved_rng(devices), torch.no_grad():
            model.train()
            first = model(input_ids=ids, attention_mask=mask).logits
            second = model(input_ids=ids, attention_mask=mask).logits
    except Exception:  # noqa: BLE001 -- the sharing probe reports a model that cannot run this batch
        return None
    finally:
        model.train(was_training)
    if torch.equal(first, second):
        return None
    sources = _noise_sources(model)
    where = "; ".join(sources) if sources else "dropout or noise in train mode"
    return (
        f"the training forward is random ({where}; disable_dropout=True keeps the saving where Dropout modules are "
        "the cause)"
    )


def _cache_layer_kinds(model: Any) -> set[str]:
    """Class names of the layers of the cache transformers builds for the model (empty where it builds none)."""
    config = getattr(_base_model(model), "config", None)
    try:
        from transformers import DynamicCache

        return {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    except Exception:  # noqa: BLE001 -- no config, or a model family without a transformers cache: the probe decides
        return set()


def static_sharing_blocker(model: Any) -> str | None:
    """Why sharing cannot be exact for ``model`` from its configuration alone, or None (``CACHED_FORWARD_BUGS``,
    ``ROW_INDEXED_CACHE_LAYERS``, ``LENGTH_DEPENDENT_ROPE``)."""
    layers = _cache_layer_kinds(model)
    other = sorted(layers - set(ROW_INDEXED_CACHE_LAYERS))
    if other:
        return (
            f"its cache has {', '.join(other)} layers (recurrent state), which cannot be indexed by row; only "
            "key/value attention caches can be shared"
        )
    for config in _configs(model):
        model_type = getattr(config, "model_type", None)
        if model_type in CACHED_FORWARD_BUGS:
            return f"{model_type}: {CACHED_FORWARD_BUGS[model_type]}"
        dependent = sorted(t for t in _rope_types(config) if t.startswith("dynamic") or t in LENGTH_DEPENDENT_ROPE)
        if dependent:
            return (
                f"rope_type {dependent[0]!r} depends on the sequence length: the prompt alone would use other "
                "rotary frequencies than the full sequence"
            )
    return None


def _quantized_sequence_blocker(model: Any) -> str | None:
    """Why the one-sequence forward is not exact with bitsandbytes layers (their CPU kernels round by the matmul's
    shape: up to 4.6e-5 apart on a 4-bit tiny Qwen2 with LoRA), or None."""
    if bitsandbytes_modules(model):
        return "bitsandbytes' quantized layers round by the matmul's shape (their CPU kernels compute in bf16)"
    return None


def static_packing_blocker(model: Any) -> str | None:
    """Why the padding-free forwards cannot be exact for ``model`` from its configuration alone, or None: they need
    sdpa attention (a custom 4D boolean mask), no layer with its own mask kind (sliding window, chunked) and plain
    key/value cache layers."""
    config = getattr(_base_model(model), "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return f"attention implementation {implementation!r} (the packed 4D mask needs 'sdpa')"
    kinds = _cache_layer_kinds(model)
    if kinds and kinds != {"DynamicLayer"}:
        return f"its cache has {', '.join(sorted(kinds - {'DynamicLayer'}))} layers (their own masks)"
    for config in _configs(model):
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"} or (not layer_types and getattr(config, "sliding_window", None)):
            return "sliding-window or chunked attention (their own masks)"
    return None


def _probe_batch(model: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows: prompt A twice and a shorter, left-padded prompt B, each followed by 3 completion tokens."""
    vocab = next(
        (getattr(c, "vocab_size", None) for c in reversed(_configs(model)) if getattr(c, "vocab_size", None)), 64
    )
    low, high = min(4, vocab - 1), vocab
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(low, high, (5,), generator=g), torch.randint(low, high, (3,), generator=g)
    completions = torch.randint(low, high, (3, 3), generator=g)
    pad = torch.full((2,), low, dtype=torch.long)
    prompts = torch.stack([a, a, torch.cat([pad, b])])
    ids = torch.cat([prompts, completions], dim=1)
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    return ids.to(device), mask.to(device)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


Reasons = tuple[str | None, str | None, str | None, str | None]


def _probe(model: Any, share_probe: bool = True, pack_probe: bool = True) -> Reasons:
    """Each saving against the plain computation on a tiny batch: the reason each is off (share, skip, pack,
    sequence)."""
    devices = model_devices(model)
    unsaved = unpreservable(devices)
    if unsaved is not None:
        return (f"the probe's forwards would draw from {unsaved}'s generator, which cannot be put back",) * 4
    with preserved_rng(devices):
        return _run_probe(model, share_probe, pack_probe)


def _packed_probe(run: Callable, plain: torch.Tensor, real: torch.Tensor, tolerance: float, what: str) -> str | None:
    """Why a padding-free forward (``run()``, its logits (B, T - 4, V)) is not the padded one on the probe batch's
    real completion positions ``real`` (B, T - 4), or None."""
    try:
        gap = (_log_probs(run().logits)[real] - plain[:, 4:][real]).abs().max().item()
    except Exception as err:  # noqa: BLE001 -- any failure means: not exact here
        return f"the {what} probe failed ({type(err).__name__}: {str(err)[:120]})"
    return None if gap <= tolerance else f"the {what} forward is {gap:.2g} away from the padded forward (probe)"


def _run_probe(model: Any, share_probe: bool, pack_probe: bool) -> Reasons:
    base = _base_model(model)
    try:
        parameter = next(model.parameters())
    except (StopIteration, AttributeError):
        return ("the model has no parameters to probe",) * 4
    ids, mask = _probe_batch(model, parameter.device)
    positions = position_ids_from_attention_mask(mask) if accepts_position_ids(model) else None
    extra = {} if positions is None else {"position_ids": positions}
    was_training = model.training
    model.eval()
    share, skip, pack, sequence = None, None, None, None
    try:
        with torch.no_grad():
            try:
                plain_logits = model(input_ids=ids, attention_mask=mask, **extra).logits
            # nothing to compare with: both savings off, the plain path decides
            except Exception as err:  # noqa: BLE001
                reason = f"the probe's plain forward failed ({type(err).__name__}: {str(err)[:120]})"
                return reason, reason, reason, reason
            tolerance = _tolerance(plain_logits.dtype, plain_logits)
            plain = _log_probs(plain_logits)
            try:  # the rows without gradient run as a batch of their own: a row must not depend on the others
                alone = _log_probs(
                    model(input_ids=ids[2:], attention_mask=mask[2:], **{k: v[2:] for k, v in extra.items()}).logits
                )
                gap = (alone[0, 2:] - plain[2, 2:]).abs().max().item()
                if not gap <= tolerance:
                    skip = f"a row's log-probs depend on the other rows of its batch (probe: {gap:.2g} apart)"
            except Exception as err:  # noqa: BLE001 -- any failure means: not exact here
                skip = f"the row-split probe failed ({type(err).__name__}: {str(err)[:120]})"
            try:
                if not share_probe:
                    return None, skip, None, None
                shared = forward_with_shared_prompts(model, 5, ids, mask, positions, cache_name=cache_argument(model))
                kept = shared.logits.size(1)  # T - 4, or T where no cache came back and the plain forward ran
                gap = (_log_probs(shared.logits) - plain[:, -kept:]).abs().max().item()
                if not gap <= tolerance:
                    share = f"the shared-prompt forward is {gap:.2g} away from the plain forward (probe)"
                elif hasattr(base, "generate"):
                    exact_tokens = plain_logits.dtype in PROBE_TOLERANCE
                    share = _probe_generation(model, ids[:, :5], mask[:, :5], tolerance, exact_tokens)
            except Exception as err:  # noqa: BLE001
                share = f"the shared-prompt probe failed ({type(err).__name__}: {str(err)[:120]})"
            if share is None and pack_probe and positions is not None:
                # row 0's completion ends a token early (right padding): only real positions are compared
                ragged = mask.clone()
                ragged[0, -1] = 0
                real = ragged[:, 4:].bool()
                pack = _packed_probe(
                    lambda: forward_with_shared_prompts(
                        model, 5, ids, ragged, positions, cache_name=cache_argument(model), pack=True
                    ),
                    plain,
                    real,
                    tolerance,
                    "packed completion",
                )
                sequence = _packed_probe(
                    lambda: forward_in_one_sequence(model, 5, ids, ragged, positions),
                    plain,
                    real,
                    tolerance,
                    "one-sequence",
                )
            elif share is None and pack_probe:
                sequence = "the model's forward takes no position_ids (the one-sequence forward numbers its tokens)"
    finally:
        model.train(was_training)
    return share, skip, pack, sequence


def _probe_generation(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, tolerance: float, exact_tokens: bool = True
) -> str | None:
    options = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None or isinstance(pad, list):
        options["pad_token_id"] = int(ids[2, 0])
    if generation_blocker(config, options) is not None:  # the model's own defaults (e.g. use_cache=False): never shared
        return None
    plain = model.generate(input_ids=ids, attention_mask=mask, **options)
    wrapped = generate_with_shared_prompts(
        model.generate, model, cache_argument(model), accepts_position_ids(model), check_model=False
    )
    shared = wrapped(input_ids=ids, attention_mask=mask, **options)
    if exact_tokens and not torch.equal(plain.sequences, shared.sequences):
        return "greedy generation with a shared prompt cache picked other tokens than without it (probe)"
    steps = len(plain.logits) if exact_tokens else 1  # in half precision a near-tie may pick another token
    gap = max(
        (_log_probs(a) - _log_probs(b)).abs().max().item() for a, b in list(zip(plain.logits, shared.logits))[:steps]
    )
    if not gap <= tolerance:
        return f"generation with a shared prompt cache is {gap:.2g} away from plain generation (probe)"
    return None


def savings_decision(model: Any) -> SavingsDecision:
    """Decide, once per model object, whether prompt sharing, packing and zero-row skipping are exact on ``model``.

    Static checks, then a probe on a 3-row batch (two rows share a prompt, one left-padded; eval mode, ~8 positions):
    shared vs plain forward and 3-token greedy generation, the padding-free forwards vs the padded one, one row alone vs
    in the batch. An exception or a difference above ``PROBE_TOLERANCE`` turns a saving off. Training noise is checked
    at use (:func:`training_noise`).

    Returns:
        ``SavingsDecision`` with the reason each saving is off (None where exact)."""
    base = _base_model(model)
    cached = base.__dict__.get("_trl_ext_savings")
    if cached is not None:
        return cached
    share = static_sharing_blocker(model)
    static_pack = static_packing_blocker(model) if share is None else None
    share_probe, skip_probe, pack_probe, sequence_probe = _probe(
        model, share_probe=share is None, pack_probe=static_pack is None
    )
    share = share or share_probe
    off = f"prompt sharing is off ({share})" if share is not None else None
    decision = SavingsDecision(
        share_prompts=share,
        skip_rows=skip_probe,
        pack=off or static_pack or pack_probe,
        sequence=off or static_pack or _quantized_sequence_blocker(model) or sequence_probe,
    )
    base.__dict__["_trl_ext_savings"] = decision
    return decision


def announce(
    model: Any,
    decision: SavingsDecision,
    names: tuple[str, ...] = ("share_prompt_cache", "skip_zero_advantage_rows", "pack_completions"),
) -> str | None:
    """Log once per model and message the savings that are off for ``model`` and why (packing only while sharing is on).

    Returns:
        The line (None when every saving is on)."""
    reasons = (decision.share_prompts, decision.skip_rows, None if decision.share_prompts else decision.pack)
    parts = [f"{name} off: {reason}" for name, reason in zip(names, reasons) if name and reason]
    if not parts:
        return None
    model_type = getattr(getattr(_base_model(model), "config", None), "model_type", type(_base_model(model)).__name__)
    line = (
        f"trl_ext speed savings on {model_type}: "
        + "; ".join(parts)
        + " (plain computation used, same numbers as upstream)"
    )
    say_once(line, key=(id(_base_model(model)), line), log=logger)
    return line


def generation_blocker(generation_config: Any, kwargs: dict[str, Any]) -> str | None:
    """Why one ``generate`` call cannot prefill shared prompts, from its options, or None (beam search, several
    sequences per prompt, a ``cache_implementation``, ``use_cache=False``, chunked prefill, assisted generation)."""

    def option(name, default=None):
        if name in kwargs:
            return kwargs[name]
        return getattr(generation_config, name, default) if generation_config is not None else default

    if (option("num_beams", 1) or 1) > 1:
        return f"num_beams={option('num_beams')}"
    if (option("num_return_sequences", 1) or 1) > 1:
        return f"num_return_sequences={option('num_return_sequences')}"
    if option("cache_implementation") is not None:
        return f"cache_implementation={option('cache_implementation')!r}"
    if option("use_cache", True) is False:
        return "use_cache=False"
    if option("prefill_chunk_size") is not None:
        return f"prefill_chunk_size={option('prefill_chunk_size')}"
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if option(name) is not None:
            return f"{name} (assisted generation)"
    return None
