"""Packed linear weights for CPU generation and evaluation (trl_ext.packed_linear, issue 31).

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
from datasets import Dataset

import trl_ext
from trl_ext import packed_linear
from trl_ext.eval import generate_completions
from trl_ext.packed_linear import PackedLinearWeights, choose_backend, cpu_vendor, packable, packing_blocker

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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_forward_gives_the_hand_worked_values(backend, monkeypatch):
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]])
    # rows: [1+2+1, 3+4-1, -1+0.5] = [4, 6, -0.5]; [2-2+1, 6-4-1, -2-0.5] = [1, 1, -2.5]
    expected = torch.tensor([[4.0, 6.0, -0.5], [1.0, 1.0, -2.5]])
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(rows_hint=6, backend=backend)
    with torch.no_grad(), packed.applied(layer):
        assert "forward" in layer.__dict__
        out = layer(x)
        out_3d = layer(x.unsqueeze(0).expand(3, 2, 2))  # 6 rows: the count MKL's copy was packed for
    assert torch.equal(out, expected)
    assert torch.equal(out_3d, expected.expand(3, 2, 3))
    assert len(calls) == (2 if backend == "onednn" else 1)  # MKL's copy serves only the rows it was packed for
    assert "forward" not in layer.__dict__ and len(packed) == 1  # forward restored; the packed copy kept


def test_the_backend_is_chosen_by_cpu_and_row_count(monkeypatch, tmp_path):
    intel, amd = tmp_path / "intel", tmp_path / "amd"
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n")
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert cpu_vendor(str(intel)) == "GenuineIntel" and cpu_vendor(str(amd)) == "AuthenticAMD"
    assert cpu_vendor(str(tmp_path / "missing")) is None
    monkeypatch.setattr(packed_linear, "_mkl_ops_available", lambda: True)
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert choose_backend(16) == "mkl" and PackedLinearWeights(rows_hint=16).backend == "mkl"
    assert choose_backend(None) == "onednn"  # MKL packs for one row count: none given
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert choose_backend(16) == "onednn"
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(packed_linear, "_mkl_ops_available", lambda: False)
    assert choose_backend(16) == "onednn"
    with pytest.raises(ValueError, match="backend='cublas'; expected 'mkl', 'onednn' or None"):
        PackedLinearWeights(rows_hint=4, backend="cublas")
    with pytest.raises(ValueError, match="give rows_hint"):
        PackedLinearWeights(backend="mkl")
    with pytest.raises(ValueError, match="no MKL packing ops"):  # asked for by name where it cannot run
        PackedLinearWeights(rows_hint=4, backend="mkl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_the_backend_refuses_keeps_the_plain_forward(backend, monkeypatch):
    layer = hand_linear()

    def refuse(*args):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(*REORDER[backend], refuse)
    packed = PackedLinearWeights(rows_hint=1, backend=backend)
    with torch.no_grad(), packed.applied(layer):
        assert "forward" not in layer.__dict__
        assert torch.equal(layer(torch.tensor([[1.0, 1.0]])), torch.tensor([[4.0, 6.0, -0.5]]))
    assert len(packed) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_case_the_packed_weight_cannot_serve_runs_the_plain_forward(backend, monkeypatch):
    layer = hand_linear()
    x = torch.tensor([[1.0, 1.0]])
    calls = spy(monkeypatch, backend)
    packed = PackedLinearWeights(rows_hint=1, backend=backend)
    with packed.applied(layer):
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
            # the weight changed after it was packed (an optimizer step): the new weight, by the plain forward
            layer.weight.mul_(2.0)
            assert torch.equal(layer(x), torch.tensor([[7.0, 13.0, -1.0]]))  # 2*[3, 7, -0.5] + [1, -1, 0]
            layer.weight.data = torch.zeros(3, 2)  # replaced storage
            assert torch.equal(layer(x), torch.tensor([[1.0, -1.0, 0.0]]))
            assert len(calls) == served
    with packed.applied(layer), torch.no_grad():  # the next use packs the new weight
        assert torch.equal(layer(x), torch.tensor([[1.0, -1.0, 0.0]]))
    assert len(calls) == served + 1


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
        packed = PackedLinearWeights(rows_hint=ids.numel(), backend=backend)  # MKL: packed for the 21 rows
        with packed.applied(model):
            ours = model(input_ids=ids).logits
    assert len(packed) == sum(1 for m in model.modules() if packable(m)) > 0
    assert calls  # the packed kernel ran (mixtral's experts see fewer rows: those run the plain forward)
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
    for backend in BACKENDS:
        monkeypatch.setattr(packed_linear, "choose_backend", lambda rows_hint, backend=backend: backend)
        calls = spy(monkeypatch, backend)
        ours = generate_completions(model, tok, prompts, 8, batch_size=2)
        assert ours == plain and all(ours) and calls, backend


def test_grpo_generation_packs_once_per_batch_and_releases_the_copies(tokenizer, tmp_path):
    def step(prepack):
        model = tiny_model("llama", len(tokenizer))
        args = trl_ext.GRPOConfig(
            output_dir=str(tmp_path / str(prepack)),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=6,
            max_steps=1,
            optim="sgd",
            learning_rate=0.1,
            report_to="none",
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            seed=0,
            temperature=1.5,
            dynamic_sampling=True,
            max_sampling_rounds=2,
            prepack_linear_weights=prepack,
        )
        tok = copy.deepcopy(tokenizer)
        tok.padding_side = "left"
        data = Dataset.from_dict({"prompt": ["Count to 3:", "Count to 4:", "Say hi:", "Add 1 and 2:"]})
        trainer = trl_ext.GRPOTrainer(
            model=model, reward_funcs=length_mod5_reward, args=args, train_dataset=data, processing_class=tok
        )
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
