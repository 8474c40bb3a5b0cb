"""How close each phase of a run comes to what the machine allows: a roofline report.

For each phase of a run (held-out evaluation, generation prefill and decode, the log-prob forward, other training
forwards, backward, optimizer) the report puts the seconds measured beside the floor this machine allows for that
phase's work: ``max(FLOPs / matmul peak, bytes / memory bandwidth)``, with the peak and the bandwidth **measured in
the run** (:func:`measure_peaks`, about a second), never taken from a data sheet. The matmul peak is measured in each
dtype a phase computed in: the weights' dtype, and autocast's (bf16) for the phases that ran under it -- against the
fp32 peak a bf16 phase's floor would be too high (on a CPU with AMX the bf16 peak is about 30 x the fp32 one).
``ratio = seconds / floor`` says how many times slower than the floor the phase ran (1 = at the roofline); on CUDA the
same numbers read as MFU (``flops_utilization``: achieved FLOP/s over the measured matmul peak) and bandwidth use.

The work is counted, not estimated from wall time: :class:`WorkCounter` hooks the model's forward and, for every
call, counts from its inputs (Williams, Waterman & Patterson 2009, "Roofline"; Kaplan et al. 2020 for 2 x parameters
FLOPs per token):

* matmul FLOPs ``2 x P_body x T + 2 x P_head x T_head``: ``P_body`` the weights of every ``nn.Linear`` (and GPT-2's
  ``Conv1D``) but the output head, LoRA's adapters included, ``T`` the tokens the call processes (rows x new tokens),
  ``P_head``/``T_head`` the output head and the tokens whose logits are computed (``logits_to_keep``);
* attention FLOPs ``4 x layers x heads x head_dim`` per (query, key) pair the mask allows (exact for a 4D mask,
  causal ``new x (past + (new + 1) / 2)`` per row otherwise, padding included), ``layers`` the model's attention
  modules (a hybrid model's convolution or state-space layers have none);
* bytes: every weight read once per call, plus the keys and values of every attention layer read once per row;
* a backward is counted as it runs, matmul by matmul (hooks on every ``nn.Linear`` / GPT-2 ``Conv1D`` and tensor
  hooks on their outputs while gradients may flow): ``2 x in x out`` FLOPs a row for the gradient of the input when
  that input requires grad, as many again for the gradient of the weight when the weight requires grad. So a frozen
  base under LoRA costs about 1 x its forward (input gradients only), full fine-tuning 2 x, and layers before the
  first trainable parameter nothing; attention's two matmuls cost 2 x their forward in each layer whose attention
  output gets a gradient. Bytes: the weights whose input gradient is computed read once more, every gradient that is
  accumulated read and written. With gradient checkpointing the forward that the backward re-runs (as far as it
  re-runs: non-reentrant checkpointing stops at the last tensor it needs) is counted into the backward too;
* an optimizer step (AdamW with gradient clipping): 9 x the trainable weights' bytes (read weight, gradient and two
  moments, write weight and moments; read the gradients for the norm and again to scale them) and 14 FLOPs a weight,
  the trainable weights read when the report is made (under LoRA, the adapters only).

Every reported ratio is at least 1: measured time cannot beat the floor. A phase with counted work but no measured
seconds (nothing timed it) or a ratio below 1 (the floor or the timing is wrong) is left out of ``phases`` and listed
under ``omitted`` with the reason, and logged (:func:`roofline_report`).

These are floors, not predictions: activations, softmax, norms and the sampling loop are not counted, so a ratio
above 1 is time spent on them, on kernel and Python overhead, or on matmuls below peak.
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
"""The report's rows, in order: where a forward is counted depends on the timer's phase when it runs
(:meth:`WorkCounter.bucket`)."""

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
    """Measure the matmul peak and the memory bandwidth of ``device``, now, in about ``budget_s`` seconds.

    Args:
        device: where to measure (the model's device).
        dtype: the matmul dtype (the model's compute dtype: fp32, bf16...).
        budget_s: seconds for each of the two measurements (best of the repetitions is kept).
        matmul_size: n of the n x n matmul (default 1024 on CPU, 8192 on CUDA: large enough to reach the peak).
        copy_bytes: size of the copied tensor (default 256 MiB on CPU, 1 GiB on CUDA: beyond every cache).

    Returns:
        a :class:`MachinePeaks`.
    """
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
    """``(in_features, out_features)`` of a module that is one matmul -- ``nn.Linear`` (and its subclasses:
    bitsandbytes' 4/8-bit layers, LoRA's ``lora_A``/``lora_B``) or transformers' ``Conv1D`` (GPT-2; weight
    ``(in, out)``) --, else None. Read from the module's attributes, not its weight (a sharded weight may be empty)."""
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
    """Modules inside PEFT's ``modules_to_save`` copies: the copy or the original runs, never both, so only the
    original's weights count (same shapes)."""
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
    """The attention modules of ``model``, one per attention layer: the outermost modules whose class name ends in
    ``Attention`` (``LlamaAttention``, ``GPT2Attention``, ...; a hybrid model's convolution, state-space or
    linear-attention mixers are not among them), PEFT's ``modules_to_save`` copies left out."""
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
    """The work of one forward (see the module docstring for the counts).

    Args:
        shape: the model's :class:`ModelShape`.
        rows: batch rows.
        new: new tokens per row (the input's length).
        past: tokens already in the key/value cache per row.
        head_tokens: tokens whose logits the head computes (all rows).
        attention_pairs: (query, key) pairs the mask allows, all rows; None = causal, ``rows x new x (past +
            (new + 1) / 2)``.

    Returns:
        a :class:`Work` with ``flops``, ``bytes``, ``calls`` 1 and ``tokens`` ``rows x new``.
    """
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
    """The backward of one matmul whose forward did ``flops`` over a weight of ``weight_bytes``: the gradient of its
    input (as many FLOPs as the forward, the weight read again) when the input requires grad, the gradient of its
    weight (as many FLOPs again, the gradient read and written to accumulate) when the weight requires grad."""
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
    """The output tensor every backward through a forward passes: the logits, TRL's fused head's log-probs, or the
    model's first tensor output."""
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
    """Positions the output head projects in a forward with TRL's fused LM head (``fused_lm_head=True``, TRL 1.16's
    ``add_fused_lm_head``: GRPO's log-probs, SFT, DPO), None for any other forward. TRL scores only the labelled
    positions (``labels != -100``) where its Triton kernel runs (CUDA, XPU), every position elsewhere."""
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
"""Buckets whose seconds come from timing the forward itself (the rest come from the run's phase timer): on CUDA only
these forwards synchronize the device, so decoding and training keep their asynchrony."""


class WorkCounter:
    """Counts the work of every forward of ``model`` into the bucket of the phase it runs in, and the work of every
    backward through it as it runs.

    Forwards are counted by a hook on ``model`` (:func:`forward_work`). While gradients may flow -- from a forward
    with gradients enabled until a forward without them when no backward is pending -- each matmul
    (:func:`matmul_modules`) and attention module (:func:`attention_modules`) is hooked too, and a gradient hook on
    its output counts its backward when the backward reaches it (:func:`matmul_backward_work`: what requires grad
    decides), so frozen weights, LoRA, frozen layers and forwards never backpropagated are counted as they run. A
    matmul or attention module that runs while the model's own forward is not running is the forward that gradient
    checkpointing re-runs inside the backward: it is counted into the backward. TRL's fused LM head (no module call:
    :func:`fused_head_positions`) is counted at the model's output: its forward, and in its backward the logits
    recomputed plus the gradients of the hidden states and of the head's weight, as far as they require grad.
    Inference forwards run without the per-module hooks.

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
        """Where a forward of ``new_tokens`` tokens per row counts: by the running phase (``evaluation``,
        ``generation`` -- ``generation_prefill`` for a forward of more than one token per row, ``generation_decode``
        for one --, ``logprob_forward``), ``forward`` otherwise (e.g. SFT's training forward)."""
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
    """``floor = max(flops / peak, bytes / bandwidth)``, ``ratio = seconds / floor``, and what was achieved as a
    fraction of each peak (MFU on a GPU).

    Args:
        seconds: the phase's measured seconds.
        work: its counted work.
        peaks: the machine's measured peaks.
    """
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

    The rule: measured time never beats the floor. A phase with counted work and no measured seconds (nothing timed
    it), or with ``ratio < 1`` (its floor counts work that did not run, or its timer missed time), is not reported as
    a ratio: it goes under ``omitted`` with the reason and its numbers, and the reason is logged (warning, logger
    ``trl_ext``).

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
        """Count the forwards of ``model``: once per model -- a model that holds a watched one or is held by it (a
        PEFT or DDP wrapper around it, given later by a trainer) is not hooked again, the watched one's shape is read
        again instead (PEFT injected adapters and froze the base). Anything but a ``torch.nn.Module`` (a model name
        a recipe hands its trainer to load) is left alone."""
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
