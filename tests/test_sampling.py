"""torch.multinomial's draws, vectorised (trl_ext.speed.sampling, issue 31): the same tokens, the same random numbers
and the same generator state afterwards as PyTorch's own ``torch.multinomial(probs, 1)``, checked against PyTorch
itself; every call the replica cannot serve identically goes to PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch

import trl_ext.logs
from trl_ext.speed import sampling
from trl_ext.speed.sampling import multinomial, probe, same_draws_multinomial


@pytest.mark.parametrize("shape", [(16, 49152), (1, 5), (3, 1000), (64, 3)])
@pytest.mark.parametrize("seed", [0, 7, 123])
def test_the_replica_draws_what_torch_multinomial_draws(shape, seed):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    probs = torch.softmax(logits, dim=-1)
    probs[0, : shape[1] // 2] = 0.0  # top-k/top-p style zeros in one row
    torch.manual_seed(seed)
    expected = torch.multinomial(probs, 1)
    state, after = torch.get_rng_state(), torch.rand(3)
    torch.manual_seed(seed)
    ours = multinomial(probs)
    assert torch.equal(ours, expected) and ours.dtype == torch.int64 and ours.shape == (shape[0], 1)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(torch.rand(3), after)


def test_the_replica_follows_the_distribution_it_is_given():
    # independent of torch.multinomial: frequencies of 20,000 draws from p = (0.1, 0.2, 0.7) within 4 sigma
    probs = torch.tensor([[0.1, 0.2, 0.7]]).expand(20000, 3).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(multinomial(probs).squeeze(1), minlength=3).double() / 20000
    sigma = (torch.tensor([0.1, 0.2, 0.7]) * torch.tensor([0.9, 0.8, 0.3]) / 20000).sqrt().double()
    assert ((counts - torch.tensor([0.1, 0.2, 0.7]).double()).abs() < 4 * sigma).all(), counts


def test_inside_the_block_every_call_gives_torchs_result_and_errors():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    original = torch.multinomial
    calls = []
    replica = sampling.multinomial
    with same_draws_multinomial():
        assert torch.multinomial is not original
        sampling.multinomial = lambda p, g=None, w=None: calls.append(1) or replica(p, g, w)
        try:
            torch.manual_seed(3)
            ours = torch.multinomial(probs, num_samples=1)
            torch.manual_seed(3)
            several = torch.multinomial(probs, 3)  # several samples: PyTorch's
            torch.manual_seed(3)
            with_replacement = torch.multinomial(probs, 1, True)  # one sample: served either way
            one_d = torch.multinomial(probs[0], 1)
            gen = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
            with pytest.raises(RuntimeError):
                torch.multinomial(torch.zeros(2, 5), 1)  # PyTorch's own error: sum of probabilities <= 0
            with pytest.raises(RuntimeError):
                torch.multinomial(torch.tensor([[0.5, float("nan")]]), 1)
        finally:
            sampling.multinomial = replica
    assert torch.multinomial is original
    assert len(calls) == 2  # the one-sample calls only
    torch.manual_seed(3)
    assert torch.equal(ours, original(probs, 1))
    torch.manual_seed(3)
    assert torch.equal(several, original(probs, 3))
    torch.manual_seed(3)
    assert torch.equal(with_replacement, original(probs, 1, True))
    assert one_d.shape == (1,) and gen.shape == (4, 1)


def test_a_pytorch_that_draws_otherwise_keeps_its_own_multinomial(monkeypatch, caplog):
    monkeypatch.setattr(sampling, "_probe_result", False)
    monkeypatch.setattr(sampling, "multinomial", lambda p, g=None, w=None: torch.zeros(p.shape[0], 1, dtype=torch.long))
    state = torch.get_rng_state()
    assert "other random numbers" in probe()
    assert torch.equal(torch.get_rng_state(), state)  # the probe leaves the generator as it found it
    monkeypatch.setattr(trl_ext.logs, "SAID", set())  # the sampler's message said anew
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        for _ in range(2):
            with same_draws_multinomial():
                assert torch.multinomial is torch._C._VariableFunctions.multinomial
    assert sum("vectorised sampling off" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(sampling, "_probe_result", False)


def _views() -> dict[str, torch.Tensor]:
    """Non-contiguous (B, V) probability tensors, as a caller may hand them to torch.multinomial."""
    g = torch.Generator().manual_seed(5)

    def probs(*shape, dim=-1):
        return torch.softmax(torch.randn(shape, generator=g) * 3, dim=dim)

    nchw = probs(2, 37, 3, 3, dim=1)  # (N, V, H, W): a distribution over V per pixel
    return {
        "transposed": probs(500, 6, dim=0).t(),
        "strided slice": probs(11, 900)[1::3, ::2],
        "expanded": probs(1, 300).expand(4, 300),
        "last position of (B, T, V)": probs(3, 5, 400)[:, -1, :],
        "channels-last columns": nchw.contiguous(memory_format=torch.channels_last)[:, :, 1, 2],
        "column-major slice": probs(300, 8, dim=0).t()[::2, 10:],
    }


@pytest.mark.parametrize("name", list(_views()))
@pytest.mark.parametrize("seed", [0, 1, 99])
def test_a_non_contiguous_probability_tensor_gets_torchs_draws(name, seed):
    # issue 37: the replica drew other tokens than torch.multinomial for a transposed tensor. PyTorch allocates its
    # variates with at::empty_like(probs) (aten/src/ATen/native/Distributions.cpp), the input's strides, and the
    # generator fills them in memory order; torch.multinomial itself is the oracle here
    probs = _views()[name]
    assert not probs.is_contiguous()
    torch.manual_seed(seed)
    expected = torch.multinomial(probs, 1)
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    with same_draws_multinomial():
        ours = torch.multinomial(probs, 1)
    assert torch.equal(ours, expected) and torch.equal(torch.get_rng_state(), state)
    private = torch.Generator().manual_seed(seed)  # and on a private generator, as the probe checks
    expected_private = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(multinomial(probs, private), expected_private)


def test_inside_the_block_a_non_contiguous_tensor_is_served_by_the_replica():
    probs = _views()["transposed"]
    calls = []
    replica = sampling.multinomial
    with same_draws_multinomial():
        sampling.multinomial = lambda p, g=None, w=None: calls.append(1) or replica(p, g, w)
        try:
            torch.manual_seed(4)
            ours = torch.multinomial(probs, 1)
        finally:
            sampling.multinomial = replica
    torch.manual_seed(4)
    assert calls == [1] and torch.equal(ours, torch.multinomial(probs, 1))


def test_a_replica_that_ignores_the_layout_is_caught_by_the_probe(monkeypatch):
    # the replica as it was before issue 37: variates in row-major order whatever the input's strides
    def row_major(like, generator=None, workspace=None):
        u = torch.empty(like.shape, dtype=torch.float64).uniform_(generator=generator)
        return torch.log1p(u.neg_()).neg_().to(torch.float32)

    monkeypatch.setattr(sampling, "_probe_result", False)
    monkeypatch.setattr(sampling, "_exponential_variates", row_major)
    reason = probe()
    assert "other random numbers" in reason and "strides (1, " in reason
    monkeypatch.setattr(sampling, "_probe_result", False)


def test_a_block_of_draws_in_one_workspace_is_torchs_sequence_of_draws():
    # a decode loop: the same (B, V) drawn again and again, then other shapes and layouts in between and back; the
    # workspace's buffers are reused (the draws of one step must not leak into the next) and every draw, and the
    # generator's state after the block, are PyTorch's own sequence
    views = _views()
    g = torch.Generator().manual_seed(8)
    steps = [torch.softmax(torch.randn(16, 4099, generator=g) * 3, dim=-1) for _ in range(4)]
    steps[2][3, :2000] = 0.0  # a row cut by top-k
    sequence = steps + [views["transposed"], steps[0], views["expanded"], views["expanded"], steps[1]]
    torch.manual_seed(21)
    expected = [torch.multinomial(p, 1) for p in sequence]
    state = torch.get_rng_state()
    torch.manual_seed(21)
    with same_draws_multinomial():
        ours = [torch.multinomial(p, 1) for p in sequence]
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))
    assert torch.equal(torch.get_rng_state(), state)


def test_a_workspace_keeps_its_buffers_for_one_shape_and_layout():
    workspace = sampling.Workspace()
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    first = [b.data_ptr() for b in workspace.buffers(probs)]
    assert [b.data_ptr() for b in workspace.buffers(probs.clone())] == first  # same shape and strides: reused
    transposed = torch.softmax(torch.randn(50, 3), dim=0).t()
    u, variates = workspace.buffers(transposed)
    assert u.dtype == torch.float64 and variates.dtype == torch.float32
    assert u.stride() == transposed.stride() == torch.empty_like(transposed, dtype=torch.float64).stride()
    g = torch.Generator().manual_seed(2)
    # the variates written into the buffer are those of a fresh draw
    fresh = sampling._exponential_variates(transposed, torch.Generator().manual_seed(2))
    assert torch.equal(sampling._exponential_variates(transposed, g, workspace), fresh)


_INF, _NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "row, valid",
    [
        ([0.2, 0.8, 0.0], True),
        ([0.0, 0.0, 0.0], False),  # sum 0
        ([0.5, _NAN, 0.5], False),
        ([0.5, _INF, 0.5], False),
        ([0.5, -_INF, 0.5], False),
        ([0.5, -1e-30, 0.5], False),  # negative
        ([-0.0, 1.0, 0.0], True),  # negative zero is not negative
        ([3e38, 3e38, 0.0], False),  # finite entries whose float32 sum overflows: refused, PyTorch's path draws
        ([1e-45, 0.0, 0.0], True),  # a denormal sum is still positive
    ],
)
def test_the_check_sends_exactly_the_rows_the_replica_cannot_serve_to_pytorch(row, valid):
    probs = torch.tensor([[0.1, 0.2, 0.7], row])
    assert sampling._valid(probs) is valid
    # what the old three-pass check said, except for the overflowing sum it now leaves to PyTorch
    old = bool(torch.isfinite(probs).all() and (probs >= 0).all() and (probs.sum(-1) > 0).all())
    assert old == (valid or row == [3e38, 3e38, 0.0])
    torch.manual_seed(5)
    try:
        expected = torch.multinomial(probs, 1)
    except RuntimeError:
        expected = None
    torch.manual_seed(5)
    with same_draws_multinomial():
        if expected is None:
            with pytest.raises(RuntimeError):
                torch.multinomial(probs, 1)
        else:
            assert torch.equal(torch.multinomial(probs, 1), expected)
