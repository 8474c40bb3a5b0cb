"""Dynamic sampling (trl_ext.trainers.grpo.dynamic_sampling) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from architectures import tiny_model
from datasets import Dataset
from tiny import tiny_grpo_trainer

from trl_ext.trainers.grpo.dynamic_sampling import (
    DynamicSamplingState,
    informative_groups,
    merge_rounds,
    select_groups,
)


def test_informative_groups_by_hand():
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    assert informative_groups(adv, 4).tolist() == [False, True, True]
    assert informative_groups(adv, 2).tolist() == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="12 rows; expected a multiple of group_size=5"):
        informative_groups(adv, 5)


def test_select_groups_takes_informative_groups_in_order_then_fills_with_the_earliest_others():
    a, b = torch.tensor([False, True]), torch.tensor([True, False])
    assert select_groups([a, b], 2) == [(0, 1), (1, 0)]
    assert select_groups([a, b, torch.tensor([True, True])], 2) == [(0, 1), (1, 0)]  # enough: later rounds unused
    # after the last round only one informative group: the earliest uninformative group fills the batch
    assert select_groups([torch.tensor([False, False]), torch.tensor([False, True])], 2) == [(1, 1), (0, 0)]


def test_merge_rounds_pads_prompts_left_and_completions_right():
    r0 = {
        "prompt_ids": torch.tensor([[7, 8], [7, 8], [5, 6], [5, 6]]),
        "prompt_mask": torch.ones(4, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1], [2], [3], [4]]),
        "completion_mask": torch.ones(4, 1, dtype=torch.long),
        "advantages": torch.tensor([0.0, 0.0, 1.0, -1.0]),
        "num_items_in_batch": torch.tensor(4),
    }
    r1 = {
        "prompt_ids": torch.tensor([[9], [9], [3], [3]]),
        "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2], [3, 0], [5, 6], [7, 8]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]),
        "advantages": torch.tensor([0.5, -0.5, 0.0, 0.0]),
        "num_items_in_batch": torch.tensor(7),
    }
    out = merge_rounds([r0, r1], [(0, 1), (1, 0)], group_size=2, pad_token_id=0)
    assert out["prompt_ids"].tolist() == [[5, 6], [5, 6], [0, 9], [0, 9]]
    assert out["prompt_mask"].tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert out["completion_ids"].tolist() == [[3, 0], [4, 0], [1, 2], [3, 0]]
    assert out["completion_mask"].tolist() == [[1, 0], [1, 0], [1, 1], [1, 0]]
    assert out["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert "num_items_in_batch" not in out


def test_sampling_state_is_a_seeded_permutation_that_wraps_and_resumes():
    state = DynamicSamplingState(seed=3, size=5)
    first = torch.randperm(5, generator=torch.Generator().manual_seed(3)).tolist()
    second = torch.randperm(5, generator=torch.Generator().manual_seed(4)).tolist()
    assert state.take(3) == first[:3]
    saved = state.as_dict()
    assert state.take(4) == first[3:] + second[:2]  # the epoch ends: a new permutation from seed + 1
    assert (state.epoch, state.position) == (1, 2)
    again = DynamicSamplingState.from_dict(saved)
    assert again.take(4) == first[3:] + second[:2]


def position_reward(prompts, completions, **kwargs):
    """Prompts starting with 'same' give every completion 1 (no gradient); others alternate 0, 1 by row (gradient)."""
    return [1.0 if p.startswith("same") else float(i % 2) for i, p in enumerate(prompts)]


def make_trainer(tokenizer, tmp_path, prompts, reward_funcs=position_reward, **options):
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=3, max_steps=1)
    settings.update(learning_rate=1e-2, optim="sgd", logging_steps=1, gradient_checkpointing=False)
    model = tiny_model("llama", len(tokenizer))
    return tiny_grpo_trainer(model, tokenizer, tmp_path, prompts, reward_funcs, **settings, **options)


def record_rounds(trainer):
    rounds = []
    one_round = trainer._generate_and_score_round

    def recorded(inputs):
        out = one_round(inputs)
        rounds.append(([x["prompt"] for x in inputs], {k: v.clone() for k, v in out.items() if torch.is_tensor(v)}))
        return out

    trainer._generate_and_score_round = recorded
    return rounds


def test_trainer_draws_rounds_until_every_group_is_informative(tokenizer, tmp_path):
    prompts = [f"same {i}:" for i in range(6)] + [f"diff {i}:" for i in range(6)]
    trainer = make_trainer(tokenizer, tmp_path, prompts, dynamic_sampling=True, max_sampling_rounds=8)
    rounds = record_rounds(trainer)
    batch = trainer._generate_and_score_completions(trainer._draw_round_inputs(2))  # 2 groups of 2 rows
    rounds_prompts = [p[::2] for p, _ in rounds]  # one prompt per group
    # by hand: walk the rounds' groups in order, keep 'diff' ones, stop when 2 are kept
    kept = [(r, g) for r, groups in enumerate(rounds_prompts) for g, p in enumerate(groups) if p.startswith("diff")][:2]
    assert len(kept) == 2 and kept[-1][0] == len(rounds) - 1  # the last round drawn was the one that completed it
    expected_ids = torch.cat([rounds[r][1]["completion_ids"][2 * g : 2 * g + 2] for r, g in kept])
    width = batch["completion_ids"].size(1)
    assert torch.equal(batch["completion_ids"][:, : expected_ids.size(1)], expected_ids) and width >= expected_ids.size(
        1
    )
    assert batch["advantages"].view(2, 2).ne(0).any(dim=1).all()
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/rounds"][-1] == len(rounds)
    assert metrics["dynamic_sampling/groups_drawn"][-1] == 2 * len(rounds)
    assert metrics["dynamic_sampling/groups_kept"][-1] == 2 and metrics["dynamic_sampling/groups_wanted"][-1] == 2


def test_trainer_stops_at_max_rounds_and_fills_with_groups_without_gradient(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer, tmp_path, [f"same {i}:" for i in range(8)], dynamic_sampling=True, max_sampling_rounds=3
    )
    rounds = record_rounds(trainer)
    batch = trainer._generate_and_score_completions(trainer._draw_round_inputs(2))
    assert len(rounds) == 3  # never informative: all rounds drawn
    assert torch.equal(batch["completion_ids"], rounds[0][1]["completion_ids"][:, : batch["completion_ids"].size(1)])
    assert batch["advantages"].eq(0).all()
    assert trainer._metrics["train"]["dynamic_sampling/groups_kept"][-1] == 0


def test_no_baseline_keeps_groups_of_equal_nonzero_rewards(tokenizer, tmp_path):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [f"same {i}:" for i in range(8)],
        dynamic_sampling=True,
        max_sampling_rounds=3,
        pg_loss_type="no_baseline",
    )
    rounds = record_rounds(trainer)
    trainer._generate_and_score_completions(trainer._draw_round_inputs(2))
    assert len(rounds) == 1  # raw reward 1 everywhere: every group has a gradient under no_baseline


def test_loss_and_gradients_of_the_kept_batch_equal_the_plain_computation(tokenizer, tmp_path):
    prompts = [f"same {i}:" for i in range(6)] + [f"diff {i}:" for i in range(6)]
    trainer = make_trainer(tokenizer, tmp_path, prompts, dynamic_sampling=True, max_sampling_rounds=8)
    plain = make_trainer(
        tokenizer, tmp_path / "plain", prompts, share_prompt_cache=False, skip_zero_advantage_rows=False
    )
    batch = trainer._generate_and_score_completions(trainer._draw_round_inputs(2))
    for t in (trainer, plain):
        t.current_gradient_accumulation_steps = 1
        t.model.train()
        t.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(batch))
    loss.backward()
    # independent: the course loss by hand on the same rows (ratio 1, so per-token loss -A; masked_mean per row)
    logits = plain.model(
        input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
    ).logits
    c = batch["completion_ids"].size(1)
    logp = (
        torch.log_softmax(logits[:, -c - 1 : -1].float(), -1)
        .gather(-1, batch["completion_ids"].unsqueeze(-1))
        .squeeze(-1)
    )
    mask = batch["completion_mask"].float()
    ratio = torch.exp(logp - logp.detach())
    per_row = (-(ratio * batch["advantages"][:, None]) * mask).sum(1) / mask.sum(1)
    by_hand = per_row.mean()
    by_hand.backward()
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-6)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_dynamic_sampling_refuses_groups_split_across_processes(tokenizer, tmp_path):
    # one process cannot split a group (upstream's own check); with two, 2 rows per process and groups of 4 would
    trainer = make_trainer(tokenizer, tmp_path, [f"diff {i}:" for i in range(8)], dynamic_sampling=True)
    trainer.args.per_device_train_batch_size, trainer.num_generations = 3, 4
    with pytest.raises(
        ValueError,
        match=r"per_device_train_batch_size \(3\) x steps_per_generation \(1\) = 3 "
        r"is not a multiple of num_generations \(4\)",
    ):
        trainer._check_dynamic_sampling()


def first_part(prompts, completions, **kwargs):
    """Rows alternate 0.1, 0.2 within each group of 2."""
    return [0.1 if i % 2 == 0 else 0.2 for i in range(len(prompts))]


def second_part(prompts, completions, **kwargs):
    """Rows alternate 0.6, 0.5: sums 0.1 + 0.6 and 0.2 + 0.5, equal in exact arithmetic, one float32 ulp apart; for
    prompts starting with 'real' 0.6, 0.5001: sums 1e-4 apart, a real difference."""
    return [0.6 if i % 2 == 0 else (0.5001 if p.startswith("real") else 0.5) for i, p in enumerate(prompts)]


def test_float_equal_rewards_are_dropped_and_truly_informative_groups_kept(tokenizer, tmp_path):
    """NVIDIA-NeMo/RL#4158: a group whose summed rewards differ only by float32 rounding has advantages of exactly 0,
    so dynamic sampling drops it like any group of equal rewards and keeps the 'real' groups; frac_reward_zero_std
    is logged by the same rule (upstream's isclose(std, 0) would count the float-equal groups as informative)."""
    prompts = [f"float {i}:" for i in range(6)] + [f"real {i}:" for i in range(6)]
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        prompts,
        reward_funcs=[first_part, second_part],
        dynamic_sampling=True,
        max_sampling_rounds=8,
    )
    rounds = record_rounds(trainer)
    first = [{"prompt": "float 0:"}] * 2 + [{"prompt": "float 1:"}] * 2  # round 1: two float-equal groups
    batch = trainer._generate_and_score_completions(first)
    assert (torch.tensor(0.1) + torch.tensor(0.6)).item() != (torch.tensor(0.2) + torch.tensor(0.5)).item()
    assert len(rounds) > 1
    groups = [p[::2] for p, _ in rounds]  # one prompt per group of 2 rows, per round
    for (_, out), prompts_of_round in zip(rounds, groups):
        for g, prompt in enumerate(prompts_of_round):
            advantages = out["advantages"][2 * g : 2 * g + 2].tolist()
            if prompt.startswith("float"):
                assert advantages == [0.0, 0.0], prompt
            else:  # -+(d/2) / (d/sqrt(2) + 1e-6), d = 1e-4: 0.7071 / 1.01414 = 0.6972
                assert advantages == pytest.approx([-0.6972, 0.6972], abs=1e-4), prompt
    kept = [(r, g) for r, prompts_of_round in enumerate(groups) for g, p in enumerate(prompts_of_round)]
    kept = [(r, g) for r, g in kept if groups[r][g].startswith("real")][:2]
    assert len(kept) == 2 and kept[-1][0] == len(rounds) - 1
    expected = torch.cat([rounds[r][1]["advantages"][2 * g : 2 * g + 2] for r, g in kept])
    assert torch.equal(batch["advantages"], expected)
    # by hand: per round, the share of its groups that are float-equal
    fractions = [sum(p.startswith("float") for p in prompts_of_round) / 2 for prompts_of_round in groups]
    assert trainer._metrics["train"]["frac_reward_zero_std"] == fractions


def test_plain_grpo_trains_nothing_on_float_equal_rewards_and_logs_them_as_zero_std(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, ["float 0:", "real 0:"], reward_funcs=[first_part, second_part])
    trainer.model.train()
    rows = [{"prompt": "float 0:"}] * 2 + [{"prompt": "real 0:"}] * 2
    out = trainer._generate_and_score_completions(rows)
    assert out["advantages"][:2].tolist() == [0.0, 0.0]
    assert out["advantages"][2:].tolist() == pytest.approx([-0.6972, 0.6972], abs=1e-4)
    assert trainer._metrics["train"]["frac_reward_zero_std"] == [0.5]  # 1 of 2 groups; upstream's rule: 0.0


# ----- a streaming training set (datasets.IterableDataset, issue 30) -----


def test_a_stream_is_drawn_as_a_shuffle_per_epoch_and_resumes_at_its_position():
    """Each epoch of the stream is a permutation of its rows (every row once), epochs differ, and a state restored
    from ``as_dict`` continues exactly where the original goes on."""
    prompts = [f"p{i}" for i in range(7)]
    stream = Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
    state = DynamicSamplingState(seed=3, size=None)
    first = [row["prompt"] for row in state.take_rows(stream, 5)]
    saved = state.as_dict()
    assert saved == {"seed": 3, "size": None, "epoch": 0, "position": 5}
    rest = [row["prompt"] for row in state.take_rows(stream, 9)]  # 2 to end epoch 0, then 7 of epoch 1
    assert sorted(first + rest[:2]) == prompts and sorted(rest[2:]) == prompts
    assert first + rest[:2] != rest[2:]  # another order in the next epoch
    assert (state.epoch, state.position) == (1, 7)
    again = DynamicSamplingState.from_dict(saved)
    assert [row["prompt"] for row in again.take_rows(stream, 9)] == rest
    with pytest.raises(ValueError, match="the streaming training set yields no row"):
        empty = Dataset.from_dict({"prompt": ["x"]}).to_iterable_dataset().filter(lambda row: False)
        DynamicSamplingState(seed=0, size=None).take_rows(empty, 1)


def test_a_streaming_training_set_trains_with_dynamic_sampling_and_resumes_on_the_same_prompts(tokenizer, tmp_path):
    """Construction read len(train_dataset) (TypeError for a stream); now the extra rounds are drawn from the stream,
    and a run resumed from its step-1 checkpoint draws the same extra prompts at step 2 as the uninterrupted run."""
    prompts = [f"same {i}:" for i in range(6)] + [f"diff {i}:" for i in range(6)]

    def run(out, resume=None):
        settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=3, max_steps=2)
        settings.update(learning_rate=1e-2, optim="sgd", save_strategy="steps", save_steps=1, logging_steps=1)
        settings.update(gradient_checkpointing=False, dynamic_sampling=True, max_sampling_rounds=4)
        model = tiny_model("llama", len(tokenizer))
        stream = Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
        trainer = tiny_grpo_trainer(model, tokenizer, out, stream, position_reward, **settings)
        rounds = record_rounds(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, [p for p, _ in rounds]

    whole, drawn = run(tmp_path / "whole")
    assert whole.state.global_step == 2 and whole._dynamic_state.size is None
    assert len(drawn) > 2  # extra rounds were drawn from the stream
    resumed, drawn_again = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    step_1_rounds = len(drawn) - len(drawn_again)
    assert len(drawn_again) > 1 and drawn_again == drawn[step_1_rounds:]  # step 2: its first and extra rounds
    assert resumed._dynamic_state.as_dict() == whole._dynamic_state.as_dict()


def test_upstream_metrics_cover_every_round_and_dynamic_sampling_ones_the_trained_batch(tokenizer, tmp_path):
    """One meaning per name (issue 30): reward, reward_std, frac_reward_zero_std, completions/* and num_tokens keep
    upstream's meaning over everything generated -- every round appends its own value, and the logging window
    averages them -- while dynamic_sampling/reward, reward_std and frac_reward_zero_std describe the trained batch."""
    prompts = [f"same {i}:" for i in range(6)] + [f"diff {i}:" for i in range(6)]
    trainer = make_trainer(tokenizer, tmp_path, prompts, dynamic_sampling=True, max_sampling_rounds=8)
    rounds = record_rounds(trainer)
    first = [{"prompt": "same 0:"}] * 2 + [{"prompt": "diff 0:"}] * 2  # round 1: 1 of its 2 groups informative
    trainer._generate_and_score_completions(first)
    assert len(rounds) >= 2
    # by hand (position_reward): a 'same' group scores 1, 1 (mean 1); a 'diff' group 0, 1 (mean 0.5)
    groups = [p[::2] for p, _ in rounds]
    metrics = trainer._metrics["train"]
    assert metrics["reward"] == [sum(1.0 if p.startswith("same") else 0.5 for p in g) / 2 for g in groups]
    assert metrics["frac_reward_zero_std"] == [sum(p.startswith("same") for p in g) / 2 for g in groups]
    tokens = sum(int(out["prompt_mask"].sum() + out["completion_mask"].sum()) for _, out in rounds)
    assert metrics["num_tokens"] == [tokens]  # a running count: every round's prompts and completions
    # the trained batch: two 'diff' groups, rewards 0, 1, 0, 1: mean 0.5, unbiased std sqrt(4 x 0.25 / 3)
    assert metrics["dynamic_sampling/reward"] == [0.5]
    assert metrics["dynamic_sampling/reward_std"] == [pytest.approx(math.sqrt(1 / 3))]
    assert metrics["dynamic_sampling/frac_reward_zero_std"] == [0.0]


def test_rounds_that_find_nothing_to_learn_are_said_once(tokenizer, tmp_path, caplog):
    # every prompt's group is all 1s: no round can ever find a group with a gradient (the r1_zero-on-a-small-model
    # case, where every reward is 0); the trainer says so once, not at every step
    prompts = [f"same {i}:" for i in range(8)]
    trainer = make_trainer(tokenizer, tmp_path, prompts, dynamic_sampling=True, max_sampling_rounds=3)
    rounds = record_rounds(trainer)
    with caplog.at_level("WARNING", logger="trl_ext"):
        for _ in range(2):
            trainer._generate_and_score_completions(trainer._draw_round_inputs(2))
    assert len(rounds) == 6  # 3 rounds per batch, all spent
    said = [r.message for r in caplog.records if "dynamic_sampling: 3 generation rounds" in r.message]
    assert said == [said[0]] and "drew 6 groups and none had rewards that differ" in said[0]
