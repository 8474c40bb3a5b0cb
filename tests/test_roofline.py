"""trl_ext.measurement.roofline: each phase's counted work against hand-worked counts, the floor and ratio arithmetic,
and the peaks measured in the run."""

from __future__ import annotations

import peft
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.measurement.profiling import PhaseTimer
from trl_ext.measurement.roofline import (
    MachinePeaks,
    ModelShape,
    RooflineRecorder,
    Work,
    WorkCounter,
    format_roofline,
    forward_work,
    matmul_backward_work,
    measure_peaks,
    optimizer_work,
    phase_roofline,
    roofline_report,
)

SHAPE = ModelShape(
    body_weights=1000,
    head_weights=100,
    trainable_weights=500,
    element_bytes=4,
    layers=2,
    heads=4,
    head_dim=8,
    kv_heads=2,
)


def test_forward_work_by_hand():
    work = forward_work(SHAPE, rows=2, new=3, past=5, head_tokens=2)
    # tokens 2 x 3 = 6; causal pairs per row 3 x (5 + (3 + 1) / 2) = 21, two rows 42
    # flops: 2 x 1000 x 6 + 2 x 100 x 2 + 4 x 2 layers x 4 heads x 8 x 42 = 12000 + 400 + 10752
    assert work.flops == 23152
    # bytes: (1000 + 100) x 4 weights + 2 (k, v) x 2 layers x 2 kv heads x 8 x 2 rows x 8 positions x 4 = 4400 + 4096
    assert work.bytes == 8496
    assert (work.calls, work.tokens) == (1, 6)
    # a 4D mask gives the pairs exactly
    assert forward_work(SHAPE, 1, 3, 0, 3, attention_pairs=4).flops == 2 * 1000 * 3 + 2 * 100 * 3 + 4 * 2 * 4 * 8 * 4


def test_backward_and_optimizer_work_by_hand():
    # a 1000-weight matmul that did 6000 FLOPs forward, fp32: the input's gradient alone (frozen weight, LoRA's base),
    # the weight's alone (the first layer after frozen embeddings), both (full fine-tuning), neither (a frozen layer
    # before every trainable one)
    assert (
        matmul_backward_work(6000, 4000, True, False).flops,
        matmul_backward_work(6000, 4000, True, False).bytes,
    ) == (
        6000,
        4000,  # the weight read again
    )
    assert (
        matmul_backward_work(6000, 4000, False, True).flops,
        matmul_backward_work(6000, 4000, False, True).bytes,
    ) == (
        6000,
        8000,  # the gradient read and written
    )
    assert matmul_backward_work(6000, 4000, True, True).flops == 12000
    assert matmul_backward_work(6000, 4000, False, False).flops == 0
    optimizer = optimizer_work(SHAPE, steps=3)
    assert (optimizer.flops, optimizer.bytes, optimizer.calls) == (14 * 500 * 3, 9 * 500 * 4 * 3, 3)


def test_phase_roofline_arithmetic():
    peaks = MachinePeaks("cpu", "float32", matmul_flops_per_s=1e9, bandwidth_bytes_per_s=2e9, threads=2, seconds=1.0)
    row = phase_roofline(2.0, Work(flops=1e9, bytes=4e9), peaks)
    # compute floor 1e9 / 1e9 = 1 s, memory floor 4e9 / 2e9 = 2 s: memory-bound, floor 2 s, ratio 2 / 2 = 1
    assert (row.floor_seconds, row.ratio, row.bound) == (2.0, 1.0, "memory")
    assert (row.flops_utilization, row.bandwidth_utilization) == (0.5, 1.0)
    row = phase_roofline(10.0, Work(flops=8e9, bytes=2e9), peaks)
    assert (row.floor_seconds, row.ratio, row.bound) == (8.0, 1.25, "compute")


def test_the_report_splits_generation_into_prefill_and_decode():
    peaks = MachinePeaks("cpu", "float32", 1e9, 1e9, 2, 1.0)
    work = {
        "generation_prefill": Work(flops=1e9, bytes=1e8, forward_seconds=3.0, calls=2),
        "generation_decode": Work(flops=1e8, bytes=2e9, forward_seconds=4.0, calls=40),
        "backward": Work(flops=3e9, bytes=1e9),
    }
    report = roofline_report({"generation": 10.0, "backward": 6.0, "optimizer": 1.0}, work, peaks, 2, SHAPE)
    phases = report["phases"]
    assert list(phases) == ["generation_prefill", "generation_decode", "backward", "optimizer"]
    assert report["omitted"] == {}
    assert phases["generation_prefill"]["seconds"] == 3.0  # its forwards, hook-timed
    assert phases["generation_decode"]["seconds"] == 7.0  # the rest of the generation phase: 10 - 3
    assert phases["generation_decode"]["ratio"] == pytest.approx(7.0 / 2.0)  # memory floor 2e9 / 1e9
    assert phases["optimizer"]["bytes"] == 9 * 500 * 4 * 2
    assert "generation_decode" in format_roofline(report)


def test_model_shape_of_the_tiny_llama(tiny_model):
    shape = ModelShape.of(tiny_model)
    # per layer q, k, v, o 4 x 64 x 64 and gate, up, down 3 x 64 x 128 = 40960; two layers; head 49152 x 64 (tied)
    assert (shape.body_weights, shape.head_weights) == (2 * 40960, 49152 * 64)
    # trainable: the tied embedding once, the layers, two norms per layer and the final norm, 64 each
    assert shape.trainable_weights == 49152 * 64 + 2 * 40960 + 2 * 2 * 64 + 64
    assert (shape.layers, shape.heads, shape.head_dim, shape.kv_heads, shape.element_bytes) == (2, 4, 16, 4, 4)


def test_the_counter_counts_each_forward_in_its_phase(tiny_model):
    timer = PhaseTimer()
    counter = WorkCounter(tiny_model, lambda: timer.current)
    shape = counter.shape
    ids = torch.randint(3, 1000, (2, 5))
    tiny_model.train()
    with timer.phase("logprob_forward"):
        out = tiny_model(input_ids=ids, logits_to_keep=3)
    expected = forward_work(shape, 2, 5, 0, 2 * 3)
    assert counter.work["logprob_forward"].flops == expected.flops
    assert "backward" not in counter.work  # counted when it runs
    out.logits.sum().backward()
    # every weight trainable (the embedding too, so even the first layer's input gets its gradient): 2 x the forward
    assert counter.work["backward"].flops == pytest.approx(2 * expected.flops)
    assert counter.work["backward"].calls == 1
    tiny_model.eval()
    with torch.no_grad(), timer.phase("generation"):
        tiny_model.generate(
            input_ids=ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3,
            min_new_tokens=3, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    prefill, decode = counter.work["generation_prefill"], counter.work["generation_decode"]
    # the prompt's 4 tokens in one forward, then one forward per new token after the first
    assert (prefill.calls, prefill.tokens, decode.calls, decode.tokens) == (1, 8, 2, 4)
    assert decode.flops == pytest.approx(sum(forward_work(shape, 2, 1, past, 2).flops for past in (4, 5)))
    assert prefill.forward_seconds > 0
    with torch.no_grad():
        tiny_model(input_ids=ids)  # outside every phase: a training forward of another trainer
    assert counter.work["forward"].tokens == 10 and "backward" in counter.work
    counter.remove()
    tiny_model(input_ids=ids)
    assert counter.work["forward"].calls == 1


def test_peaks_are_measured_and_positive():
    peaks = measure_peaks("cpu", torch.float32, budget_s=0.05, matmul_size=64, copy_bytes=2**20)
    assert peaks.matmul_flops_per_s > 1e6 and peaks.bandwidth_bytes_per_s > 1e6
    assert peaks.device == "cpu" and peaks.dtype == "float32" and peaks.threads == torch.get_num_threads()


def test_the_recorder_watches_each_model_once_and_only_models(tiny_model):
    """A recipe may hand its trainer a model *name* (reward_model) and expert iteration no trainer instance: neither
    is hooked, and with nothing watched there is no report."""
    timer = PhaseTimer()
    recorder = RooflineRecorder(lambda: timer.current)
    recorder.watch("HuggingFaceTB/SmolLM2-135M-Instruct")
    recorder.watch(None)
    assert recorder.counters == [] and recorder.report({}) is None
    recorder.watch(tiny_model)
    recorder.watch(tiny_model)
    assert len(recorder.counters) == 1
    with torch.no_grad(), timer.phase("evaluation"):
        tiny_model(input_ids=torch.randint(3, 1000, (2, 5)))
    assert recorder.counters[0].work["evaluation"].calls == 1  # one hook, one count
    recorder.counters[0].remove()


# ----------------------------------------------------------------- backward FLOPs against torch's FlopCounterMode
ROWS, TOKENS = 2, 16
CAUSAL = (TOKENS + 1) / (2 * TOKENS)
"""The share of a row's (query, key) products that the causal mask allows: the roofline counts those, while the eager
and SDPA kernels FlopCounterMode measures multiply all TOKENS x TOKENS."""


def small_llama(attention: str = "eager", tie: bool = True) -> LlamaForCausalLM:
    """A 2-layer Llama of width 64 with grouped-query attention and a 256-token vocabulary, so that the frozen and
    trainable matmuls of the body weigh as much as the head (with the embedded tokenizer's 49,152 the head is 97% of
    the weights). FLOP counting needs token ids, not a tokenizer."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).train()


def freeze(model, *prefixes):
    for name, parameter in model.named_parameters():
        if name.startswith(prefixes):
            parameter.requires_grad_(False)
    return model


def lora(model, target_modules):
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=target_modules))


def checkpoint(model, reentrant: bool | None):
    """Gradient checkpointing on every layer (transformers' activation checkpointing), reentrant or not; None: off."""
    if reentrant is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})


QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
MODELS = {
    "full fine-tuning": lambda attention: small_llama(attention),
    "full fine-tuning, untied head": lambda attention: small_llama(attention, tie=False),
    "frozen embeddings (tied: the head too)": lambda attention: freeze(small_llama(attention), "model.embed_tokens"),
    "frozen embeddings, untied head": lambda attention: freeze(small_llama(attention, tie=False), "model.embed_tokens"),
    "embeddings and first layer frozen": lambda attention: freeze(
        small_llama(attention), "model.embed_tokens", "model.layers.0."
    ),
    "only the untied head trainable": lambda attention: freeze(small_llama(attention, tie=False), "model."),
    "LoRA r 8 on q/k/v/o": lambda attention: lora(small_llama(attention), QKVO),
    "LoRA r 8 on every linear layer": lambda attention: lora(small_llama(attention), "all-linear"),
    "LoRA r 8 on the MLP only": lambda attention: lora(small_llama(attention), ["gate_proj", "up_proj", "down_proj"]),
}
CHECKPOINTING = {"off": None, "non-reentrant (transformers' default)": False, "reentrant": True}


def in_place_addmm(self_shape, mat1, mat2, *args, out_shape=None, **kwargs):
    """FLOPs of ``aten.addmm_`` (``acc += a @ b``), which FlopCounterMode does not count by itself: TRL's fused head
    accumulates its gradients with it."""
    return 2 * mat1[0] * mat1[1] * mat2[1]


def measured_backward_flops(model, fused_head: bool = False) -> tuple[float, float, WorkCounter]:
    """One forward with gradients and its backward: the backward's FLOPs measured by FlopCounterMode (attention
    scaled to the causal pairs; SDPA's backward, which FlopCounterMode counts as the flash kernel's 2.5 x with the
    scores recomputed, to the 2 x of the two matmuls' gradients), and as the roofline counted them."""
    counter = WorkCounter(model, lambda: None)
    ids = torch.randint(0, 256, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    if fused_head:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        loss = out.log_probs.sum()
    else:
        loss = model(input_ids=ids).logits.pow(2).mean()
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: in_place_addmm}) as flops:
        loss.backward()
    measured = 0.0
    for op, count in flops.get_flop_counts()["Global"].items():
        name = str(op)
        if name in ("aten.mm", "aten.addmm", "aten.addmm_"):
            measured += count
        elif name == "aten.bmm":  # eager attention: Q K^T, P V and their gradients
            measured += count * CAUSAL
        elif "attention" in name and name.endswith("backward"):
            measured += count * CAUSAL * 2 / 2.5
        elif "attention" in name:  # the forward re-run by gradient checkpointing
            measured += count * CAUSAL
        else:
            raise AssertionError(f"an op the test does not expect: {name}")
    counter.remove()
    return measured, counter.work["backward"].flops, counter


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("name", MODELS)
def test_backward_flops_follow_what_requires_grad(name, checkpointing):
    """The roofline's backward FLOPs equal FlopCounterMode's, for full fine-tuning, LoRA and partly frozen models,
    with and without gradient checkpointing. Tolerance 1e-9 relative: both count the same matmuls from the same
    shapes, and the one convention that differs (attention over the mask's pairs, not the kernel's) is converted above
    by hand; any other difference is a matmul miscounted (one frozen projection of one layer is 1e-2 of the total)."""
    model = MODELS[name]("eager")
    checkpoint(model, CHECKPOINTING[checkpointing])
    measured, counted, _ = measured_backward_flops(model)
    assert counted == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("name", ["full fine-tuning", "LoRA r 8 on q/k/v/o"])
def test_backward_flops_with_sdpa_attention(name, checkpointing):
    """The same with SDPA (what the recipes load): the flash kernel's backward is one op FlopCounterMode counts."""
    model = MODELS[name]("sdpa")
    checkpoint(model, CHECKPOINTING[checkpointing])
    measured, counted, _ = measured_backward_flops(model)
    assert counted == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("checkpointing", ["off", "non-reentrant (transformers' default)"])
@pytest.mark.parametrize("name", ["full fine-tuning", "only the untied head trainable", "LoRA r 8 on q/k/v/o"])
def test_backward_flops_through_trls_fused_head(name, checkpointing):
    """TRL 1.16 trains through a fused LM head (``fused_lm_head=True``: no call of the head module; its backward
    recomputes the logits, then the hidden states' and the weight's gradients as far as they require grad)."""
    from trl.trainer.utils import add_fused_lm_head

    model = MODELS[name]("eager")
    add_fused_lm_head(model.get_base_model() if isinstance(model, peft.PeftModel) else model)
    checkpoint(model, CHECKPOINTING[checkpointing])
    measured, counted, counter = measured_backward_flops(model, fused_head=True)
    assert counted == pytest.approx(measured, rel=1e-9)
    # on the CPU every position but the last is projected (TRL scores all of them off Triton devices)
    head = 2 * ROWS * (TOKENS - 1) * 256 * 64
    body = 2 * ROWS * TOKENS * counter.shape.body_weights
    attention = 4 * 2 * 4 * 16 * ROWS * TOKENS * (TOKENS + 1) / 2  # 4 FLOPs x 2 layers x 4 heads x 16 dims a pair
    assert counter.work["forward"].flops == pytest.approx(head + body + attention)


def test_a_frozen_base_costs_one_forward_not_two():
    """The issue's measurement, by hand: under LoRA r 8 on q/k/v/o the backward is about 1 x the forward (input
    gradients only, plus the adapters' small weight gradients), under full fine-tuning 2 x."""
    full, counted_full, counter = measured_backward_flops(small_llama())
    forward = counter.work["forward"].flops
    assert counted_full == pytest.approx(2 * forward)  # every input and every weight gets its gradient
    _, counted_lora, counter = measured_backward_flops(lora(small_llama(), QKVO))
    lora_forward = counter.work["forward"].flops
    # layer 0's q/k/v inputs (the frozen embedding's output) need no gradient: 2 x 32 tokens x (64 x 64 + 2 x 64 x 32)
    # FLOPs fewer than one forward of the base; the adapters add their input and weight gradients
    assert 0.85 < counted_lora / lora_forward < 1.05


def test_no_per_module_hooks_at_inference_but_kept_while_a_backward_is_pending():
    """DPO runs its reference forward (no gradients) between the policy's forward and backward: the checkpointed
    layers' re-run must still be counted; a forward without gradients after every backward runs hook-free."""
    model = small_llama()
    checkpoint(model, reentrant=False)
    counter = WorkCounter(model, lambda: None)
    ids = torch.randint(0, 256, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids).logits.pow(2).mean()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj._forward_hooks  # gradients may flow: the matmuls are watched
    with torch.no_grad():
        model(input_ids=ids)  # the reference forward, before the backward
    assert q_proj._forward_hooks
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    measured = sum(c * (CAUSAL if "bmm" in str(op) else 1) for op, c in flops.get_flop_counts()["Global"].items())
    assert counter.work["backward"].flops == pytest.approx(measured, rel=1e-9)  # the re-run forward included
    with torch.no_grad():
        model(input_ids=ids)  # inference after every backward ran
    assert not q_proj._forward_hooks
    counter.remove()


# ----------------------------------------------------------------- LoRA: one counter, the adapters' weights
def test_lora_forward_and_optimizer_count_the_adapters_and_the_recorder_counts_once():
    timer = PhaseTimer()
    recorder = RooflineRecorder(lambda: timer.current)
    base = small_llama()
    recorder.watch(base)  # a recipe watches the model it loaded...
    body = recorder.counters[0].shape.body_weights
    assert body == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k, v (2 kv heads x 16), o, MLP
    model = lora(base, QKVO)
    recorder.watch(model)  # ...and the trainer's PEFT wrapper of it: the same forwards, not a second counter
    assert len(recorder.counters) == 1
    shape = recorder.counters[0].shape
    # r 8 adapters A (in x 8) and B (8 x out) on q (64 -> 64), k and v (64 -> 32), o (64 -> 64), two layers
    adapters = 2 * ((64 * 8 + 8 * 64) + 2 * (64 * 8 + 8 * 32) + (64 * 8 + 8 * 64))
    assert (shape.body_weights, shape.trainable_weights) == (body + adapters, adapters)
    with torch.no_grad(), timer.phase("evaluation"):
        model(input_ids=torch.randint(0, 256, (1, 4)))
    assert recorder.counters[0].work["evaluation"].calls == 1  # counted once, not by a hook on each wrapper
    report = recorder.report({"evaluation": 100.0, "optimizer": 100.0}, optimizer_steps=2)
    # AdamW touches the adapters only: 9 x their fp32 bytes a step, not the frozen base's
    assert report["phases"]["optimizer"]["bytes"] == 9 * adapters * 4 * 2
    recorder.counters[0].remove()


# ----------------------------------------------------------------- the rule: no ratio below 1
def test_untimed_phases_and_ratios_below_1_are_left_out_with_the_reason(caplog):
    peaks = MachinePeaks("cpu", "float32", 1e9, 1e9, 2, 1.0)
    work = {
        "forward": Work(flops=2e9, bytes=1e8, forward_seconds=4.0, calls=1),
        "backward": Work(flops=4e9, bytes=1e8),
    }
    with caplog.at_level("WARNING", logger="trl_ext"):
        # backward counted but never timed (the reward_model recipe before it was profiled); the optimizer's 2 steps
        # of 500 fp32 weights need 9 x 500 x 4 x 2 = 36 kB, 36 us at 1 GB/s, and were "timed" at 10 us
        report = roofline_report({"optimizer": 1e-5}, work, peaks, 2, SHAPE)
    assert list(report["phases"]) == ["forward"] and report["phases"]["forward"]["ratio"] == 2.0
    assert set(report["omitted"]) == {"backward", "optimizer"}
    assert report["omitted"]["backward"]["reason"].startswith("backward not timed: 4 s of floor")
    assert report["omitted"]["optimizer"]["ratio"] == pytest.approx(1e-5 / 36e-6)
    assert "under its floor" in report["omitted"]["optimizer"]["reason"]
    assert [r.getMessage() for r in caplog.records] == [
        f"roofline: {report['omitted'][name]['reason']}" for name in ("backward", "optimizer")
    ]
    assert "left out: backward not timed" in format_roofline(report)


def test_a_phase_under_autocast_is_floored_by_its_dtypes_peak():
    """Under bf16 autocast the matmuls run in bf16: the forward's and its backward's compute floors use the bf16
    peak (the fp32 one would put the floor too high: ratios below 1 on a CPU with AMX); the optimizer stays fp32."""
    model = small_llama()
    counter = WorkCounter(model, lambda: None)
    ids = torch.randint(0, 256, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    with torch.no_grad():
        model(input_ids=ids)  # an fp32 forward in the same bucket: the narrower dtype's (faster) peak is kept
    assert counter.dtypes == {"forward": torch.bfloat16, "backward": torch.bfloat16}
    counter.remove()
    peaks = MachinePeaks("cpu", "float32", 1e9, 1e12, 2, 1.0)  # fp32 1 GFLOP/s; bf16 10 GFLOP/s below
    work = {"backward": Work(flops=4e9, bytes=1.0), "optimizer": Work(flops=3e9, bytes=1.0)}
    report = roofline_report(
        {"backward": 1.0, "optimizer": 5.0},
        work,
        peaks,
        dtypes={"backward": "bfloat16"},
        matmul_peaks={"bfloat16": 1e10},
    )
    backward, optimizer = report["phases"]["backward"], report["phases"]["optimizer"]
    assert (backward["floor_seconds"], backward["ratio"], backward["dtype"]) == (0.4, 2.5, "bfloat16")  # 4e9 / 1e10
    assert (optimizer["floor_seconds"], optimizer["dtype"]) == (3.0, "float32")  # 3e9 / 1e9
    assert report["machine"]["matmul_flops_per_s_by_dtype"] == {"float32": 1e9, "bfloat16": 1e10}
    assert "10.0 GFLOP/s in bfloat16" in format_roofline(report)


def test_a_forward_that_raises_leaves_the_count_right():
    """A forward that fails (a token id beyond the vocabulary) must not leave the counter thinking a forward still
    runs: gradient checkpointing's re-run forward is told apart from the model's own by exactly that."""
    model = small_llama()
    checkpoint(model, reentrant=False)
    counter = WorkCounter(model, lambda: None)
    with pytest.raises(IndexError):
        model(input_ids=torch.full((1, 4), 10_000))
    measured, _, _ = measured_backward_flops(model)  # its own counter beside this one
    assert counter.work["backward"].flops == pytest.approx(measured, rel=1e-9)
    counter.remove()
