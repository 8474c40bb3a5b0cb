"""Generation options that prompt sharing cannot honour turn sharing off for that call (one log line) and give what
the plain path gives: in GRPO's rollouts (generation_kwargs, cache_implementation) and in trl_ext.eval."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from architectures import tiny_model
from test_architectures import one_step

from trl_ext.eval import generate_completions
from trl_ext.speed.shared_prompts import generation_blocker


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"num_return_sequences": 2}, "num_return_sequences=2"),
        ({"cache_implementation": "dynamic"}, "cache_implementation='dynamic'"),
        ({"use_cache": False}, "use_cache=False"),
        ({"prefill_chunk_size": 4}, "prefill_chunk_size=4"),
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens (assisted generation)"),
        ({"do_sample": True, "top_k": 5}, None),
    ],
)
def test_generation_blocker_names_the_option(options, expected):
    assert generation_blocker(None, options) == expected


@pytest.mark.parametrize(
    "options",
    [
        dict(generation_kwargs={"num_beams": 2}),
        dict(cache_implementation="dynamic"),
        dict(generation_kwargs={"use_cache": False}),
    ],
    ids=["num_beams", "cache_implementation", "use_cache"],
)
def test_grpo_with_generation_options_trains_like_the_plain_path(options, tokenizer, tmp_path, caplog):
    model = tiny_model("llama", len(tokenizer))
    plain_model = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        ours, batch = one_step(model, tokenizer, tmp_path / "ours", **options)
    plain, plain_batch = one_step(plain_model, tokenizer, tmp_path / "plain", share_prompt_cache=False, **options)
    lines = [
        r.getMessage()
        for r in caplog.records
        if "prompt sharing in generation off: this generate call has" in r.getMessage()
    ]
    assert len(lines) == 1, lines  # once, not once per call
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    for (n, p), (_, q) in zip(ours.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("field, value", [("cache_implementation", "dynamic"), ("num_beams", 2)])
def test_eval_with_generation_config_options_equals_plain_generate(field, value, tokenizer):
    model = tiny_model("llama", len(tokenizer)).eval()
    setattr(model.generation_config, field, value)
    system = [{"role": "system", "content": "You are a careful assistant who answers with one number. " * 6}]
    prompts = [system + [{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3)]
    ours = generate_completions(model, tokenizer, prompts, max_new_tokens=4, batch_size=3, disable_progress=True)
    model.generate = model.generate  # the plain generate, bound: what generate_completions calls without sharing
    from trl_ext.data import prompt_token_ids

    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": [prompt_token_ids(tokenizer, p) for p in prompts]}, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert ours == tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
