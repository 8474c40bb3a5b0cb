"""The architecture matrix (issue 18): one GRPO step with trl_ext's defaults against the same step with every speed
saving off (prompt sharing, row skipping, oneDNN-packed generation weights), on tiny random models of many
architectures (tests/architectures.py).

Either the savings are on and the step gives the same generated tokens, loss, entropy and updated weights (plain
SGD, so the update is lr x gradient) as the plain computation, or the trainer reports them off in one log line and
runs the plain computation. The expected decision of each architecture of ``FAST`` is written next to it; the slow
long tail runs every other causal-LM architecture transformers can build from the generic tiny config.

The matrix runs again with activation (gradient) checkpointing on -- TRL's default -- with both values of
``use_reentrant`` (issue 41): the training forward keeps no cache then, so the log-prob forwards share prompts in one
cache-free padding-free sequence (``trl_ext.speed.packing.forward_in_one_sequence``), checked against the plain step
with the same checkpointing.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from architectures import FAST, all_causal_lm_types, tiny_config, tiny_model
from conftest import length_mod5_reward
from tiny import tiny_grpo_trainer

from trl_ext.speed.shared_prompts import activation_checkpointing, training_noise

PLAIN = dict(share_prompt_cache=False, skip_zero_advantage_rows=False, prepack_linear_weights=False)
"""The options of the plain step every default step is checked against: every speed saving off."""

# What each FAST architecture is expected to do: "share" (both savings on) or the start of the reason sharing is off.
EXPECTED_SHARING = {
    "llama": "share",
    "llama:dynamic_rope": "rope_type 'dynamic'",
    "phi3:longrope": "rope_type 'longrope'",
    "gpt2": "share",
    "mistral": "share",
    "gemma3_text": "share",
    "mixtral": "share",
    "mpt": "mpt:",
    "bloom": "share",
    "lfm2": "its cache has Linear",
    "mamba2": "its cache has Linear",
    "qwen3_next": "its cache has Linear",
    "falcon_h1": "its cache has Linear",
}
# Where prompt sharing is on: "pack" (the padding-free completion forward too) or the start of why packing is off.
EXPECTED_PACKING = {
    "llama": "pack",
    "gpt2": "pack",
    "mistral": "its cache has DynamicSlidingWindowLayer layers",
    "gemma3_text": "its cache has DynamicSlidingWindowLayer layers",
    # TRL adds an MoE model's load-balancing loss, over every token of every row: the log-prob forwards run in full
    "mixtral": "the MoE load-balancing loss (router_aux_loss_coef=0.001)",
    "bloom": "attention implementation 'eager'",
}
SLOW_FAST = {"falcon_h1"}  # ~10 s to build on 2 cores


def one_step(model, tokenizer, tmp_path, before_train=None, **options):
    settings = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1)
    settings.update(learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", logging_steps=1, temperature=1.5)
    settings.update({"gradient_checkpointing": False, **options})
    prompts = ["Count to 3:", "Count to 4:"]
    trainer = tiny_grpo_trainer(model, tokenizer, tmp_path, prompts, length_mod5_reward, **settings)
    batches = []
    generate = trainer._generate_and_score_completions

    def ragged(inputs):
        # completions of 4, 3, 2, 4, ... tokens (as if they ended early): the padding-free forward meets right
        # padding, and the plain step runs on the same masks
        batch = generate(inputs)
        mask = batch["completion_mask"].clone()
        for row in range(mask.size(0)):
            mask[row, mask.size(1) - row % 3 :] = 0
        batch["completion_mask"] = mask
        batches.append(batch)
        return batch

    trainer._generate_and_score_completions = ragged
    if before_train is not None:
        before_train(trainer)
    trainer.train()
    return trainer, batches[0]


def gradient_forward_rows(model) -> list[int]:
    """Rows of each forward of ``model`` that runs with gradient (the training forwards; filled as they run)."""
    rows = []
    model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["input_ids"].size(0)) if torch.is_grad_enabled() else None, with_kwargs=True
    )
    return rows


CHECKPOINTED_PACKING_OFF = (
    "share_prompt_cache and pack_completions in the log-prob forwards off: gradient checkpointing keeps no cache in "
    "training, and the one-sequence forward that shares without one is not exact here ("
)
"""How the log line names the savings the training forward loses under checkpointing where packing is not exact."""


def check_architecture(name, tokenizer, tmp_path, caplog, expected=None, packing=None, checkpointing=None):
    """One step with the defaults against the plain step; ``checkpointing``: None (off), or the
    ``gradient_checkpointing_kwargs`` of TRL's ``gradient_checkpointing=True`` for both steps."""
    model = tiny_model(name, len(tokenizer))
    plain_model = copy.deepcopy(model)
    options = (
        {} if checkpointing is None else dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    )
    rows = gradient_forward_rows(model)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        ours, batch = one_step(model, tokenizer, tmp_path / "ours", **options)
    plain, plain_batch = one_step(plain_model, tokenizer, tmp_path / "plain", **PLAIN, **options)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_ext speed savings")]
    if checkpointing is not None:  # Trainer.train turned it on, and the training forwards ran under it
        assert activation_checkpointing(ours.model) and activation_checkpointing(plain.model)
    if expected is not None:
        if expected == "share" and packing == "pack":
            assert ours._share_prompts and ours._skip_zero_advantage and ours._pack and not lines, lines
            # the training forward ran packed: one row (with checkpointing, the prompts inside it: no cache)
            assert rows and set(rows) == {1}, rows
        elif expected == "share":
            moe = packing.startswith("the MoE")
            assert ours._share_prompts and ours._skip_zero_advantage != moe and not ours._pack, lines
            assert len(lines) == 1, lines
            if moe:  # generation shares; the training forward runs every row in full, none skipped
                assert f"share_prompt_cache and pack_completions in the log-prob forwards off: {packing}" in lines[0]
                assert f"skip_zero_advantage_rows off: {packing}" in lines[0], lines
                assert rows and set(rows) == {4}, rows
            elif checkpointing is None:
                assert f"pack_completions off: {packing}" in lines[0] and "share_prompt_cache" not in lines[0], lines
            else:  # generation still shares its prompt cache; the log-prob forwards run unshared
                assert CHECKPOINTED_PACKING_OFF + packing in lines[0], lines
                assert "share_prompt_cache off" not in lines[0], lines
        else:
            assert not ours._share_prompts and not ours._pack and len(lines) == 1, lines
            assert f"share_prompt_cache off: {expected}" in lines[0] and "pack_completions" not in lines[0], lines
    elif not ours._share_prompts:
        assert len(lines) == 1 and "share_prompt_cache off" in lines[0], lines
    # the same sampled tokens, rewards, loss, entropy and (SGD: lr x gradient) updated weights
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    torch.testing.assert_close(batch["advantages"], plain_batch["advantages"])
    ours_log, plain_log = ours.state.log_history[0], plain.state.log_history[0]
    assert ours_log["loss"] == pytest.approx(plain_log["loss"], abs=1e-5)
    assert ours_log["entropy"] == pytest.approx(plain_log["entropy"], abs=1e-4)
    for (n, p), (_, q) in zip(ours.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{name} {n}: {m}")
    return ours


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_FAST else n for n in FAST])
def test_defaults_equal_the_plain_step_or_report_themselves_off(name, tokenizer, tmp_path, caplog):
    check_architecture(name, tokenizer, tmp_path, caplog, EXPECTED_SHARING[name], EXPECTED_PACKING.get(name))


def _checkpointed_cases():
    """Every FAST architecture with both values of use_reentrant. Where prompt sharing is on both run by default;
    where the model rules sharing out (it is off with checkpointing or without: the same plain step), one value runs
    by default and the other is slow."""
    cases = []
    for index, name in enumerate(FAST):
        for reentrant in (True, False):
            slow = name in SLOW_FAST or (EXPECTED_SHARING[name] != "share" and reentrant != bool(index % 2))
            case = (name, reentrant)
            cases.append(pytest.param(*case, marks=pytest.mark.slow) if slow else case)
    return cases


@pytest.mark.parametrize("name, reentrant", _checkpointed_cases())
def test_with_gradient_checkpointing_the_defaults_equal_the_plain_step_or_report_themselves_off(
    name, reentrant, tokenizer, tmp_path, caplog
):
    """TRL's way: GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": ...}), for
    the defaults' step and the plain one. Architectures that pack without checkpointing pack with it (one
    cache-free sequence; no log line); the others run the log-prob forwards unshared, said in one line."""
    check_architecture(
        name,
        tokenizer,
        tmp_path,
        caplog,
        EXPECTED_SHARING[name],
        EXPECTED_PACKING.get(name),
        checkpointing={"use_reentrant": reentrant},
    )


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": False}])
def test_moe_without_its_load_balancing_loss_packs(checkpointing, tokenizer, tmp_path, caplog):
    """router_aux_loss_coef=0 (TRL then adds no load-balancing loss): an MoE model packs and skips like any other,
    with checkpointing or without, and its step equals the plain step."""
    options = dict(router_aux_loss_coef=0.0)
    if checkpointing is not None:
        options.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    model = tiny_model("mixtral", len(tokenizer))
    plain_model = copy.deepcopy(model)
    rows = gradient_forward_rows(model)
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        ours, batch = one_step(model, tokenizer, tmp_path / "ours", **options)
    plain, _ = one_step(plain_model, tokenizer, tmp_path / "plain", **PLAIN, **options)
    assert not ours.aux_loss_enabled and ours._share_prompts and ours._skip_zero_advantage and ours._pack
    assert "trl_ext speed savings" not in caplog.text and rows and set(rows) == {1}, rows
    assert ours.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"], abs=1e-5)
    for (n, p), (_, q) in zip(ours.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_turned_on_the_transformers_way_shares_in_one_sequence(reentrant, tokenizer, tmp_path, caplog):
    """transformers' way: ``model.gradient_checkpointing_enable(...)`` before the trainer is built, and the config's
    gradient_checkpointing False (Trainer.train leaves the model's own checkpointing on). The trainer sees it: the
    old and training forwards take the cache-free one-sequence path (two iterations: TRL computes old log-probs, with
    checkpointing switched off around them), and the step equals the plain step with the same checkpointing."""
    model = tiny_model("llama", len(tokenizer))
    plain_model = copy.deepcopy(model)
    for m in (model, plain_model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    rows = gradient_forward_rows(model)
    forwards = []
    model.register_forward_pre_hook(lambda m, a, kw: forwards.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    ours, batch = one_step(model, tokenizer, tmp_path / "ours", num_iterations=2, beta=0.0)
    plain, plain_batch = one_step(plain_model, tokenizer, tmp_path / "plain", num_iterations=2, beta=0.0, **PLAIN)
    assert not ours.args.gradient_checkpointing and activation_checkpointing(ours.model) and ours._checkpointing()
    assert ours._share_prompts and ours._pack and set(rows) == {1}, rows
    # the old log-probs' forward (in generation, on the completions as generated) and the training forward (on the
    # masks one_step shortened): one row each -- the prompt's tokens but its last (4 rows of one prompt), then each
    # row's last prompt token and completion
    sequence = (1, int(batch["prompt_mask"][0, :-1].sum()) + int(batch["completion_mask"].sum()) + 4)
    assert forwards[-2][0] == 1 and forwards[-1] == sequence, forwards
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    ours_log, plain_log = ours.state.log_history[0], plain.state.log_history[0]
    assert ours_log["loss"] == pytest.approx(plain_log["loss"], abs=1e-5)
    for (n, p), (_, q) in zip(ours.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": True}, {"use_reentrant": False}])
def test_lora_on_top_shares_and_equals_the_plain_step(checkpointing, tokenizer, tmp_path, caplog):
    from peft import LoraConfig, get_peft_model

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))

    options = (
        {} if checkpointing is None else dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    )
    model = lora(tiny_model("llama", len(tokenizer)))
    plain_model = copy.deepcopy(model)
    rows = gradient_forward_rows(model)
    ours, batch = one_step(model, tokenizer, tmp_path / "ours", **options)
    plain, plain_batch = one_step(plain_model, tokenizer, tmp_path / "plain", **PLAIN, **options)
    assert ours._share_prompts and ours._skip_zero_advantage and ours._pack and set(rows) == {1}, rows
    assert activation_checkpointing(ours.model) == (checkpointing is not None)
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    for (n, p), (_, q) in zip(ours.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_dropout_turns_both_savings_off_in_one_line_and_disable_dropout_keeps_them(tokenizer, tmp_path, caplog):
    model = tiny_model("gpt2", len(tokenizer))
    model.transformer.h[0].attn.attn_dropout.p = 0.1
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        noisy, _ = one_step(copy.deepcopy(model), tokenizer, tmp_path / "a")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_ext speed savings")]
    assert not noisy._share_prompts and not noisy._skip_zero_advantage
    assert len(lines) == 1 and "training forward is random (transformer.h.0.attn.attn_dropout p=0.1" in lines[0]
    assert "skip_zero_advantage_rows off" in lines[0]
    quiet, _ = one_step(model, tokenizer, tmp_path / "b", disable_dropout=True)
    assert quiet._share_prompts and quiet._skip_zero_advantage


def test_dropout_switched_on_after_construction_turns_every_saving_off_at_use(tokenizer, tmp_path):
    """Issue 30: the savings decision taken when the trainer was built must not outlive the model it was taken on.
    Built with dropout 0 (every saving on), then a dropout rate is set and one step trained: generation, the
    old/gradient forwards, packing and row skipping must all run the plain path -- the very forwards, in number and
    shape, of a trainer with the savings switched off -- and give its loss, gradient and weights (same random numbers:
    the same dropout masks)."""
    model = tiny_model("gpt2", len(tokenizer))

    def dropout_on(trainer):
        assert trainer._share_prompts or not trainer.args.share_prompt_cache  # built without noise: on
        trainer.model.transformer.h[0].attn.attn_dropout.p = 0.1
        assert "attn_dropout p=0.1" in training_noise(trainer.model)  # measured here (2 probe forwards), remembered
        trainer.forwards = []
        trainer.model.register_forward_pre_hook(
            lambda m, a, kw: trainer.forwards.append((*kw["input_ids"].shape, torch.is_grad_enabled())),
            with_kwargs=True,
        )
        torch.manual_seed(0)

    ours, batch = one_step(copy.deepcopy(model), tokenizer, tmp_path / "ours", before_train=dropout_on, beta=0.0)
    plain, plain_batch = one_step(model, tokenizer, tmp_path / "plain", before_train=dropout_on, beta=0.0, **PLAIN)
    # 2 prompts of 5 tokens x 2 completions of 4 tokens, unshared: generation prefills all 4 rows (not the 2 distinct
    # prompts) and decodes 3 more tokens; then one padded gradient forward of the 4 rows (not a prompt prefill and a
    # packed row); nothing else (beta 0, one iteration: no reference or old log-probs)
    expected = [(4, 5, False), (4, 1, False), (4, 1, False), (4, 1, False), (4, 9, True)]
    assert ours.forwards == plain.forwards == expected, ours.forwards
    assert ours.model.training and not (ours._share_prompts or ours._skip_zero_advantage or ours._pack)
    assert torch.equal(batch["completion_ids"], plain_batch["completion_ids"])
    # the loss of a first step is -mean(A) = 0 whatever the forward; its gradient is where dropout shows
    logged = [[(e["loss"], e["grad_norm"]) for e in t.state.log_history if "loss" in e] for t in (ours, plain)]
    assert logged[0] == logged[1] and logged[0][0][1] > 0, logged
    for p, q in zip(ours.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.long_tail
@pytest.mark.parametrize("model_type", [t for t in all_causal_lm_types() if t not in {n.split(":")[0] for n in FAST}])
def test_long_tail(model_type, tokenizer, tmp_path, caplog):
    try:
        tiny_config(model_type, len(tokenizer))
        tiny_model(model_type, len(tokenizer))
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"not built from the generic tiny config: {type(err).__name__}: {str(err)[:100]}")
    plain_ok = True
    try:
        one_step(tiny_model(model_type, len(tokenizer)), tokenizer, tmp_path / "probe", **PLAIN)
    except Exception as err:  # noqa: BLE001 -- upstream's plain path fails too: nothing for trl_ext to keep exact
        plain_ok = False
        pytest.skip(f"the plain GRPO step fails too: {type(err).__name__}: {str(err)[:100]}")
    if plain_ok:
        check_architecture(model_type, tokenizer, tmp_path, caplog)


@pytest.mark.parametrize("name", ["llama:dynamic_rope", "phi3:longrope"])
def test_length_dependent_rope_would_change_the_numbers_so_sharing_is_off(name):
    """Why the static rule exists: past the original context, the prompt alone (the shared prefill) picks another
    rotary table than the full sequence, so the shared forward is far from the plain one."""
    from trl_ext.speed.shared_prompts import forward_with_shared_prompts, savings_decision

    config = tiny_config(name, 64)
    config.initializer_range = 1.0  # large random weights: logits far from uniform, so position changes show
    if name.startswith("phi3"):
        config.original_max_position_embeddings = 12
    else:
        config.max_position_embeddings = 12
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).float().eval()
    ids = torch.randint(4, 64, (1, 10)).repeat(2, 1)  # one 10-token prompt, twice
    ids = torch.cat([ids, torch.randint(4, 64, (2, 8))], dim=1)  # + 8 completion tokens: 18 > 12
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, 9:], -1)
        shared = torch.log_softmax(forward_with_shared_prompts(model, 10, ids, mask).logits, -1)
    assert (plain - shared).abs().max() > 1e-3
    assert savings_decision(model).share_prompts.startswith(f"rope_type '{name.split(':')[1].split('_')[0]}")


def test_a_model_that_cannot_run_the_probe_batch_keeps_the_plain_path(tokenizer, monkeypatch):
    """The decision never raises: a model whose plain forward fails on the probe's random tokens (where the user's
    data might still run) turns both savings off, naming the error, and the trainer takes upstream's path."""
    from trl_ext.speed.shared_prompts import savings_decision

    model = tiny_model("llama", len(tokenizer))

    def broken(*args, **kwargs):
        raise RuntimeError("The size of tensor a (32) must match the size of tensor b (4)")

    monkeypatch.setattr(model, "forward", broken)
    decision = savings_decision(model)
    expected = (
        "the probe's plain forward failed (RuntimeError: The size of tensor a (32) must match the size of tensor b (4))"
    )
    assert decision.share_prompts == decision.skip_rows == expected
