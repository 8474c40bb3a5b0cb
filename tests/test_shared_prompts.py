"""trl_ext.speed.shared_prompts: each distinct prompt runs once, its key/value cache serves all of its completions.

Checked against the plain computation on tiny random GPT-2 (learned absolute positions) and Llama (rotary) models:
TRL's fused LM head log-probs and entropies, the gradients of every parameter, and sampled/greedy generation
(identical tokens). Rows are left-padded prompts of two lengths, each repeated, so both the grouping and the padding
are exercised; the two-level path (a prefix every row shares, then the distinct rest) is forced with a lower
threshold.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_gpt2
from tiny import tiny_model_for_tests
from trl.trainer.utils import add_fused_lm_head

from trl_ext.speed import shared_prompts
from trl_ext.speed.packing import canonical_order, forward_in_one_sequence, one_sequence_inputs
from trl_ext.speed.shared_prompts import (
    cache_argument,
    common_prefix_length,
    forward_with_shared_prompts,
    generate_with_shared_prompts,
    group_rows,
    prefill,
)


def test_group_rows_by_hand():
    ids = torch.tensor([[0, 5, 6], [7, 5, 6], [0, 5, 6], [7, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])  # last row: same ids, other mask
    first, inverse = group_rows(ids, mask)
    assert first.tolist() == [0, 1, 4]  # first row of each distinct (ids, mask), in order of appearance
    assert inverse.tolist() == [0, 1, 0, 1, 2]
    assert torch.equal(ids[first][inverse], ids) and torch.equal(mask[first][inverse], mask)


def test_group_rows_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"prompt_ids \(2, 3\) and prompt_mask \(2, 2\)"):
        group_rows(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))


def test_common_prefix_length_by_hand():
    ids = torch.tensor([[1, 2, 3, 9], [1, 2, 4, 9]])
    assert common_prefix_length(ids, torch.ones_like(ids)) == 2  # column 3 agrees again but is not a prefix
    assert common_prefix_length(ids, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])) == 0  # same id, one padded
    assert common_prefix_length(ids[:1], torch.ones(1, 4, dtype=torch.long)) == 4


@pytest.fixture(params=["gpt2", "llama"])
def model(request, tokenizer):
    model = tiny_gpt2(tokenizer) if request.param == "gpt2" else tiny_model_for_tests(tokenizer)
    return model.float().train()


def no_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


PADDED = [[11, 12, 13, 14, 15], [11, 12, 16]]  # 5 and 3 tokens: the second is left-padded, no aligned common prefix
COMMON_PREFIX = [[11, 12, 13, 14, 15], [11, 12, 16, 17, 18]]  # both 5 tokens, the first 2 shared


def batch(tokenizer, prompts, group_size=3):
    """Each prompt (left-padded to 5 tokens) x group_size, then 4 random completion tokens (the last row's
    completion ends early: right padding)."""
    pad = tokenizer.pad_token_id
    rows, masks = [], []
    g = torch.Generator().manual_seed(3)
    for prompt in prompts:
        for _ in range(group_size):
            completion = torch.randint(100, 400, (4,), generator=g).tolist()
            padding = 5 - len(prompt)
            rows.append([pad] * padding + prompt + completion)
            masks.append([0] * padding + [1] * (len(prompt) + 4))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    ids[-1, -1], mask[-1, -1] = pad, 0
    return ids, mask


def fused_outputs(model, ids, mask, completion_length, shared, pack=False, sequence=False):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion_length] = -100
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prompt_length = ids.size(1) - completion_length
    model.zero_grad()
    if sequence:
        out = forward_in_one_sequence(
            model, ids.size(1) - completion_length, ids, mask, positions, labels=labels, fused_lm_head=True
        )
    elif shared:
        out = forward_with_shared_prompts(
            model,
            prompt_length,
            ids,
            mask,
            positions,
            cache_name=cache_argument(model),
            labels=labels,
            fused_lm_head=True,
            pack=pack,
        )
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels, fused_lm_head=True)
    log_probs, entropy = out.log_probs[:, -completion_length:], out.entropy[:, -completion_length:]
    # any loss that weights tokens differently, so each parameter's gradient depends on every row
    weights = torch.linspace(0.5, 1.5, log_probs.numel()).view_as(log_probs)
    ((log_probs * weights * mask[:, -completion_length:]).sum() + entropy.sum() * 0.1).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), grads


@pytest.mark.parametrize(
    "prompts, expected",
    [
        # the 2 distinct prompts' first 4 columns, then 6 rows x (last prompt token + 4 completion tokens)
        (PADDED, [(2, 4), (6, 5)]),
        # the shared prefix for 1 row (2 columns), the 2 distinct prompts' next 2 columns, then the 6 rows
        (COMMON_PREFIX, [(1, 2), (2, 2), (6, 5)]),
    ],
)
def test_shared_forward_equals_plain_log_probs_entropies_and_gradients(
    model, tokenizer, monkeypatch, prompts, expected
):
    monkeypatch.setattr(shared_prompts, "MIN_SHARED_POSITIONS", 1)  # share any common prefix, however short
    model = no_dropout(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask = batch(tokenizer, prompts)
    calls = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    plain = fused_outputs(model, ids, mask, 4, shared=False)
    shared = fused_outputs(model, ids, mask, 4, shared=True)
    assert calls == [(6, 9)] + expected
    valid = mask[:, -4:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1][valid], plain[1][valid], atol=1e-5, rtol=1e-5)
    assert shared[2].keys() == plain[2].keys() and len(plain[2]) > 0
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_packed_forward_equals_plain_log_probs_entropies_and_gradients(model, tokenizer, monkeypatch):
    """Padding-free: the rows' real tokens in one sequence give the padded forward's log-probs, entropies and every
    gradient, with completions of 4, 4, 2, 4, 1 and 3 tokens (right padding after each end)."""
    monkeypatch.setattr(shared_prompts, "MIN_SHARED_POSITIONS", 1)
    model = no_dropout(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask = batch(tokenizer, PADDED)
    for row, kept in ((2, 2), (4, 1)):  # row 2 ends after 2 completion tokens, row 4 after 1 (row 5 after 3)
        ids[row, 5 + kept :], mask[row, 5 + kept :] = tokenizer.pad_token_id, 0
    calls = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    plain = fused_outputs(model, ids, mask, 4, shared=False)
    packed = fused_outputs(model, ids, mask, 4, shared=True, pack=True)
    # the 2 distinct prompts' first 4 columns, then one row of 6 last prompt tokens + 4 + 4 + 2 + 4 + 1 + 3 completion
    # tokens
    assert calls == [(6, 9), (2, 4), (1, 24)]
    valid = mask[:, -4:].bool()
    assert packed[0][~valid].eq(0).all() and packed[1][~valid].eq(0).all()  # padding: zeros, as TRL's fused head gives
    torch.testing.assert_close(packed[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1][valid], plain[1][valid], atol=1e-5, rtol=1e-5)
    assert packed[2].keys() == plain[2].keys() and len(plain[2]) > 0
    for name, grad in plain[2].items():
        torch.testing.assert_close(packed[2][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_distinct_prompts_run_the_plain_forward(tokenizer):
    model = tiny_model_for_tests(tokenizer)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert prefill(model, cache_argument(model), ids, torch.ones_like(ids)) is None  # nothing repeats: no cache


@pytest.mark.parametrize(
    "do_sample, prompts, expected",
    [
        # sampling groups of left-padded prompts: the 2 distinct prompts up to their last token, then 6 rows decode
        (True, PADDED, [(2, 4), (6, 1)]),
        # greedy evaluation of distinct prompts: their common prefix once, then each prompt's rest
        (False, COMMON_PREFIX, [(1, 2), (2, 2), (2, 1)]),
    ],
)
def test_generation_with_shared_prefill_gives_the_same_tokens(
    model, tokenizer, monkeypatch, do_sample, prompts, expected
):
    monkeypatch.setattr(shared_prompts, "MIN_SHARED_POSITIONS", 1)
    model = no_dropout(model).eval()
    ids, mask = batch(tokenizer, prompts)
    ids, mask = ids[:, :5], mask[:, :5]
    kwargs = dict(max_new_tokens=6, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id)
    if do_sample:
        kwargs["temperature"] = 1.5
    else:
        ids, mask = ids[::3], mask[::3]
    with torch.no_grad():
        torch.manual_seed(7)
        plain = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        shared_prompts.savings_decision(model)  # the once-per-model probe runs first, outside the recorded forwards
        prefills = []
        handle = model.register_forward_pre_hook(
            lambda m, a, kw: prefills.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        generate = generate_with_shared_prompts(model.generate, model, cache_argument(model), use_positions=True)
        torch.manual_seed(7)
        shared = generate(input_ids=ids, attention_mask=mask, **kwargs)
        handle.remove()
    assert torch.equal(shared, plain)
    # the prefill forwards, then generation's own first call: the last prompt token of every row
    assert prefills[: len(expected)] == expected


def test_generation_passes_other_model_inputs_through(tokenizer):
    model = tiny_model_for_tests(tokenizer).eval()
    seen = {}

    def fake_generate(**kwargs):
        seen.update(kwargs)
        return "plain"

    wrapped = generate_with_shared_prompts(fake_generate, model, cache_argument(model), use_positions=True)
    ids = torch.tensor([[5, 6, 7]] * 2)
    assert wrapped(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.zeros(2, 3)) == "plain"
    assert "cache" not in seen and "past_key_values" not in seen
    config = copy.deepcopy(model.generation_config)
    config.cache_implementation = "static"
    assert wrapped(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config) == "plain"
    assert seen.get(cache_argument(model)) is None


def test_training_noise_is_measured_again_only_when_a_dropout_rate_changes(tokenizer, monkeypatch):
    """Generation asks before every rollout; the two probe forwards run only when the answer can have changed."""
    from trl_ext.speed.shared_prompts import training_noise

    model = no_dropout(tiny_gpt2(tokenizer)).train()
    forwards = []
    model.register_forward_pre_hook(lambda m, args, kwargs: forwards.append(1), with_kwargs=True)
    assert training_noise(model) is None and len(forwards) == 2
    assert training_noise(model) is None and len(forwards) == 2  # remembered
    model.transformer.h[0].attn.attn_dropout.p = 0.1
    assert "transformer.h.0.attn.attn_dropout p=0.1" in training_noise(model) and len(forwards) == 4
    model.transformer.h[0].attn.attn_dropout.p = 0.0
    assert training_noise(model) is None and len(forwards) == 6
    model.config.hidden_dropout = 0.2  # a config field naming a dropout rate counts too (functional dropout)
    training_noise(model)
    assert len(forwards) == 8


def test_a_dropout_rate_held_by_a_module_attribute_counts_once_it_changes(tokenizer):
    """Llama's attention reads its rate from ``self_attn.attention_dropout`` at every forward (no Dropout module): set
    after the model was built, it makes the training forward random, and the remembered answer must not hide it."""
    from trl_ext.speed.shared_prompts import training_noise

    model = tiny_model_for_tests(tokenizer).train()
    forwards = []
    model.register_forward_pre_hook(lambda m, args, kwargs: forwards.append(1), with_kwargs=True)
    assert training_noise(model) is None and len(forwards) == 2
    model.model.layers[1].self_attn.attention_dropout = 0.3
    assert "model.layers.1.self_attn.attention_dropout=0.3" in training_noise(model) and len(forwards) == 4


def test_one_sequence_inputs_by_hand():
    """P = 3: the distinct prompts' first 2 columns (row 0 and 1 share one; row 2's is left-padded), then each row's
    last prompt token and completion (row 1's ends a token early). Which token sees which, worked out by hand."""
    ids = torch.tensor([[9, 5, 6, 7, 8], [9, 5, 6, 4, 0], [0, 5, 3, 2, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed_ids, packed_positions, sees, prompt_tokens = one_sequence_inputs(3, ids, mask, positions)
    assert prompt_tokens == 3
    assert packed_ids.tolist() == [9, 5, 5, 6, 7, 8, 6, 4, 3, 2, 1]
    assert packed_positions.tolist() == [0, 1, 0, 2, 3, 4, 2, 3, 1, 2, 3]
    expected = [
        {0},  # prompt A, column 0
        {0, 1},  # prompt A, column 1
        {2},  # prompt B (row 2's), its only real token
        {0, 1, 3},  # row 0: prompt A, then its own tokens up to itself
        {0, 1, 3, 4},
        {0, 1, 3, 4, 5},
        {0, 1, 6},  # row 1: prompt A too
        {0, 1, 6, 7},
        {2, 8},  # row 2: prompt B
        {2, 8, 9},
        {2, 8, 9, 10},
    ]
    assert [set(row.nonzero().flatten().tolist()) for row in sees] == expected


def test_canonical_order_sorts_any_order_of_the_same_rows_alike():
    ids = torch.tensor([[3, 1], [2, 9], [3, 1], [2, 5]])
    mask = torch.ones_like(ids)
    order = canonical_order(ids, mask)
    assert ids[order].tolist() == [[2, 5], [2, 9], [3, 1], [3, 1]]
    shuffled = torch.tensor([2, 3, 0, 1])
    assert torch.equal(ids[shuffled][canonical_order(ids[shuffled], mask)], ids[order])


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": True}, {"use_reentrant": False}])
def test_one_sequence_forward_equals_plain_log_probs_entropies_and_gradients(model, tokenizer, checkpointing):
    """Issue 41: the distinct prompts and every completion in ONE padding-free forward, no cache, give the padded
    forward's log-probs, entropies and every gradient -- with activation checkpointing on (both use_reentrant values:
    the training forward recomputes each layer in the backward) as without. Completions of 4, 4, 2, 4, 1 and 3
    tokens; two distinct prompts, one left-padded; the rows come in a shuffled order."""
    model = no_dropout(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    ids, mask = batch(tokenizer, PADDED)
    for row, kept in ((2, 2), (4, 1)):
        ids[row, 5 + kept :], mask[row, 5 + kept :] = tokenizer.pad_token_id, 0
    shuffle = torch.tensor([3, 0, 5, 1, 4, 2])
    ids, mask = ids[shuffle], mask[shuffle]
    calls = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    plain = fused_outputs(model, ids, mask, 4, shared=False)
    sequence = fused_outputs(model, ids, mask, 4, shared=False, sequence=True)
    # one forward of one row: prompt A's first 4 tokens, prompt B's 2 (left-padded to 5: 3 real, the last one in the
    # rows), then 6 last prompt tokens + 4 + 4 + 2 + 4 + 1 + 3 completion tokens
    assert calls == [(6, 9), (1, 4 + 2 + 24)]
    valid = mask[:, -4:].bool()
    assert sequence[0][~valid].eq(0).all() and sequence[1][~valid].eq(0).all()
    torch.testing.assert_close(sequence[0][valid], plain[0][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sequence[1][valid], plain[1][valid], atol=1e-5, rtol=1e-5)
    assert sequence[2].keys() == plain[2].keys() and len(plain[2]) > 0
    for name, grad in plain[2].items():
        torch.testing.assert_close(sequence[2][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    # the same rows in another order: the same computation, bit for bit
    again = fused_outputs(model, ids[shuffle], mask[shuffle], 4, shared=False, sequence=True)
    assert torch.equal(again[0], sequence[0][shuffle]) and torch.equal(again[1], sequence[1][shuffle])
