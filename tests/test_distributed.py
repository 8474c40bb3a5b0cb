"""Two real processes: ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml`` runs recipes/grpo_math.py.

The test starts accelerate's launcher (torchrun underneath, gloo on CPU) on this very file; its ``__main__`` block
records what each rank sees and then runs the recipe unchanged (``runpy``), on a tiny random model saved to a
temporary directory, for 2 GRPO steps. Recording hooks, test-only:

- the recipe's training reward (the task's ``reward_funcs``, always 0 on a random model) is
  replaced by a deterministic reward that varies, ``len(completion) % 5``, and logs the prompts, completions and
  rewards of each call -- TRL calls it on each rank with that rank's slice of the batch;
- ``GRPOTrainer._generate_and_score_round`` (one generation round) is wrapped to write, per rank, one JSON line per
completion:
  (call, rank, local index, prompt, completion, reward, advantage this rank trains on);
- ``GRPOTrainer.train`` is wrapped to write, per rank, the distributed state and a digest of the final weights.

The test then checks, from files only: both ranks took part (records from each, gloo MULTI_CPU with 2 processes,
identical final weights on both ranks -- DDP averaged their gradients -- that differ from the initial ones); the
advantages were grouped per prompt across ranks (the union of the ranks' records, in rank order, holds the groups
as consecutive blocks of ``num_generations`` with one prompt each, one group straddles the two ranks, and the
recorded advantages equal ``compute_group_advantages`` of the union's rewards and a hand formula); and the model the
main process saved loads with ``from_pretrained`` and has the trained weights.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from conftest import (
    completion_text,
    length_mod5_reward,
    param_digest,
    run_recipe_recording_finals,
)  # tests/ is on sys.path here and in the launched processes

RECORD_DIR_ENV = "TRL_EXT_TEST_RECORD_DIR"

# Batch geometry: 2 ranks x 6 completions = 12 per step = 3 prompts x 4 completions, so the middle group is split
# 2 + 2 between the ranks. A rank-local grouping would not even divide (6 is not a multiple of 4).
NUM_PROCESSES = 2
PER_DEVICE_BATCH = 6
NUM_GENERATIONS = 4
MAX_STEPS = 2
ADVANTAGE_EPS = 1e-6  # recipes/configs/grpo_math_cpu.yaml (normalize_by_std: true)


# ----------------------------------------------------------------------------------------------------------------
# Launched side: runs in each of the two processes started by `accelerate launch ... tests/test_distributed.py`
# ----------------------------------------------------------------------------------------------------------------


def _run_recipe_with_recording(record_dir: Path, recipe_argv: list[str]) -> None:
    import trl_ext
    import trl_ext.tasks

    reward_calls: list[dict] = []

    def recording_reward(prompts, completions, **kwargs):
        rewards = length_mod5_reward(completions)
        reward_calls.append(
            {"prompts": prompts, "completions": [completion_text(c) for c in completions], "rewards": rewards}
        )
        return rewards

    recording_reward.__name__ = "length_mod5_reward"
    trl_ext.tasks.Task.reward_funcs = property(lambda task: [recording_reward])  # what the recipe trains with

    trainer_cls = trl_ext.GRPOTrainer
    generate_and_score = (
        trainer_cls._generate_and_score_round
    )  # one generation round (dynamic sampling may draw several)
    call_count = {"n": 0}

    def recording_generate_and_score(self, inputs):
        output = generate_and_score(self, inputs)
        (call,) = reward_calls  # exactly one reward call per generation round on this rank
        reward_calls.clear()
        rank = self.accelerator.process_index
        advantages = output["advantages"].tolist()
        if len(advantages) != len(call["rewards"]):
            raise AssertionError(f"rank {rank}: {len(advantages)} advantages for {len(call['rewards'])} rewards")
        with open(record_dir / f"rank{rank}.jsonl", "a") as f:
            rows = zip(call["prompts"], call["completions"], call["rewards"], advantages)
            for i, (prompt, completion, reward, advantage) in enumerate(rows):
                row = dict(call=call_count["n"], rank=rank, index=i, prompt=prompt, completion=completion)
                f.write(json.dumps(dict(row, reward=reward, advantage=advantage)) + "\n")
        call_count["n"] += 1
        return output

    trainer_cls._generate_and_score_round = recording_generate_and_score
    run_recipe_recording_finals("grpo_math", recipe_argv, record_dir, trainer_cls)


if __name__ == "__main__":
    _run_recipe_with_recording(Path(os.environ[RECORD_DIR_ENV]), sys.argv[1:])
    sys.exit(0)


# ----------------------------------------------------------------------------------------------------------------
# Test side
# ----------------------------------------------------------------------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import save_tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_ext.functional import compute_group_advantages  # noqa: E402


def hand_group_advantages(rewards: list[float], eps: float) -> list[float]:
    """(r - mean) / (unbiased std + eps) within one group; 0 for a group of equal rewards (CS336 A5, section 7.2)."""
    mean = statistics.fmean(rewards)
    std = statistics.stdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, tokenizer, two_processes):
    """Launch the recipe on 2 CPU processes once; return (work dir, initial weight digest, completed process)."""
    return launch_two_processes(tmp_path_factory.mktemp("two_proc"), tokenizer, two_processes)


def launch_two_processes(work, tokenizer, launch, per_device_batch=PER_DEVICE_BATCH, extra=()):
    model_dir, out_dir, record_dir = work / "tiny", work / "out", work / "records"
    record_dir.mkdir()
    model = save_tiny_model(tokenizer, model_dir, seed=0)
    recipe_args = [
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(out_dir),
        "--max_steps", str(MAX_STEPS),
        "--per_device_train_batch_size", str(per_device_batch),
        "--num_generations", str(NUM_GENERATIONS),
        "--max_completion_length", "8",
        "--num_train_problems", "24",
        "--num_eval", "4",
        "--eval_batch_size", "4",
        "--learning_rate", "1e-3",
        "--warmup_steps", "0",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "0",
        # the CPU config samples dynamically, which keeps whole groups per process; the default run here checks
        # upstream's grouping of one prompt's completions across ranks (dynamic sampling: its own test below)
        "--dynamic_sampling", "false",
        *extra,
    ]  # fmt: skip
    proc = launch(__file__, *recipe_args, env={RECORD_DIR_ENV: str(record_dir)})
    return work, param_digest(model), proc


def read_records(record_dir: Path) -> dict[int, list[dict]]:
    records = {}
    for rank in range(NUM_PROCESSES):
        path = record_dir / f"rank{rank}.jsonl"
        assert path.is_file(), f"rank {rank} recorded no generation batch"
        records[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return records


@pytest.mark.slow
def test_both_ranks_trained_together(two_process_run):
    work, initial_digest, _ = two_process_run
    finals = [json.loads((work / "records" / f"rank{r}_final.json").read_text()) for r in range(NUM_PROCESSES)]
    for rank, final in enumerate(finals):
        assert final["process_index"] == rank
        assert final["num_processes"] == NUM_PROCESSES
        assert final["distributed_type"] == "DistributedType.MULTI_CPU"
        assert final["backend"] == "gloo"
        assert final["device"].startswith("cpu")
        assert final["global_step"] == MAX_STEPS
    # DDP all-reduces the gradients, so both ranks end with bit-identical weights, and training moved them.
    assert finals[0]["param_digest"] == finals[1]["param_digest"]
    assert finals[0]["param_digest"] != initial_digest

    records = read_records(work / "records")
    for rank, rows in records.items():
        assert len(rows) == MAX_STEPS * PER_DEVICE_BATCH, f"rank {rank}: {len(rows)} rows"
        assert sorted({row["call"] for row in rows}) == list(range(MAX_STEPS))
    # Each rank scored its own completions: the two ranks saw different (prompt, completion) pairs.
    seen = [{(json.dumps(r["prompt"]), r["completion"]) for r in records[rank]} for rank in range(NUM_PROCESSES)]
    assert seen[0] != seen[1]


@pytest.mark.slow
def test_advantages_grouped_per_prompt_across_ranks(two_process_run):
    work, _, _ = two_process_run
    records = read_records(work / "records")
    straddling_groups_with_spread = 0
    any_nonzero = False
    for call in range(MAX_STEPS):
        # The global batch is the ranks' slices in rank order (the sampler hands rank r the r-th contiguous chunk).
        union = [row for rank in range(NUM_PROCESSES) for row in records[rank] if row["call"] == call]
        assert len(union) == NUM_PROCESSES * PER_DEVICE_BATCH
        rewards = [row["reward"] for row in union]
        recorded = [row["advantage"] for row in union]

        for start in range(0, len(union), NUM_GENERATIONS):
            group = union[start : start + NUM_GENERATIONS]
            assert len({json.dumps(row["prompt"]) for row in group}) == 1, (
                f"call {call}: group at {start} mixes prompts"
            )
            expected = hand_group_advantages([row["reward"] for row in group], ADVANTAGE_EPS)
            assert [row["advantage"] for row in group] == pytest.approx(expected, abs=1e-5)
            ranks = {row["rank"] for row in group}
            if ranks == {0, 1} and len({row["reward"] for row in group}) > 1:
                straddling_groups_with_spread += 1
                # A rank that normalized only its own half of this group would have trained on other advantages.
                half = [row["reward"] for row in group if row["rank"] == 0]
                if len(set(half)) > 1:
                    assert [row["advantage"] for row in group if row["rank"] == 0] != pytest.approx(
                        hand_group_advantages(half, ADVANTAGE_EPS), abs=1e-3
                    )
        # The middle group is split 2 + 2 between the ranks.
        assert [row["rank"] for row in union[4:8]] == [0, 0, 1, 1]
        expected_all = compute_group_advantages(torch.tensor(rewards), NUM_GENERATIONS, advantage_eps=ADVANTAGE_EPS)
        assert recorded == pytest.approx(expected_all.tolist(), abs=1e-5)
        any_nonzero = any_nonzero or any(abs(a) > 1e-3 for a in recorded)
    assert any_nonzero, "every reward group was constant; the check above could not tell groupings apart"
    assert straddling_groups_with_spread >= 1, "no group split across ranks had unequal rewards"


@pytest.mark.slow
def test_saved_model_loads_with_trained_weights(two_process_run):
    work, initial_digest, proc = two_process_run
    out = work / "out"
    final = json.loads((work / "records" / "rank0_final.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert param_digest(model) == final["param_digest"] != initial_digest
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token_id == model.config.pad_token_id
    # Only the main process evaluates and writes the report.
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == MAX_STEPS
    assert metrics["n_eval"] == 4
    assert (out / "eval_before.jsonl").is_file() and (out / "eval_after.jsonl").is_file()


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_keeps_the_ranks_identical(tmp_path, tokenizer, two_processes):
    """Dynamic sampling draws extra rounds while any rank lacks informative groups: both ranks draw the same number
    of rounds (the same collectives) and end with identical weights."""
    extra = ("--dynamic_sampling", "true", "--max_sampling_rounds", "3")
    work, initial_digest, proc = launch_two_processes(
        tmp_path, tokenizer, two_processes, per_device_batch=4, extra=extra
    )
    finals = [json.loads((work / "records" / f"rank{r}_final.json").read_text()) for r in range(NUM_PROCESSES)]
    assert finals[0]["global_step"] == finals[1]["global_step"] == MAX_STEPS
    assert finals[0]["param_digest"] == finals[1]["param_digest"] != initial_digest
    records = read_records(work / "records")
    # every rank drew the same rounds (at least one per step), 4 completions each
    assert len(records[0]) == len(records[1]) >= MAX_STEPS * 4 and len(records[0]) % 4 == 0
    assert sorted({r["call"] for r in records[0]}) == sorted({r["call"] for r in records[1]})
