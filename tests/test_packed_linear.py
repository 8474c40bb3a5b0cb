"""Packed linear weights for CPU generation and evaluation (trl_ext.speed.packed_linear, issue 31).

Two backends, each tested where this PyTorch has its ops: oneDNN's blocked layout and MKL's packed sgemm. The packed
forward computes ``x @ W^T + b`` with another GEMM kernel: the tests hold it to values worked out by hand
and to the plain ``nn.Linear`` forward (float rounding apart) on many architectures, check that every case it cannot
serve exactly runs the module's own forward, and that the saving turns itself off in one log line where it cannot
apply. The architecture matrix (tests/test_architectures.py) runs the whole GRPO step with it against the plain step.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from architectures import tiny_model
from conftest import length_mod5_reward
from tiny import tiny_grpo_trainer

import trl_ext.logs
from trl_ext.eval import generate_completions
from trl_ext.speed import packed_linear
from trl_ext.speed.packed_linear import PackedLinearWeights, choose_backend, cpu_vendor, packable, packing_blocker

BACKENDS = ["onednn"] + (["mkl"] if packed_linear._mkl_ops_available() else [])
KERNEL = {"onednn": "_pointwise", "mkl": "_mkl_linear"}  # the function each backend's packed forward calls
REORDER = {"onednn": (torch.ops.mkldnn, "_reorder_linear_weight"), "mkl": (torch.ops.mkl, "_mkl_reorder_linear_weight")}


def hand_linear() -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [-1.0, 0.5]]))
        layer.bias.copy_(torch.tensor([1.0, -1.0, 0.0]))
    return layer


def spy(monkeypatch, backend: str) -> list[int]:
    """Count the calls of ``backend``'s packed kernel."""
    calls: list[int] = []
    kernel = getattr(packed_linear, KERNEL[backend])
    monkeypatch.setattr(packed_linear, KERNEL[backend], lambda *a: calls.append(1) or kernel(*a))
    return calls


def record_reorders(monkeypatch) -> list[int]:
    """The row count of each weight packing (``_reorder`` calls), in order."""
    rows: list[int] = []
    reorder = packed_linear._reorder
    monkeypatch.setattr(packed_linear, "_reorder", lambda b, w, n: rows.append(n) or reorder(b, w, n))
    return rows


@pytest.fixture(autouse=True)
def fresh_backend_probes(monkeypatch):
    """Each test probes the backends afresh (their verdicts are cached per process), and sees its own log lines."""
    monkeypatch.setattr(packed_linear, "_probe_results", {})
    monkeypatch.setattr(trl_ext.logs, "SAID", set())  # each backend message said anew


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_forward_gives_the_hand_worked_values(backend, monkeypatch):
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]])
    # rows: [1+2+1, 3+4-1, -1+0.5] = [4, 6, -0.5]; [2-2+1, 6-4-1, -2-0.5] = [1, 1, -2.5]
    expected = torch.tensor([[4.0, 6.0, -0.5], [1.0, 1.0, -2.5]])
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(backend=backend)
    with torch.no_grad(), packed.applied(layer, rows=2):
        assert "forward" in layer.__dict__
        out = layer(x)  # 2 rows, the count named: packed at this first forward
        assert len(packed) == 1
        out_3d = layer(x.unsqueeze(0).expand(3, 2, 2))  # 6 rows: MKL's copy serves only the 2 it was packed for
    assert torch.equal(out, expected)
    assert torch.equal(out_3d, expected.expand(3, 2, 3))
    assert len(calls) == (2 if backend == "onednn" else 1)
    assert "forward" not in layer.__dict__ and len(packed) == 0  # forward restored; the copy lived with the block


def test_the_backend_is_chosen_by_cpu(monkeypatch, tmp_path):
    intel, amd = tmp_path / "intel", tmp_path / "amd"
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n")
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert cpu_vendor(str(intel)) == "GenuineIntel" and cpu_vendor(str(amd)) == "AuthenticAMD"
    assert cpu_vendor(str(tmp_path / "missing")) is None
    monkeypatch.setattr(packed_linear, "_mkl_ops_available", lambda: True)
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert choose_backend() == "mkl" and PackedLinearWeights().backend == "mkl"
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert choose_backend() == "onednn"
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(packed_linear, "_mkl_ops_available", lambda: False)
    assert choose_backend() == "onednn"
    with pytest.raises(ValueError, match="backend='cublas'; expected 'mkl', 'onednn' or None"):
        PackedLinearWeights(backend="cublas")
    with pytest.raises(ValueError, match="no MKL packing ops"):  # asked for by name where it cannot run
        PackedLinearWeights(backend="mkl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_the_backend_refuses_keeps_the_plain_forward(backend, monkeypatch):
    layer = hand_linear()
    namespace, name = REORDER[backend]
    reorder = getattr(namespace, name)

    def refuse_3x2(weight, *args):  # this weight only: the probe's weights pack as usual
        if tuple(weight.shape) == (3, 2):
            raise RuntimeError("could not create a primitive descriptor")
        return reorder(weight, *args)

    monkeypatch.setattr(namespace, name, refuse_3x2)
    packed = PackedLinearWeights(backend=backend)
    with torch.no_grad(), packed.applied(layer, rows=1):
        for _ in range(2):
            assert torch.equal(layer(torch.tensor([[1.0, 1.0]])), torch.tensor([[4.0, 6.0, -0.5]]))
        assert len(packed) == 0
    assert packed.backend == backend  # a refused weight is that module's matter, not the backend's


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_case_the_packed_weight_cannot_serve_runs_the_plain_forward(backend, monkeypatch):
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0]])
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(backend=backend)
    with packed.applied(layer, rows=1):
        with torch.no_grad():
            assert torch.equal(layer(x), torch.tensor([[4.0, 6.0, -0.5]]))
        assert len(calls) == 1
        # autograd: the weight requires grad and grad mode is on -> plain forward, with a graph
        out = layer(x)
        assert out.grad_fn is not None and len(calls) == 1
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16 and len(calls) == 1  # autocast: the plain (bf16) forward
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="same dtype"):  # another dtype: nn.Linear's own error
                layer(x.double())
            with pytest.raises(RuntimeError, match="cannot be multiplied"):  # wrong width: nn.Linear's own error
                layer(torch.ones(1, 3))
            layer(torch.tensor([1.0, 1.0]))  # 1-D input
            assert len(calls) == 1
            two_rows = layer(torch.tensor([[1.0, 1.0], [2.0, -1.0]]))  # MKL: not the row count packed for
            assert torch.equal(two_rows, torch.tensor([[4.0, 6.0, -0.5], [1.0, 1.0, -2.5]]))
            served = 2 if backend == "onednn" else 1  # oneDNN's copy serves any row count
            assert len(calls) == served
            # a version-bumping write inside the block (an in-place op under no_grad): the new weight, packed again
            layer.weight.mul_(2.0)
            assert torch.equal(layer(x), torch.tensor([[7.0, 13.0, -1.0]]))  # 2*[3, 7, -0.5] + [1, -1, 0]
            layer.weight.data = torch.zeros(3, 2)  # replaced storage: the same
            assert torch.equal(layer(x), torch.tensor([[1.0, -1.0, 0.0]]))
            assert len(calls) == served + 2
    with packed.applied(layer, rows=1), torch.no_grad():  # the next block packs the weight as it is then
        assert torch.equal(layer(x), torch.tensor([[1.0, -1.0, 0.0]]))
    assert len(calls) == served + 3


def _write_data_add(layer, other):
    layer.weight.data.add_(other)


def _write_data_copy(layer, other):
    layer.weight.data.copy_(other)


def _write_data_assign(layer, other):
    layer.weight.data = other.clone()


def _write_no_grad_add(layer, other):
    with torch.no_grad():
        layer.weight.add_(other)


def _write_load_state_dict(layer, other):
    layer.load_state_dict({"weight": other, "bias": layer.bias.detach() - 1.0})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "write", [_write_data_add, _write_data_copy, _write_data_assign, _write_no_grad_add, _write_load_state_dict]
)
def test_no_write_between_uses_leaves_a_packed_forward_on_old_weights(backend, write, monkeypatch):
    # issue 37: .data writes change no tensor version (3.8 / 0.30 away from the plain forward before)
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(13, 6)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(6, 13, generator=g))
        layer.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(4, 13, generator=g)
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(backend=backend)
    with torch.no_grad():
        with packed.applied(layer, rows=4):
            before = layer(x)
        write(layer, torch.randn(6, 13, generator=g) * 3)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        with packed.applied(layer, rows=4):
            after = layer(x)
    assert len(calls) == 2  # both ran packed
    assert (plain - before).abs().max() > 1.0  # the write changed the output
    torch.testing.assert_close(after, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_peft_merge_and_unmerge_between_uses_give_the_plain_forward(backend, tokenizer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama", len(tokenizer)),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    ).eval()
    ids = torch.randint(3, len(tokenizer), (2, 5), generator=torch.Generator().manual_seed(1))
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(backend=backend)

    def packed_and_plain():
        with torch.no_grad():
            with packed.applied(model, rows=ids.numel()):
                ours = model(input_ids=ids).logits
            return ours, model(input_ids=ids).logits

    unmerged, unmerged_plain = packed_and_plain()
    model.merge_adapter()  # writes the LoRA delta into base_layer.weight.data: no version bump
    merged, merged_plain = packed_and_plain()
    model.unmerge_adapter()
    again, again_plain = packed_and_plain()
    assert calls and model.base_model.model.model.layers[0].self_attn.q_proj.merged is False
    for ours, plain in ((unmerged, unmerged_plain), (merged, merged_plain), (again, again_plain)):
        torch.testing.assert_close(ours, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_are_kept_across_blocks_only_inside_fixed_weights(backend, monkeypatch):
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0]])
    reorders = []
    reorder = packed_linear._reorder
    monkeypatch.setattr(packed_linear, "_reorder", lambda *a: reorders.append(1) or reorder(*a))
    packed = PackedLinearWeights(backend=backend)
    with torch.no_grad():
        with packed.fixed_weights():
            for _ in range(3):  # three generation rounds of one batch: packed once
                with packed.applied(layer, rows=1):
                    assert torch.equal(layer(x), torch.tensor([[4.0, 6.0, -0.5]]))
                assert len(packed) == 1
            with packed.fixed_weights():  # nested: the outermost block decides
                pass
            assert len(packed) == 1 and len(reorders) == 1
        assert len(packed) == 0
        for _ in range(2):  # outside fixed_weights each block packs for itself
            with packed.applied(layer, rows=1):
                layer(x)
    assert len(reorders) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_is_packed_for_a_row_count_that_comes_again_and_never_for_one_seen_once(backend, monkeypatch):
    layer, packed = hand_linear(), PackedLinearWeights(backend=backend)
    packed_rows, calls = record_reorders(monkeypatch), spy(monkeypatch, backend)
    prefill = torch.ones(3, 5, 2)  # 15 rows, once
    step = torch.ones(3, 1, 2)  # 3 rows, a decode step
    with torch.no_grad(), packed.applied(layer):  # no row count named
        layer(prefill)
        layer(step)
        assert packed_rows == [] and calls == []  # each count seen once: nothing packed
        layer(step)  # 3 rows again: packed now, and served
        layer(step)
    assert packed_rows == [3] and len(calls) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_a_generate_block_onednn_packs_at_the_prefill_and_mkl_waits_for_the_named_rows(backend, monkeypatch):
    # oneDNN's copy serves any row count, so a generate block's prefill (15 rows) packs it, with the named decode row
    # count as the hint, and runs on it (round 4's speed: the prefill ran packed); MKL's copy serves one row count:
    # the prefill runs plain, the decode steps (3 rows, named) pack and run packed
    layer, packed = hand_linear(), PackedLinearWeights(backend=backend)
    packed_rows, calls = record_reorders(monkeypatch), spy(monkeypatch, backend)
    prefill, step = torch.ones(3, 5, 2), torch.ones(3, 1, 2)
    plain = torch.nn.functional.linear(prefill, layer.weight, layer.bias)  # every entry 1 + 2 + bias: [4, 6, -0.5]
    with torch.no_grad(), packed.applied(layer, rows=3):
        out = layer(prefill)
        assert torch.equal(out, plain) and torch.equal(out[0, 0], torch.tensor([4.0, 6.0, -0.5]))
        assert (packed_rows, len(calls)) == (([3], 1) if backend == "onednn" else ([], 0))
        layer(step)
        layer(step)
    assert packed_rows == [3] and len(calls) == (3 if backend == "onednn" else 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_count_other_than_the_named_one_never_takes_the_copy_the_decode_needs(backend, monkeypatch):
    # Inside a block that names its decode count (3), forwards of another count that come twice before the decode
    # (the savings probe's or training_noise's 8-position probe batch, a second prefill) ran plain once and were then
    # packed for their count: MKL's copy serves one count, so every decode step of the block ran plain (an evaluation
    # call of 40 rows: 5,065 plain forwards, none packed). Only the named count packs; oneDNN serves any count.
    layer, packed = hand_linear(), PackedLinearWeights(backend=backend)
    packed_rows, calls = record_reorders(monkeypatch), spy(monkeypatch, backend)
    other, step = torch.ones(1, 8, 2), torch.ones(3, 1, 2)
    expected = torch.nn.functional.linear(step, layer.weight, layer.bias)  # 1 + 2 + bias per row: [4, 6, -0.5]
    with torch.no_grad(), packed.applied(layer, rows=3):
        layer(other), layer(other)
        assert packed_rows == ([3] if backend == "onednn" else [])
        for _ in range(2):
            assert torch.equal(layer(step)[:, 0], torch.tensor([[4.0, 6.0, -0.5]] * 3))
            assert torch.equal(layer(step), expected)
    assert packed_rows == [3] and len(calls) == (6 if backend == "onednn" else 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_probe_checks_a_row_count_the_backend_packs_for(backend, monkeypatch):
    # MKL's packed kernel depends on the row count: its probe must run on the named decode count (3), not on the
    # prefill's 15 rows that run plain; oneDNN packs at the prefill, so it probes there
    probed: list[int] = []
    probe = packed_linear._probe
    monkeypatch.setattr(packed_linear, "_probe", lambda b, n: probed.append(n) or probe(b, n))
    layer, packed = hand_linear(), PackedLinearWeights(backend=backend)
    with torch.no_grad(), packed.applied(layer, rows=3):
        layer(torch.ones(3, 5, 2))
        assert probed == ([15] if backend == "onednn" else [])
        layer(torch.ones(3, 1, 2))
    assert probed == [15 if backend == "onednn" else 3]


@pytest.mark.skipif("mkl" not in BACKENDS, reason="this PyTorch has no MKL packing ops")
def test_a_fallback_to_mkl_probes_the_count_mkl_packs_for(monkeypatch):
    # oneDNN probes at the prefill (15 rows) and fails there; MKL, used instead, packs only the named decode count (3),
    # so its probe runs on 3, not on the prefill's 15
    probed: list[tuple[str, int]] = []
    probe = packed_linear._probe
    monkeypatch.setattr(packed_linear, "_probe", lambda b, n: probed.append((b, n)) or probe(b, n))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: torch.zeros(1))
    layer, packed = hand_linear(), PackedLinearWeights(backend="onednn")
    calls = spy(monkeypatch, "mkl")
    with torch.no_grad(), packed.applied(layer, rows=3):
        assert torch.equal(layer(torch.ones(3, 5, 2))[0, 0], torch.tensor([4.0, 6.0, -0.5]))  # plain: 1 + 2 + bias
        assert torch.equal(layer(torch.ones(3, 1, 2))[:, 0], torch.tensor([[4.0, 6.0, -0.5]] * 3))
    assert probed == [("onednn", 15), ("mkl", 3)] and packed.backend == "mkl" and len(calls) == 1


def test_the_probe_passes_on_this_pytorch_and_touches_no_global_generator():
    state = torch.get_rng_state()
    for backend in BACKENDS:
        assert packed_linear.probe_backend(backend, 16) is None
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("fault", ["wrong values", "raises"])
def test_a_backend_whose_op_computes_something_else_is_turned_off_in_one_line(fault, monkeypatch, caplog):
    if "mkl" not in BACKENDS:
        pytest.skip("this PyTorch has no MKL packing ops")
    op = torch.ops.mkl._mkl_linear

    def faulty(input, packed, weight, bias, rows):
        if fault == "raises":
            raise RuntimeError("mkl_linear: unsupported")
        return op(input, packed, weight, bias, rows) * (1 + 1e-4)  # a relative error far beyond float rounding

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", faulty)
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]])
    calls = spy(monkeypatch, "onednn")
    with caplog.at_level(logging.WARNING, logger="trl_ext"), torch.no_grad():
        for _ in range(2):  # a second object in the same process: the verdict holds, said once
            packed = PackedLinearWeights(backend="mkl")
            with packed.applied(layer, rows=2):
                assert torch.equal(layer(x), torch.tensor([[4.0, 6.0, -0.5], [1.0, 1.0, -2.5]]))
            assert packed.backend == "onednn"
    lines = [r.getMessage() for r in caplog.records if "backend is off" in r.getMessage()]
    assert len(lines) == 1 and "the mkl backend is off (probe: " in lines[0] and "onednn backend is used" in lines[0]
    assert ("RuntimeError" in lines[0]) == (fault == "raises")
    assert len(calls) == 2  # served by oneDNN instead


def test_both_backends_failing_their_probe_leave_the_plain_forward(monkeypatch, caplog):
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: torch.zeros(1))
    if "mkl" in BACKENDS:
        monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: torch.zeros(1))
    layer = hand_linear()
    packed = PackedLinearWeights(backend="onednn")
    with caplog.at_level(logging.WARNING, logger="trl_ext"), torch.no_grad():
        with packed.applied(layer, rows=1):
            assert torch.equal(layer(torch.tensor([[1.0, 1.0]])), torch.tensor([[4.0, 6.0, -0.5]]))
        assert packed.backend is None and len(packed) == 0
        with packed.applied(layer, rows=1):
            assert "forward" not in layer.__dict__  # nothing patched any more
    lines = [r.getMessage() for r in caplog.records if "backend is off" in r.getMessage()]
    assert len(lines) == 1 and "plain forward used" in lines[0]


def test_only_plain_fp32_cpu_linears_are_packed():
    assert packable(torch.nn.Linear(4, 2))
    assert not packable(torch.nn.Linear(4, 2).to(torch.bfloat16))
    assert not packable(torch.nn.Linear(4, 0))  # oneDNN refuses an empty weight

    class MyLinear(torch.nn.Linear):  # a subclass (quantized, LoRA, ...) keeps its own forward
        pass

    assert not packable(MyLinear(4, 2))
    hooked = torch.nn.Linear(4, 2)
    hooked.forward = lambda x: x  # accelerate's offloading hooks replace the instance's forward
    assert not packable(hooked)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral", "lfm2", "mamba2", "bloom"])
def test_packed_forwards_equal_the_plain_forward_on_many_architectures(name, backend, tokenizer, monkeypatch):
    model = tiny_model(name, len(tokenizer)).eval()
    ids = torch.randint(3, len(tokenizer), (3, 7), generator=torch.Generator().manual_seed(0))
    calls = spy(monkeypatch, backend)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        packed = PackedLinearWeights(backend=backend)
        with packed.applied(model, rows=ids.numel()):  # packed for the 21 rows
            ours = model(input_ids=ids).logits
            served = len(packed)
    assert 0 < served <= sum(1 for m in model.modules() if packable(m))  # mixtral's experts see fewer rows
    assert len(calls) == served
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-4)


def test_the_saving_says_once_why_it_is_off(tokenizer, monkeypatch, caplog):
    model = tiny_model("llama", len(tokenizer)).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 1000)
    assert packing_blocker(model).startswith("packed weights would take")
    with caplog.at_level(logging.WARNING, logger="trl_ext"), torch.no_grad():
        for _ in range(2):
            with PackedLinearWeights().applied(model):
                assert "forward" not in model.lm_head.__dict__
                assert torch.equal(model(input_ids=ids).logits, plain)
    lines = [r.getMessage() for r in caplog.records if "prepack_linear_weights off" in r.getMessage()]
    assert len(lines) == 1 and "more than 25% of the" in lines[0], lines
    assert packing_blocker(copy.deepcopy(model).to(torch.bfloat16)) == "no nn.Linear with an fp32 CPU weight"
    monkeypatch.setattr(packed_linear, "_ops_available", lambda: False)
    assert "no oneDNN prepacking ops" in packing_blocker(model)


def test_greedy_evaluation_gives_the_same_answers_packed(tokenizer, monkeypatch):
    model = tiny_model("llama", len(tokenizer))
    tok = copy.deepcopy(tokenizer)
    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (30, 4), (55, 55)]]
    plain = generate_completions(model, tok, prompts, 8, batch_size=2, prepack_linear_weights=False)
    n_linear = sum(1 for m in model.modules() if packable(m))
    reorder = packed_linear._reorder
    for backend in BACKENDS:
        packings = []
        monkeypatch.setattr(packed_linear, "_reorder", lambda *a, out=packings: out.append(a[2]) or reorder(*a))
        monkeypatch.setattr(packed_linear, "choose_backend", lambda backend=backend: backend)
        calls = spy(monkeypatch, backend)
        ours = generate_completions(model, tok, prompts, 8, batch_size=2)
        assert ours == plain and all(ours) and calls, backend
        # one packing per module for the call, for the 2 rows of a full batch; the last batch (1 row) reuses it
        # (oneDNN) or runs plain (MKL), never packs again
        assert packings == [2] * n_linear, backend


def test_grpo_generation_packs_once_per_batch_and_releases_the_copies(tokenizer, tmp_path):
    def step(prepack):
        model = tiny_model("llama", len(tokenizer))
        settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_steps=1)
        settings.update(optim="sgd", learning_rate=0.1, logging_steps=1, temperature=1.5)
        settings.update(dynamic_sampling=True, max_sampling_rounds=2, prepack_linear_weights=prepack)
        prompts = ["Count to 3:", "Count to 4:", "Say hi:", "Add 1 and 2:"]
        trainer = tiny_grpo_trainer(model, tokenizer, tmp_path / str(prepack), prompts, length_mod5_reward, **settings)
        seen, batches = [], []
        single_turn, score = trainer._generate_single_turn, trainer._generate_and_score_completions

        def spy_single_turn(*a, **k):
            out = single_turn(*a, **k)
            if trainer._packed_linear is not None:
                seen.append(len(trainer._packed_linear))
            return out

        def spy_score(inputs):
            batches.append(score(inputs))
            return batches[-1]

        trainer._generate_single_turn, trainer._generate_and_score_completions = spy_single_turn, spy_score
        trainer.train()
        return trainer, seen, batches[0]

    ours, seen, batch = step(True)
    plain, _, plain_batch = step(False)
    n_linear = sum(1 for m in ours.model.modules() if packable(m))
    assert seen and all(n == n_linear for n in seen)  # every round of the batch ran with the packed copies
    assert len(ours._packed_linear) == 0 and plain._packed_linear is None  # released after the batch
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    for p, q in zip(ours.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_generation_packs_for_the_rows_each_generate_decodes(backend, tokenizer, tmp_path, monkeypatch):
    # issue 37: with steps_per_generation > 1 upstream generates per_device_train_batch_size x steps_per_generation
    # rows per call; packing for per_device_train_batch_size rows (before) never served and was pure cost
    per_device, steps_per_generation = 2, 2
    rows = per_device * steps_per_generation
    monkeypatch.setattr(packed_linear, "choose_backend", lambda: backend)
    settings = dict(per_device_train_batch_size=per_device, steps_per_generation=steps_per_generation)
    settings.update(num_generations=2, max_completion_length=5, max_steps=1)
    model = tiny_model("llama", len(tokenizer))
    trainer = tiny_grpo_trainer(model, tokenizer, tmp_path, ["Count to 3:", "Say hi:"], length_mod5_reward, **settings)
    linears = [m for m in trainer.model.modules() if packable(m)]
    generating, forwards, packings, served = [False], [], [], []
    for module in linears:
        module.register_forward_hook(
            lambda m, inputs, out: forwards.append((m, inputs[0].numel() // m.in_features)) if generating[0] else None
        )
    reorder = packed_linear._reorder
    monkeypatch.setattr(packed_linear, "_reorder", lambda *a: packings.append(a[2]) or reorder(*a))
    kernel = getattr(packed_linear, KERNEL[backend])
    monkeypatch.setattr(packed_linear, KERNEL[backend], lambda *a: served.append(1) or kernel(*a))
    single_turn = trainer._generate_single_turn

    def spy_single_turn(prompt_ids, *a, **k):
        generating[0] = True
        try:
            assert len(prompt_ids) == rows  # what upstream hands one generate call
            return single_turn(prompt_ids, *a, **k)
        finally:
            generating[0] = False

    trainer._generate_single_turn = spy_single_turn
    trainer.train()
    decode_rows = [m for m, n in forwards if n == rows]
    assert len(decode_rows) >= 2 * len(linears)  # at least two decode steps ran through every linear
    # oneDNN: every generation forward ran packed (the prefill too: its copy serves any row count); MKL: every forward
    # of the decoded row count, no other
    assert len(served) == len(forwards if backend == "onednn" else decode_rows)
    assert packings == [rows] * len({id(m) for m in decode_rows})  # each module packed once, for those rows
