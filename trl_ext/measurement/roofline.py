"""How close each phase of a run comes to what the machine allows: a roofline report.

Each phase's measured seconds stand beside its floor, ``max(FLOPs / matmul peak, bytes / memory bandwidth)``, with
peak and bandwidth measured in the run (:func:`measure_peaks`), the peak in each dtype a phase computed in (bf16
autocast's differs from fp32's by up to 30 x on AMX). ``ratio = seconds / floor`` (1 = at the roofline); on CUDA the
same numbers read as MFU. A phase not timed, or under its floor, is listed under ``omitted`` (:func:`roofline_report`).

The work is counted from every forward's inputs by :class:`WorkCounter` (Williams et al. 2009, "Roofline"; Kaplan et
al. 2020, 2 FLOPs per parameter and token):

* matmul FLOPs ``2 x P_body x T + 2 x P_head x T_head`` (every ``nn.Linear``/GPT-2 ``Conv1D`` but the head, LoRA
  included; ``T_head`` the tokens whose logits are computed);
* attention FLOPs ``4 x layers x heads x head_dim`` per (query, key) pair the mask allows (causal with padding
  without a 4D mask); bytes: every weight once per call plus each layer's keys and values once per row;
* a backward, matmul by matmul as it runs (:func:`matmul_backward_work`): LoRA over a frozen base ~1 x the forward,
  full fine-tuning 2 x; gradient checkpointing's re-run forward counts into the backward;
* an optimizer step (AdamW with clipping): 9 x the trainable weights' bytes and 14 FLOPs a weight.

Floors, not predictions: activations, softmax, norms and the sampling loop are not counted.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

PHASES = (
    "evaluation",
    "generation_prefill",
    "generation_decode",
    "logprob_forward",
    "forward",
    "backward",
    "optimizer",
)
"""The report's rows, in order (:meth:`WorkCounter.bucket`)."""

logger = logging.getLogger("trl_ext")

OPTIMIZER_BYTES_PER_WEIGHT_BYTE = 9
OPTIMIZER_FLOPS_PER_WEIGHT = 14


# ------------------------------------------------------------------------------------------------ the machine
@dataclass
class MachinePeaks:
    """What this machine did in a short measurement: the best matmul FLOP/s and copy bandwidth seen.

    Attributes:
        device: ``"cpu"`` or ``"cuda:0"``...
        dtype: the matmul dtype measured (the model's compute dtype).
        matmul_flops_per_s: best ``2 n^3 / seconds`` of an ``n x n`` matmul.
        bandwidth_bytes_per_s: best ``2 x bytes / seconds`` of a large tensor copy (read + write).
        threads: ``torch.get_num_threads()`` during the measurement (CPU).
        seconds: how long the measurement took.
    """

    device: str
    dtype: str
    matmul_flops_per_s: float
    bandwidth_bytes_per_s: float
    threads: int
    seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(work: float, run: Callable[[], Any], device: torch.device, budget_s: float) -> float:
    """``work`` / the fastest of repeated ``run()`` calls within ``budget_s`` (one warm-up call first)."""
    run()
    _sync(device)
    best, spent = float("inf"), 0.0
    while spent < budget_s or best == float("inf"):
        start = time.perf_counter()
        run()
        _sync(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return work / best


def _matmul_rate(n: int, device: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    # operands from a private generator on the device: the run's own random numbers stay untouched (trl_ext.speed.rng)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    return _best_rate(2.0 * n**3, lambda: torch.mm(a, b), device, budget_s)


def _copy_rate(size: int, device: torch.device, budget_s: float) -> float:
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_rate(2.0 * src.numel() * 4, lambda: dst.copy_(src), device, budget_s)


def measure_matmul_peak(
    device: str | torch.device, dtype: torch.dtype, budget_s: float = 1.0, matmul_size: int | None = None
) -> float:
    """The best FLOP/s of an ``n x n`` matmul in ``dtype`` on ``device`` within ``budget_s`` seconds (``n`` default
    1024 on CPU, 8192 on CUDA)."""
    device = torch.device(device)
    n = matmul_size or (8192 if device.type == "cuda" else 1024)
    return _matmul_rate(n, device, dtype, budget_s)


def measure_peaks(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    budget_s: float = 1.0,
    matmul_size: int | None = None,
    copy_bytes: int | None = None,
) -> MachinePeaks:
    """Measure the matmul peak (:func:`measure_matmul_peak`) and the copy bandwidth of ``device`` now, as
    :class:`MachinePeaks`: ``budget_s`` seconds each, best repetition kept; ``copy_bytes`` default 256 MiB on CPU,
    1 GiB on CUDA (beyond every cache)."""
    device = torch.device(device)
    start = time.perf_counter()
    flops = measure_matmul_peak(device, dtype, budget_s, matmul_size)
    size = copy_bytes or (2**30 if device.type == "cuda" else 2**28)
    bandwidth = _copy_rate(size, device, budget_s)
    return MachinePeaks(
        device=str(device),
        dtype=_dtype_name(dtype),
        matmul_flops_per_s=flops,
        bandwidth_bytes_per_s=bandwidth,
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - start,
    )


# ------------------------------------------------------------------------------------------------- the work
@dataclass
class Work:
    """FLOPs and bytes of one phase's work, and the seconds its forwards took (hook-timed)."""

    flops: float = 0.0
    bytes: float = 0.0
    forward_seconds: float = 0.0
    calls: int = 0
    tokens: int = 0

    def add(self, other: Work) -> None:
        self.flops += other.flops
        self.bytes += other.bytes
        self.forward_seconds += other.forward_seconds
        self.calls += other.calls
        self.tokens += other.tokens


def matmul_size(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` (bitsandbytes' and LoRA's included) or GPT-2's ``Conv1D``,
    else None; read from attributes, not the weight (a sharded weight may be empty)."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nx") and hasattr(module, "nf"):
        return int(module.nx), int(module.nf)
    return None


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP / accelerate wrappers
    return model


def _saved_copies(model: torch.nn.Module) -> set[int]:
    """Modules inside PEFT's ``modules_to_save`` copies (only the original's weights count)."""
    return {
        id(inner)
        for module in model.modules()
        if hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None), torch.nn.Module)
        for inner in module.modules_to_save.modules()
    }


def matmul_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``model`` that is one matmul (:func:`matmul_size`), PEFT's ``modules_to_save`` copies left
    out."""
    copies = _saved_copies(model)
    return [m for m in model.modules() if id(m) not in copies and matmul_size(m) is not None]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One module per attention layer: the outermost whose class name ends in ``Attention`` (a hybrid model's other
    mixers are not), PEFT's ``modules_to_save`` copies left out."""
    copies, found, inside = _saved_copies(model), [], set()
    for module in model.modules():
        if id(module) in inside or id(module) in copies or not type(module).__name__.endswith("Attention"):
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    return found


@dataclass
class ModelShape:
    """What the counts need to know of a causal LM: its weights by role, and its attention's size.

    Attributes:
        body_weights: elements of every matmul's weight (:func:`matmul_modules`) but the output head's.
        head_weights: elements of the output head (``get_output_embeddings()``; tied or not, it is a matmul).
        trainable_weights: elements of the parameters with ``requires_grad`` when the shape was read (what the
            optimizer touches: the adapters only under LoRA).
        element_bytes: bytes per weight element (the weights' dtype).
        layers: attention layers (:func:`attention_modules`; the config's ``num_hidden_layers`` when none is found).
        heads, head_dim, kv_heads: the attention's shape, from the config.
    """

    body_weights: int
    head_weights: int
    trainable_weights: int
    element_bytes: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of ``model`` now (a PEFT or DDP wrapper is looked through)."""
        base = _unwrap(model)
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        body = 0
        for module in matmul_modules(base):
            if id(module.weight) not in head_ids:
                size = matmul_size(module)
                body += size[0] * size[1]
        head_size = matmul_size(head) if head is not None else None
        head_weights = (
            head_size[0] * head_size[1]
            if head_size
            else (head.weight.numel() if head is not None and hasattr(head, "weight") else 0)
        )
        config = getattr(base, "config", None)
        text = getattr(config, "text_config", None) or config
        heads = getattr(text, "num_attention_heads", 0) or 0
        hidden = getattr(text, "hidden_size", 0) or 0
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
        parameter = next(base.parameters())
        return cls(
            body_weights=body,
            head_weights=head_weights,
            trainable_weights=sum(p.numel() for p in base.parameters() if p.requires_grad),
            element_bytes=parameter.element_size(),
            layers=len(attention_modules(base)) or getattr(text, "num_hidden_layers", 0) or 0,
            heads=heads,
            head_dim=head_dim,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        )


def attention_flops(shape: ModelShape, pairs: float) -> float:
    """Forward FLOPs of one attention layer over ``pairs`` (query, key) pairs: ``4 x heads x head_dim`` a pair (the
    scores ``Q K^T`` and the weighted values ``P V``, 2 FLOPs a multiply-add each)."""
    return 4.0 * shape.heads * shape.head_dim * pairs


def forward_work(
    shape: ModelShape, rows: int, new: int, past: int, head_tokens: int, attention_pairs: int | None = None
) -> Work:
    """The :class:`Work` of one forward (counts in the module docstring) of ``rows`` x ``new`` tokens over ``past``
    cached ones, ``head_tokens`` projected by the head; ``attention_pairs`` None = causal, ``rows x new x (past +
    (new + 1) / 2)``."""
    tokens = rows * new
    pairs = rows * new * (past + (new + 1) / 2) if attention_pairs is None else attention_pairs
    flops = 2.0 * shape.body_weights * tokens + 2.0 * shape.head_weights * head_tokens
    flops += shape.layers * attention_flops(shape, pairs)
    weight_bytes = (shape.body_weights + shape.head_weights) * shape.element_bytes
    kv_bytes = 2.0 * shape.layers * shape.kv_heads * shape.head_dim * rows * (past + new) * shape.element_bytes
    return Work(flops=flops, bytes=weight_bytes + kv_bytes, calls=1, tokens=tokens)


def matmul_backward_work(
    flops: float, weight_bytes: float, input_requires_grad: bool, weight_requires_grad: bool
) -> Work:
    """The backward of one matmul of ``flops`` over ``weight_bytes``: the input's gradient (``flops``, the weight read
    again) when it requires grad, the weight's (``flops``, the gradient read and written) when it does."""
    return Work(
        flops=flops * (int(input_requires_grad) + int(weight_requires_grad)),
        bytes=weight_bytes * (int(input_requires_grad) + 2 * int(weight_requires_grad)),
    )


def optimizer_work(shape: ModelShape, steps: int) -> Work:
    """``steps`` AdamW steps with gradient clipping over the trainable weights (see the module docstring)."""
    per_step = shape.trainable_weights
    return Work(
        flops=float(OPTIMIZER_FLOPS_PER_WEIGHT * per_step * steps),
        bytes=float(OPTIMIZER_BYTES_PER_WEIGHT_BYTE * per_step * shape.element_bytes * steps),
        calls=steps,
    )


def _past_length(kwargs: Mapping[str, Any]) -> int:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.2x names it `cache`
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 -- a legacy or recurrent cache: count no past
        return 0


def _attention_pairs(mask: Any) -> int | None:
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return int(allowed.sum())
    return None


def _anchor(output: Any) -> torch.Tensor | None:
    """The output every backward through a forward passes: logits, TRL's fused log-probs, or the first tensor."""
    for name in ("logits", "log_probs"):
        tensor = getattr(output, name, None)
        if isinstance(tensor, torch.Tensor):
            return tensor
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple"):
        items = output.to_tuple() if hasattr(output, "to_tuple") else output
        return next((item for item in items if isinstance(item, torch.Tensor)), None)
    return None


def fused_head_positions(kwargs: Mapping[str, Any], rows: int, new: int, device: torch.device) -> int | None:
    """Positions TRL 1.16's fused LM head (``fused_lm_head=True``) projects, None for any other forward: the labelled
    ones where its Triton kernel runs (CUDA, XPU), every position elsewhere."""
    if not kwargs.get("fused_lm_head"):
        return None
    shifted = kwargs.get("shift_labels")
    labels = shifted if shifted is not None else kwargs.get("labels")
    if labels is None:
        return rows * max(new - 1, 0)
    labels = labels if shifted is not None else labels[:, 1:]
    try:
        from trl.kernels.chunked_logprob import _use_triton  # TRL 1.16's own choice of kernel

        compact = _use_triton(device)
    except Exception:  # noqa: BLE001 -- another TRL: the torch path, every position
        compact = False
    return int((labels != -100).sum()) if compact else int(labels.numel())


TIMED_BY_HOOK = ("generation_prefill", "forward")
"""Buckets timed by the forward's own hook (the rest by the run's timer); on CUDA only these synchronize."""


class WorkCounter:
    """Counts the work of every forward of ``model`` into the bucket of the phase it runs in, and the work of every
    backward through it as it runs.

    Forwards are counted by a hook on ``model`` (:func:`forward_work`). While gradients may flow, each matmul and
    attention module is hooked too, and a gradient hook on its output counts its backward when reached, so frozen
    weights, LoRA and forwards never backpropagated count as they run; a module running outside the model's forward
    is gradient checkpointing's re-run, counted into the backward. TRL's fused LM head is counted at the model's
    output (:func:`fused_head_positions`).

    Args:
        model: the causal LM (hooks go on this module; pass the trainer's model or the one evaluated).
        current_phase: returns the innermost running phase of the run's timer (``PhaseTimer.current``).

    Attributes:
        work: bucket name (:data:`PHASES`) -> :class:`Work`.
    """

    def __init__(self, model: Any, current_phase: Callable[[], str | None]):
        self.model = model
        self.shape = ModelShape.of(model)
        self.current_phase = current_phase
        self.work: dict[str, Work] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # bucket -> the dtype its matmuls ran in (autocast's, else weights')
        self._started: list[tuple[float, Work, str, bool, float, int | None, torch.dtype] | None] = []
        self._depth = 0  # forwards of the model running now
        self._pending = 0  # forwards with gradients whose backward has not run (nor will: their output was freed)
        self._module_handles: list[Any] = []  # per-module hooks, on while gradients may flow
        self._attention: list[torch.nn.Module] = []
        self._attention_per_layer: dict[tuple[int, int], float] = {}  # (rows, tokens) -> one layer's forward FLOPs
        self._other_gradient_bytes = 0.0  # gradients of trainable parameters outside the matmuls (norms, embeddings)
        self._hidden_requires_grad = True  # the backbone's last output, for the fused head's backward
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._cuda = self.device.type == "cuda"
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),  # even when it raises
        ]

    def remove(self) -> None:
        """Detach the hooks."""
        self._remove_module_hooks()
        for handle in self._handles:
            handle.remove()

    def refresh(self) -> None:
        """Read the model's shape again: adapters injected (PEFT), parameters frozen or unfrozen since."""
        self.shape = ModelShape.of(self.model)
        self._remove_module_hooks()

    def covers(self, model: Any) -> bool:
        """Whether ``model`` is this counter's model, holds it (a PEFT or DDP wrapper) or is held by it: its forwards
        are this counter's forwards."""
        mine, other = _unwrap(self.model), _unwrap(model)
        return other is mine or any(m is mine for m in other.modules()) or any(m is other for m in mine.modules())

    def bucket(self, new_tokens: int) -> str:
        """The bucket of a forward of ``new_tokens`` per row: the running phase (``generation`` split into prefill, > 1
        token, and decode), ``forward`` outside the timed phases (e.g. SFT's training forward)."""
        phase = self.current_phase()
        if phase == "generation":
            return "generation_prefill" if new_tokens > 1 else "generation_decode"
        if phase in ("evaluation", "logprob_forward"):
            return phase
        return "forward"

    # ------------------------------------------------------------------------------ the model's own forward
    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._depth += 1
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            self._started.append(None)  # nothing to count; its _after pops this
            return
        rows, new = int(ids.shape[0]), int(ids.shape[1])
        keep = kwargs.get("logits_to_keep", 0)
        head_rows = (
            new
            if isinstance(keep, int) and (keep == 0 or keep > new)
            else (keep if isinstance(keep, int) else int(torch.as_tensor(keep).numel()))
        )
        fused = fused_head_positions(kwargs, rows, new, self.device)
        past, pairs = _past_length(kwargs), _attention_pairs(kwargs.get("attention_mask"))
        pairs = rows * new * (past + (new + 1) / 2) if pairs is None else pairs
        work = forward_work(self.shape, rows, new, past, rows * head_rows if fused is None else fused, pairs)
        grad = torch.is_grad_enabled()
        if self._depth == 1:  # the outermost forward
            if grad:
                self._add_module_hooks()
                self._attention_per_layer[(rows, new)] = attention_flops(self.shape, pairs)
            elif self._pending == 0:
                self._remove_module_hooks()  # inference, and every backward has run: no per-module hooks
        bucket = self.bucket(new)
        if self._cuda and bucket in TIMED_BY_HOOK:  # only these forwards' own seconds are read: no sync per token
            torch.cuda.synchronize()
        attention = self.shape.layers * attention_flops(self.shape, pairs)
        device = self.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.dtype
        self._started.append((time.perf_counter(), work, bucket, grad, attention, fused, dtype))

    def _after(self, module, args, kwargs, output):
        if not self._started:
            return
        self._depth -= 1
        started = self._started.pop()
        if started is None:
            return
        start, work, bucket, grad, attention, fused, dtype = started
        if self._cuda and bucket in TIMED_BY_HOOK:
            torch.cuda.synchronize()
        work.forward_seconds = time.perf_counter() - start
        self.work.setdefault(bucket, Work()).add(work)
        self._note_dtype(bucket, dtype)
        anchor = _anchor(output)
        if not (grad and anchor is not None and anchor.requires_grad):
            return
        # one backward through this forward, counted when it runs: what no module hook sees -- the gradients of the
        # other trainable parameters, every layer's attention in a model whose attention modules are not found, TRL's
        # fused head (its logits recomputed, then the hidden states' and the weight's gradients)
        backward = Work(flops=0.0 if self._attention else 2.0 * attention, bytes=self._other_gradient_bytes, calls=1)
        backward.tokens = work.tokens
        if fused:
            head = _unwrap(self.model).get_output_embeddings()
            head_bytes = self.shape.head_weights * self.shape.element_bytes
            backward.add(Work(flops=2.0 * fused * self.shape.head_weights, bytes=head_bytes))
            backward.add(
                matmul_backward_work(
                    2.0 * fused * self.shape.head_weights,
                    head_bytes,
                    self._hidden_requires_grad,
                    head is not None and head.weight.requires_grad,
                )
            )
        done = [False]

        def settle(*_):
            if not done[0]:
                done[0] = True
                self._pending -= 1

        def on_gradient(grad_output):
            settle()
            self._add_backward(backward)

        self._pending += 1
        self._note_dtype("backward", dtype)  # autocast's dtype holds for the backward of what ran under it
        anchor.register_hook(on_gradient)
        weakref.finalize(anchor, settle)  # never backpropagated and freed: nothing pending

    # ------------------------------------------------------------------------------ per-module hooks
    def _add_module_hooks(self) -> None:
        if self._module_handles:
            return
        base = _unwrap(self.model)
        matmuls = matmul_modules(base)
        self._attention = attention_modules(base)
        in_matmuls = {id(m.weight) for m in matmuls}
        self._other_gradient_bytes = 2.0 * sum(
            p.numel() * p.element_size() for p in base.parameters() if p.requires_grad and id(p) not in in_matmuls
        )
        self._module_handles = [m.register_forward_hook(self._on_matmul) for m in matmuls]
        self._module_handles += [m.register_forward_hook(self._on_attention, with_kwargs=True) for m in self._attention]
        model = base.get_base_model() if hasattr(base, "get_base_model") else base  # PEFT: the transformers model
        backbone = getattr(model, "base_model", None)  # what TRL's fused head runs before projecting
        if isinstance(backbone, torch.nn.Module) and backbone is not model:
            self._module_handles.append(backbone.register_forward_hook(self._on_backbone))

    def _remove_module_hooks(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        self._attention_per_layer.clear()

    def _note_dtype(self, bucket: str, dtype: torch.dtype) -> None:
        # a bucket whose forwards ran in several dtypes: the narrowest (fastest) one, so its floor stays a floor
        seen = self.dtypes.get(bucket)
        if seen is None or dtype.itemsize < seen.itemsize:
            self.dtypes[bucket] = dtype

    def _add_backward(self, work: Work) -> None:
        self.work.setdefault("backward", Work()).add(work)

    def _on_backbone(self, module, args, output):
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if isinstance(hidden, torch.Tensor) else _anchor(output)
        if hidden is not None and self._depth > 0:
            self._hidden_requires_grad = hidden.requires_grad

    def _on_matmul(self, module, args, output):
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        size = matmul_size(module)
        flops = 2.0 * (args[0].numel() // size[0]) * size[0] * size[1]
        weight_bytes = float(size[0] * size[1] * module.weight.element_size())
        if self._depth == 0:  # outside the model's forward: gradient checkpointing re-running it in the backward
            self._add_backward(Work(flops=flops, bytes=weight_bytes))
        if output.requires_grad:
            backward = matmul_backward_work(flops, weight_bytes, args[0].requires_grad, module.weight.requires_grad)
            output.register_hook(lambda grad_output: self._add_backward(backward))

    def _on_attention(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(hidden, torch.Tensor) or not isinstance(out, torch.Tensor) or hidden.dim() < 2:
            return
        key = (int(hidden.shape[0]), int(hidden.shape[1]))
        per_layer = self._attention_per_layer.get(key)
        if per_layer is None:  # not the shape of a forward seen with gradients: causal, no past
            per_layer = attention_flops(self.shape, key[0] * key[1] * (key[1] + 1) / 2)
        if self._depth == 0:  # re-run by gradient checkpointing inside the backward
            self._add_backward(Work(flops=per_layer))
        if out.requires_grad:  # the scores' and the values' gradients, then the queries', keys' and values'
            out.register_hook(lambda grad_output: self._add_backward(Work(flops=2.0 * per_layer)))


# ------------------------------------------------------------------------------------------------- the report
@dataclass
class PhaseRoofline:
    """One row of the report."""

    seconds: float
    flops: float
    bytes: float
    floor_seconds: float
    ratio: float | None
    bound: str
    flops_utilization: float | None
    bandwidth_utilization: float | None
    calls: int = 0
    tokens: int = 0
    dtype: str = ""


def phase_roofline(seconds: float, work: Work, peaks: MachinePeaks) -> PhaseRoofline:
    """``floor = max(flops / peak, bytes / bandwidth)``, ``ratio = seconds / floor``, and the fraction of each peak
    achieved (MFU on a GPU), for a phase's measured ``seconds`` and counted ``work``."""
    compute = work.flops / peaks.matmul_flops_per_s
    memory = work.bytes / peaks.bandwidth_bytes_per_s
    floor = max(compute, memory)
    return PhaseRoofline(
        seconds=seconds,
        flops=work.flops,
        bytes=work.bytes,
        floor_seconds=floor,
        ratio=seconds / floor if floor > 0 else None,
        bound="compute" if compute >= memory else "memory",
        flops_utilization=work.flops / seconds / peaks.matmul_flops_per_s if seconds > 0 else None,
        bandwidth_utilization=work.bytes / seconds / peaks.bandwidth_bytes_per_s if seconds > 0 else None,
        calls=work.calls,
        tokens=work.tokens,
        dtype=peaks.dtype,
    )


def roofline_report(
    phase_seconds: Mapping[str, float],
    work: Mapping[str, Work],
    peaks: MachinePeaks,
    optimizer_steps: int = 0,
    shape: ModelShape | None = None,
    dtypes: Mapping[str, str] | None = None,
    matmul_peaks: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The report: the machine's peaks and one :class:`PhaseRoofline` per phase that ran and was timed.

    Seconds per phase: ``evaluation``, ``logprob_forward``, ``backward``, ``optimizer`` from the run's timer
    (``phase_seconds``); ``generation_prefill`` the hook-timed prefill forwards of ``generation``,
    ``generation_decode`` the rest of ``generation`` (the decode forwards and the sampling loop around them);
    ``forward`` the hook-timed forwards outside those phases (SFT, DPO and reward models' training forwards).

    A phase with counted work but no seconds, or with ``ratio < 1``, goes under ``omitted`` with the reason (logged
    as a warning): measured time never beats the floor.

    Args:
        phase_seconds: ``PhaseTimer.seconds``.
        work: ``WorkCounter.work``.
        peaks: :func:`measure_peaks`'s result.
        optimizer_steps: optimizer steps timed (their work is not seen by the forward hooks).
        shape: the model's shape, for the optimizer's work (its trainable weights).
        dtypes: phase -> the dtype its matmuls ran in (``WorkCounter.dtypes``: bf16 under bf16 autocast); a phase's
            compute floor uses that dtype's peak. Default: every phase in ``peaks.dtype``.
        matmul_peaks: dtype -> measured matmul FLOP/s, for the dtypes of ``dtypes`` other than ``peaks.dtype``.

    Returns:
        ``{"machine": {...}, "phases": {name: {...}}, "omitted": {name: {"reason": ..., ...}}}`` (JSON-ready).
    """
    work = dict(work)
    if optimizer_steps and shape is not None:
        work["optimizer"] = optimizer_work(shape, optimizer_steps)
    prefill = work.get("generation_prefill", Work()).forward_seconds
    seconds = {
        "evaluation": phase_seconds.get("evaluation", 0.0),
        "generation_prefill": prefill,
        "generation_decode": max(0.0, phase_seconds.get("generation", 0.0) - prefill),
        "logprob_forward": phase_seconds.get("logprob_forward", 0.0),
        "forward": work.get("forward", Work()).forward_seconds,
        "backward": phase_seconds.get("backward", 0.0),
        "optimizer": phase_seconds.get("optimizer", 0.0),
    }
    phases, omitted = {}, {}
    for name in PHASES:
        if name not in work or (work[name].flops <= 0 and work[name].bytes <= 0):
            continue
        dtype = (dtypes or {}).get(name, peaks.dtype)
        peak = peaks.matmul_flops_per_s if dtype == peaks.dtype else (matmul_peaks or {})[dtype]
        row = phase_roofline(seconds[name], work[name], replace(peaks, dtype=dtype, matmul_flops_per_s=peak))
        reason = below_the_floor(name, row)
        if reason is None:
            phases[name] = asdict(row)
        else:
            omitted[name] = {"reason": reason, **asdict(row)}
            logger.warning("roofline: %s", reason)
    machine = {
        **asdict(peaks),
        "matmul_flops_per_s_by_dtype": {peaks.dtype: peaks.matmul_flops_per_s, **(matmul_peaks or {})},
    }
    return {"machine": machine, "phases": phases, "omitted": omitted}


def below_the_floor(name: str, row: PhaseRoofline) -> str | None:
    """Why the row of phase ``name`` cannot be reported (None when it can): no seconds measured for counted work,
    or fewer seconds than its floor (``ratio < 1``: the floor or the timing is wrong)."""
    if row.seconds <= 0:
        return (
            f"{name} not timed: {row.floor_seconds:.3g} s of floor for the work counted, 0 s measured (no timer ran "
            "around this phase)"
        )
    if row.ratio is not None and row.ratio < 1:
        return (
            f"{name} measured {row.seconds:.3g} s, under its floor of {row.floor_seconds:.3g} s (ratio "
            f"{row.ratio:.2f} < 1): the floor counts work that did not run or the timer missed time"
        )
    return None


def format_roofline(report: Mapping[str, Any]) -> str:
    """The report as a console table: per phase seconds, floor, ratio, bound, FLOP/s and bandwidth achieved; then one
    line per phase left out, with the reason."""
    machine = report["machine"]
    by_dtype = machine.get("matmul_flops_per_s_by_dtype") or {machine["dtype"]: machine["matmul_flops_per_s"]}
    peaks = ", ".join(f"{flops / 1e9:.1f} GFLOP/s in {dtype}" for dtype, flops in by_dtype.items())
    lines = [
        f"roofline on {machine['device']} ({machine['threads']} threads): matmul peak {peaks}, bandwidth "
        f"{machine['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (measured in this run)",
        f"{'phase':<20}{'seconds':>9}{'floor s':>9}{'ratio':>8}  {'bound':<8}{'FLOP/s %':>9}{'bytes/s %':>10}  dtype",
    ]
    for name, row in report["phases"].items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
        fu = "-" if row["flops_utilization"] is None else f"{row['flops_utilization']:.1%}"
        bu = "-" if row["bandwidth_utilization"] is None else f"{row['bandwidth_utilization']:.1%}"
        lines.append(
            f"{name:<20}{row['seconds']:>9.1f}{row['floor_seconds']:>9.2f}{ratio:>8}  {row['bound']:<8}{fu:>9}{bu:>10}"
            f"  {row.get('dtype') or machine['dtype']}"
        )
    lines += [f"left out: {row['reason']}" for row in report.get("omitted", {}).values()]
    return "\n".join(lines)


@dataclass
class RooflineRecorder:
    """Counts a run's work (:class:`WorkCounter` on each model it is given) and reports it against the peaks measured
    when :meth:`report` is called."""

    current_phase: Callable[[], str | None]
    counters: list[WorkCounter] = field(default_factory=list)

    def watch(self, model: Any) -> None:
        """Count the forwards of ``model``, once per model: a wrapper of a watched one (PEFT, DDP) only re-reads its
        shape; anything but a ``torch.nn.Module`` is left alone."""
        if not isinstance(model, torch.nn.Module):
            return
        for counter in self.counters:
            if counter.covers(model):
                counter.refresh()
                return
        self.counters.append(WorkCounter(model, self.current_phase))

    def report(self, phase_seconds: Mapping[str, float], optimizer_steps: int = 0) -> dict[str, Any] | None:
        """The roofline report of everything counted so far (None when no model was watched); the optimizer's work
        over the first model's trainable weights now."""
        if not self.counters:
            return None
        work: dict[str, Work] = {}
        for counter in self.counters:
            for name, w in counter.work.items():
                work.setdefault(name, Work()).add(w)
        dtypes: dict[str, torch.dtype] = {}
        for counter in self.counters:
            for name, dtype in counter.dtypes.items():
                if name not in dtypes or dtype.itemsize < dtypes[name].itemsize:
                    dtypes[name] = dtype
        first = self.counters[0]
        first.refresh()  # the trainable weights the optimizer stepped (the adapters only under LoRA)
        peaks = measure_peaks(first.device, first.dtype)  # in the weights' dtype, on their device
        matmul_peaks = {  # and in every other dtype a phase computed in (bf16 autocast)
            _dtype_name(dtype): measure_matmul_peak(first.device, dtype)
            for dtype in set(dtypes.values())
            if dtype != first.dtype
        }
        names = {name: _dtype_name(dtype) for name, dtype in dtypes.items()}
        return roofline_report(phase_seconds, work, peaks, optimizer_steps, first.shape, names, matmul_peaks)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
