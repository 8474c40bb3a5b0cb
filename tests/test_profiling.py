"""trl_ext.measurement.profiling: exclusive per-phase timing, the breakdown's keys and sums; bf16 autocast keeps the RL
math fp32."""

import copy
import dataclasses

import pytest
import torch
from conftest import CPU_TEST_ARGS
from datasets import Dataset

import trl_ext
from trl_ext import functional
from trl_ext.measurement import profiling
from trl_ext.measurement.profiling import PhaseTimer, StepProfiler, time_breakdown
from trl_ext.objective import losses


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_nested_phases_are_exclusive(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(profiling.time, "perf_counter", clock)
    timer = PhaseTimer()
    with timer.phase("outer"):
        clock.now += 2.0
        with timer.phase("inner"):
            clock.now += 3.0
        clock.now += 1.0
    with timer.phase("inner"):
        clock.now += 0.5
    # outer ran 6 s of which 3 s were inner: 3 s exclusive; inner 3 + 0.5
    assert timer.seconds == {"outer": 3.0, "inner": 3.5}
    assert timer.calls == {"outer": 1, "inner": 2}


def test_seconds_added_inside_a_phase_are_not_that_phases(monkeypatch):
    # an interval measured by hand (the optimizer step, train()'s remainder) while a recipe's phase runs
    clock = FakeClock()
    monkeypatch.setattr(profiling.time, "perf_counter", clock)
    timer = PhaseTimer()
    with timer.phase("sft"):
        clock.now += 10.0
        timer.add("optimizer", 4.0)  # 4 of the 10 s were the optimizer's
    timer.add("train_other", 1.0)  # outside any phase: charged to itself only
    assert timer.seconds == {"sft": 6.0, "optimizer": 4.0, "train_other": 1.0}
    assert sum(timer.seconds.values()) == 11.0  # never more than the wall time the phases covered


def test_time_breakdown_order_other_and_total():
    timer = PhaseTimer()
    for name, seconds in (("backward", 4.0), ("generation", 10.0), ("evaluation", 6.0), ("model_load", 1.0)):
        timer.add(name, seconds)
    out = time_breakdown(timer, total_seconds=25.0)
    assert list(out) == ["model_load", "evaluation", "generation", "backward", "other", "total"]
    assert out["other"] == 4.0 and out["total"] == 25.0  # 25 - (1 + 6 + 10 + 4)
    assert "generation" in profiling.format_breakdown(out) and "40.0%" in profiling.format_breakdown(out)


def test_a_recipe_breakdown_opens_with_startup_and_closes_with_finish():
    timer = PhaseTimer()
    for name, seconds in (("finish", 2.5), ("generation", 10.0), ("startup", 6.0), ("my_phase", 1.5)):
        timer.add(name, seconds)
    out = time_breakdown(timer, total_seconds=30.0)
    assert list(out) == ["startup", "generation", "my_phase", "finish", "other", "total"]
    assert out["other"] == 10.0 and out["total"] == 30.0  # 30 - (6 + 10 + 1.5 + 2.5)


def _toy_trainer(tiny_model, tokenizer, tmp_path, **overrides):
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    dataset = Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(8)])
    settings = dict(CPU_TEST_ARGS, per_device_train_batch_size=4, num_generations=4, max_completion_length=6)
    settings.update(overrides)
    args = trl_ext.GRPOConfig(output_dir=str(tmp_path), **settings)

    def reward(completions, **kwargs):
        return [float(len(c) % 5) for c in completions]

    return trl_ext.GRPOTrainer(
        model=tiny_model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tok
    )


def test_step_profiler_covers_every_train_phase(tiny_model, tokenizer, tmp_path):
    trainer = _toy_trainer(tiny_model, tokenizer, tmp_path, max_steps=2)
    profiler = StepProfiler().attach(trainer)
    trainer.train()
    seconds = profiler.timer.seconds
    for phase in ("generation", "reward", "logprob_forward", "backward", "optimizer", "train_other"):
        assert seconds[phase] > 0, phase
    # one generation / reward / forward / backward per optimizer step at these settings; clipping + step = 1 call
    calls = profiler.timer.calls
    assert (calls["generation"], calls["reward"], calls["logprob_forward"], calls["backward"], calls["optimizer"]) == (
        2,
        2,
        2,
        2,
        2,
    )
    assert profiler.steps == 2
    # the phases partition train(): their sum is the wall time of train() (train_other is the remainder)
    assert sum(seconds.values()) == pytest.approx(profiler.train_seconds, rel=1e-6)


def test_step_profiler_times_any_trainer_and_counts_steps_without_clipping(tiny_model, tokenizer, tmp_path):
    """An SFT trainer has no generation, reward or log-prob phase: the profiler times what it has (issue 37: the
    reward-model recipe reported backward 0.0 s); with clipping off (max_grad_norm 0) a step is still one call."""
    data = Dataset.from_list([{"prompt": f"Count to {i}:", "completion": " 1 2 3"} for i in range(4)])
    args = trl_ext.SFTConfig(
        output_dir=str(tmp_path), **{**CPU_TEST_ARGS, "max_steps": 2}, per_device_train_batch_size=2, max_grad_norm=0.0
    )
    trainer = trl_ext.SFTTrainer(model=tiny_model, args=args, train_dataset=data, processing_class=tokenizer)
    profiler = StepProfiler().attach(trainer)
    with pytest.raises(ValueError, match="already has a StepProfiler"):
        StepProfiler().attach(trainer)  # its phases would be timed twice
    trainer.train()
    seconds, calls = profiler.timer.seconds, profiler.timer.calls
    assert seconds["backward"] > 0 and seconds["optimizer"] > 0
    assert not {"generation", "reward", "logprob_forward"} & set(seconds)
    assert (calls["backward"], calls["optimizer"], profiler.optimizer_steps) == (2, 2, 2)


@pytest.fixture
def spied_grpo_clip():
    """``grpo_clip`` registered again as ``spy_grpo_clip``, recording the dtypes of what the trainer hands it."""
    seen = {}
    grpo_clip = losses.POLICY_LOSSES.get("grpo_clip")

    def spy(log_probs, old_log_probs, advantages, response_mask, config):
        seen.update(policy=log_probs.dtype, old=old_log_probs.dtype, advantages=advantages.dtype)
        return grpo_clip.fn(log_probs, old_log_probs, advantages, response_mask, config)

    losses.POLICY_LOSSES.register("spy_grpo_clip", dataclasses.replace(grpo_clip, name="spy_grpo_clip", fn=spy))
    yield seen
    losses.POLICY_LOSSES.unregister("spy_grpo_clip")


def test_bf16_autocast_keeps_the_rl_math_in_fp32(tiny_model, tokenizer, tmp_path, monkeypatch, spied_grpo_clip):
    """Master weights fp32; log-probs (LM head in fp32), ratio inputs, advantages and KL fp32 under bf16 autocast."""
    seen = spied_grpo_clip
    kl = functional.compute_kl

    def spy_kl(log_probs, ref_log_probs, estimator="k3"):
        out = kl(log_probs, ref_log_probs, estimator)
        seen.update(kl=(log_probs.dtype, ref_log_probs.dtype, out.dtype))
        return out

    monkeypatch.setattr(functional, "compute_kl", spy_kl)
    mlp_out = []
    tiny_model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: mlp_out.append(o.dtype))
    trainer = _toy_trainer(
        tiny_model, tokenizer, tmp_path, bf16=True, cast_lm_head_to_fp32=True, max_steps=1, pg_loss_type="spy_grpo_clip"
    )
    trainer.train()
    # the KL term on one more batch, with reference log-probs given (beta > 0 would load a reference checkpoint)
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": "Count to 5:"}] * 4)
    trainer.beta = 0.04
    inputs["ref_per_token_logps"] = torch.full(inputs["completion_ids"].shape, -3.0)
    mlp_out.clear()
    trainer._compute_loss(trainer.model, inputs)
    assert mlp_out and set(mlp_out) == {torch.bfloat16}  # the forward really ran under bf16 autocast ...
    assert seen["policy"] == seen["old"] == seen["advantages"] == torch.float32  # ... the RL math did not
    assert seen["kl"] == (torch.float32, torch.float32, torch.float32)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    state = trainer.optimizer.state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())  # fp32 optimizer state


def test_bf16_two_thread_runs_are_deterministic(tokenizer, tmp_path):
    """Same seed, same thread count, bf16 autocast: two runs end with bit-identical weights."""
    from tiny import tiny_model_for_tests

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weights = []
        for run in range(2):
            trainer = _toy_trainer(
                tiny_model_for_tests(tokenizer),
                tokenizer,
                tmp_path / str(run),
                bf16=True,
                cast_lm_head_to_fp32=True,
                max_steps=2,
            )
            trainer.train()
            weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    finally:
        torch.set_num_threads(before)
    assert any(not torch.equal(weights[0][n], tiny_model_for_tests(tokenizer).state_dict()[n]) for n in weights[0])
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def test_cpu_seconds_counts_this_process_work_and_not_its_sleep():
    import time

    start = profiling.cpu_seconds()
    time.sleep(0.3)
    slept = profiling.cpu_seconds() - start
    deadline, x = time.perf_counter() + 10, 0
    while profiling.cpu_seconds() - start - slept < 0.2 and time.perf_counter() < deadline:
        x += 1  # busy: CPU time advances (at the CPU share this machine gives the process)
    assert slept < 0.1 and profiling.cpu_seconds() - start - slept >= 0.2
