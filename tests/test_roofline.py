"""trl_ext.roofline: each phase's counted work against hand-worked counts, the floor and ratio arithmetic, and the
peaks measured in the run."""

from __future__ import annotations

import pytest
import torch

from trl_ext.profiling import PhaseTimer
from trl_ext.roofline import (
    MachinePeaks,
    ModelShape,
    RooflineRecorder,
    Work,
    WorkCounter,
    backward_work,
    format_roofline,
    forward_work,
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
    forward = forward_work(SHAPE, rows=2, new=3, past=5, head_tokens=2)
    backward = backward_work(SHAPE, forward)
    assert backward.flops == 2 * 23152
    assert backward.bytes == 1100 * 4 + 2 * 500 * 4  # weights read again, trainable gradients read and written
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
        tiny_model(input_ids=ids, logits_to_keep=3)
    expected = forward_work(shape, 2, 5, 0, 2 * 3)
    assert counter.work["logprob_forward"].flops == expected.flops
    assert counter.work["backward"].flops == 2 * expected.flops  # a forward with gradients implies its backward
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
