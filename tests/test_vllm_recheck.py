"""vLLM (its CPU build here) re-checked on what the issue-45 bug harvest could not run: stop strings with
``min_tokens``, the sampling options' log-probs, the importance-sampling correction's modes and caps, and the
weight sync after a resume and with LoRA. Marked ``vllm`` (tests/conftest.py); ``scripts/vllm_cpu_check.sh`` runs
them. The engines, models and environment are tests/test_vllm.py's (its module docstring).

Each right value comes from outside trl_ext: vLLM's own stopping (what it returns) for the stop strings, a plain
forward of the policy with vLLM's documented logit processing for the sampling log-probs, and TRL 1.16's
documented formulas (``GRPOConfig.vllm_importance_sampling_mode``) for the correction.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

import pytest  # noqa: E402
import test_vllm  # noqa: E402
import torch  # noqa: E402
from test_vllm import (  # noqa: E402
    PROMPT,
    TOLERANCE,
    Recorder,
    fixed_completion,
    independent_completion_log_probs,
    policy_log_probs,
    rollout,
    vllm_trainer,
)

from trl_ext.stop_strings import cut_at_stop, find_stop  # noqa: E402

pytestmark = pytest.mark.vllm
vllm_model_dir = test_vllm.vllm_model_dir  # the fixture: tests/test_vllm.py's tiny model of head size 32


@pytest.fixture(scope="module")
def engine_trainer(vllm_model_dir, tokenizer, tmp_path_factory):
    """A float32 policy and a float32 engine (the default vllm_dtype='policy'): the same weights on both sides."""
    return vllm_trainer(vllm_model_dir, tokenizer, tmp_path_factory.mktemp("engine"), max_steps=1)


# --------------------------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_vllm_stops_where_cut_at_stop_says_with_min_tokens(engine_trainer, min_tokens):
    """vLLM's own stopping is the oracle: every completion it ended at a stop string is cut by ``cut_at_stop`` at
    exactly its last token, and no other is cut. Stop strings are frequent letters, so that the random model writes
    some within the first ``min_tokens`` tokens (asserted: the rule is exercised where it matters)."""
    from vllm import SamplingParams

    trainer = engine_trainer
    tok = trainer.processing_class
    stops = ["e", "a"]
    params = SamplingParams(
        n=64, temperature=1.0, max_tokens=8, min_tokens=min_tokens, stop=stops, include_stop_str_in_output=True, seed=1
    )
    outputs = trainer.vllm_generation.llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    held_back = 0
    for out in outputs:
        ids = list(out.token_ids)
        cut = cut_at_stop(ids, tok, stops, min_tokens)
        if out.stop_reason in stops:
            assert cut is not None and cut.num_tokens == len(ids), (ids, out.text, out.stop_reason)
            assert cut.text == out.text
        else:
            assert cut is None, (ids, out.text, out.finish_reason, out.stop_reason)
        if min_tokens and find_stop(tok.decode(ids[:min_tokens], skip_special_tokens=True), stops) is not None:
            held_back += 1
    assert sum(out.stop_reason in stops for out in outputs) > 8
    assert held_back > 0 or not min_tokens


# ------------------------------------------------------------------------------------------ sampling log-probs
def processed_log_probs(logits, seen, temperature, top_p, top_k, min_p, repetition_penalty) -> torch.Tensor:
    """(V,) log-probs of the distribution vLLM samples from (vllm/v1/sample/sampler.py, ``processed_logprobs``):
    repetition penalty on every prompt and output token seen (positive logits divided, negative multiplied), then
    temperature, then min_p (tokens below min_p x the top probability out), then top_k, then top_p (the smallest
    top set whose probability reaches top_p)."""
    logits = logits.double().clone()
    if repetition_penalty != 1.0:
        idx = torch.tensor(sorted(seen))
        logits[idx] = torch.where(logits[idx] > 0, logits[idx] / repetition_penalty, logits[idx] * repetition_penalty)
    logits = logits / temperature
    if min_p > 0:
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.max()] = -float("inf")
    if top_k > 0:
        logits[logits < logits.topk(top_k).values[-1]] = -float("inf")
    if top_p < 1.0:
        sorted_logits, order = logits.sort()
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        logits[order[drop]] = -float("inf")
    return logits.log_softmax(-1)


OPTIONS = {
    "temperature": dict(temperature=0.7),
    "top_p": dict(top_p=0.5),
    "top_k": dict(top_k=20),
    "min_p": dict(min_p=0.9),
    "repetition_penalty": dict(repetition_penalty=20.0),  # the random model's logits are near 0: a large penalty
    "all": dict(temperature=0.8, top_p=0.7, top_k=200, min_p=0.5, repetition_penalty=1.3),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_vllms_sampling_log_probs_are_the_processed_distribution_of_the_policy(engine_trainer, name):
    """What TRL 1.16 gets from vLLM as ``sampling_per_token_logps`` (``logprobs_mode="processed_logprobs"``) is the
    log-prob under the processed distribution of the policy's own logits; the trainer's recompute
    (``old_per_token_logps``) is the temperature-scaled log-softmax only (TRL's ``_get_per_token_logps``): under
    top_p, top_k, min_p or a repetition penalty the two differ by design, and TRL's importance-sampling correction
    carries the difference."""
    from vllm import SamplingParams

    trainer = engine_trainer
    option = {**dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0), **OPTIONS[name]}
    prompt_ids, _ = fixed_completion(trainer.processing_class)
    params = SamplingParams(n=4, max_tokens=6, logprobs=0, seed=0, **option)
    outputs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    moved, error = 0.0, 0.0
    for out in outputs[0].outputs:
        completion = list(out.token_ids)
        engine = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, completion)], dtype=torch.float64)
        ids = torch.tensor([prompt_ids + completion])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        expected, plain = [], []
        for t, token in enumerate(completion):
            seen = set(prompt_ids + completion[:t])
            expected.append(processed_log_probs(logits[t], seen, **option)[token])
            plain.append(torch.log_softmax(logits[t].double() / option["temperature"], -1)[token])
        expected, plain = torch.stack(expected), torch.stack(plain)
        assert (engine - expected).abs().max() < TOLERANCE, (name, engine, expected)
        error = max(error, (engine - expected).abs().max().item())
        moved = max(moved, (expected - plain).abs().max().item())
    if name == "temperature":
        assert moved < 1e-9  # temperature alone: vLLM's and the trainer's log-probs are the same quantity
    else:
        # the option changed the sampled distribution by far more than vLLM's agreement with the formula: it bites
        assert moved > 10 * error and moved > 1e-5, (name, moved, error)

    # through the trainer: its recompute is the temperature-only log-softmax of the same tokens, whatever the
    # engine's processing. (TRL 1.16 bakes the temperature into its fused LM head when the trainer is built, so
    # only the processing options are changed here, on the engine's side.)
    if name in ("temperature", "all"):
        return
    saved = {k: getattr(trainer.vllm_generation, k) for k in option}
    for k, v in option.items():
        setattr(trainer.vllm_generation, k, v)
    try:
        inputs = rollout(trainer)
    finally:
        for k, v in saved.items():
            setattr(trainer.vllm_generation, k, v)
    mask = inputs["completion_mask"].bool()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, :-1]
    own = torch.log_softmax(logits.float() / option["temperature"], -1).gather(-1, ids[:, 1:, None])[..., 0]
    own = own[:, -inputs["completion_ids"].size(1) :]
    torch.testing.assert_close(inputs["old_per_token_logps"][mask], own[mask], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ importance-sampling correction
@pytest.fixture(scope="module")
def bf16_engine_trainer(vllm_model_dir, tokenizer, tmp_path_factory):
    """A float32 policy sampled by a bfloat16 engine: the importance-sampling ratios are not 1."""
    return vllm_trainer(
        vllm_model_dir, tokenizer, tmp_path_factory.mktemp("bf16_engine"), vllm_dtype="bfloat16", max_steps=1
    )


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, "max"), ("min", "max"), ("min", None)])
def test_importance_sampling_modes_and_caps_as_trl_documents_them(bf16_engine_trainer, mode, bounds):
    """TRL 1.16's ``vllm_importance_sampling_mode``: ratio exp(trainer - engine log-prob) per token (``token_*``) or
    exp of the per-sequence sum (``sequence_*``), clipped to [C_min, C_max] (``*_truncate``) or 0 outside it
    (``*_mask``); the loss is GRPO-Clip times that ratio. The bounds sit inside the measured ratios, so each one
    bites (asserted)."""
    trainer = bf16_engine_trainer
    args = trainer.args
    inputs = rollout(trainer)  # the default correction, to read the ratios and place the bounds
    mask = inputs["completion_mask"].float()
    diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask
    raw = torch.exp(diff.sum(1, keepdim=True)) if mode.startswith("sequence") else torch.exp(diff)
    values = raw.flatten() if mode.startswith("sequence") else raw[mask.bool()]
    low, high = values.quantile(0.25).item(), values.quantile(0.75).item()
    c_min = low if bounds[0] else None
    c_max = high if bounds[1] else None
    saved = (trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min)
    saved_max = trainer.vllm_importance_sampling_clip_max
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = c_min, c_max
    try:
        torch.manual_seed(0)
        inputs = rollout(trainer)
        loss = trainer._compute_loss(trainer.model, dict(inputs)).detach()
        new = independent_completion_log_probs(trainer.model, inputs)
    finally:
        trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min = saved
        trainer.vllm_importance_sampling_clip_max = saved_max
    mask = inputs["completion_mask"].float()
    diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask
    raw = torch.exp(diff.sum(1, keepdim=True)) if mode.startswith("sequence") else torch.exp(diff)
    lo = -float("inf") if c_min is None else c_min
    hi = float("inf") if c_max is None else c_max
    if mode.endswith("truncate"):
        expected_ratio = raw.clamp(min=lo, max=hi)
    else:
        expected_ratio = torch.where((raw < lo) | (raw > hi), 0.0, raw)
    outside = ((raw < lo) | (raw > hi)) & (mask.bool() if not mode.startswith("sequence") else True)
    assert outside.any(), "the bounds bite on this rollout"
    torch.testing.assert_close(inputs["importance_sampling_ratio"], expected_ratio, atol=1e-6, rtol=1e-5)
    weights = inputs["advantages"][:, None]
    ratio = torch.exp(new - inputs["old_per_token_logps"])
    per_token = -torch.minimum(ratio * weights, ratio.clamp(1 - args.epsilon, 1 + args.epsilon) * weights)
    per_token = per_token * expected_ratio
    expected = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)


def test_the_deprecated_cap_is_clip_max(tmp_path):
    """``vllm_importance_sampling_cap`` (deprecated in TRL 1.6) sets ``vllm_importance_sampling_clip_max``."""
    import trl_ext

    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        args = trl_ext.GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_cap=1.5, use_cpu=True)
    assert args.vllm_importance_sampling_clip_max == 1.5


# --------------------------------------------------------------------------------------- weight sync: resume, LoRA
def test_weights_reach_vllm_after_a_resume_from_a_checkpoint(vllm_model_dir, tokenizer, tmp_path):
    """Train 2 steps with a checkpoint at step 2, then a new trainer (a new engine, built from the base checkpoint)
    resumes from it: its first generation must sample from the resumed weights, not the base model's."""
    first = vllm_trainer(vllm_model_dir, tokenizer, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    del first
    trainer = vllm_trainer(vllm_model_dir, tokenizer, tmp_path, max_steps=3, save_strategy="no")
    prompt_ids, completion_ids = fixed_completion(tokenizer)
    base = policy_log_probs(trainer.model, prompt_ids, completion_ids)  # the base weights, before the resume loads
    recorder = Recorder(trainer, prompt_ids, completion_ids)
    resumed = []
    from transformers import TrainerCallback

    class OnTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            resumed.append(policy_log_probs(trainer.model, prompt_ids, completion_ids))

    trainer.add_callback(OnTrainBegin())
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(recorder.engine) == 1 and len(resumed) == 1
    assert (resumed[0] - base).abs().max() > 100 * TOLERANCE  # the checkpoint's weights are not the base's
    assert (recorder.engine[0] - resumed[0]).abs().max() < TOLERANCE, "the engine sampled from the base weights"


def test_weights_reach_vllm_with_lora(vllm_model_dir, tokenizer, tmp_path, monkeypatch):
    """With a LoRA adapter the engine holds the merged weights (base + B A x scale) after each sync."""
    import functools

    from peft import LoraConfig

    import trl_ext

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    monkeypatch.setattr(trl_ext, "GRPOTrainer", functools.partial(trl_ext.GRPOTrainer, peft_config=lora))
    trainer = vllm_trainer(vllm_model_dir, tokenizer, tmp_path, max_steps=2, learning_rate=5e-2)
    assert hasattr(trainer.model, "peft_config")
    prompt_ids, completion_ids = fixed_completion(tokenizer)
    start = policy_log_probs(trainer.model, prompt_ids, completion_ids)
    recorder = Recorder(trainer, prompt_ids, completion_ids)
    trainer.train()
    assert len(recorder.engine) == 2 and len(recorder.policy) == 2
    for k, (engine, policy) in enumerate(zip(recorder.engine, [start, *recorder.policy])):
        assert (engine - policy).abs().max() < TOLERANCE, f"generation {k}: the engine is not the LoRA policy"
    assert (recorder.engine[1] - recorder.engine[0]).abs().max() > 100 * TOLERANCE  # the adapter moved
