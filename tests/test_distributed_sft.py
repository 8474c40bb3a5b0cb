"""Two real processes run recipes/sft_instruct.py with the safety penalty and unsafe rows on one rank only.

``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml tests/test_distributed_sft.py <recipe flags>``
starts two gloo processes; the ``__main__`` block below wraps ``trl_ext.SFTTrainer`` to record, per rank, how many
rows with an unsafe response each training/evaluation batch held and the digest of the final weights, then runs the
recipe unchanged (``runpy``) on a tiny random model. The training file has 8 rows with one unsafe row; with 2 rows
per rank and 2 steps, the step that holds it holds it on one rank only (what hung before every rank ran the same
forwards). The held-out file is ordered so that rank 0 evaluates both safety rows and rank 1 none.

The test checks, from files only: the run finished; a training step and the evaluation had unsafe rows on one rank
and none on the other; both ranks end with bit-identical weights that moved (the recipe evaluates before training:
without `trl_ext.trainers.upstream.TrainerMixin.train`, accelerate would then skip the DDP wrapper and each rank
would train its own copy); and every logged step and evaluation satisfies loss = ce_loss + safety_penalty_weight *
safety_penalty with the metrics averaged over the ranks (rank 0's own ce_loss differs from the mean by far more
than the tolerance, since the ranks train on different rows).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from conftest import REPO, param_digest, run_recipe_recording_finals  # tests/ is on sys.path here and when launched

RECORD_DIR_ENV = "TRL_EXT_TEST_RECORD_DIR"
WEIGHT = 0.7


def _run_recipe_with_recording(record_dir: Path, recipe_argv: list[str]) -> None:
    from trl_ext.trainers.sft import SFTTrainer

    compute_loss = SFTTrainer.compute_loss

    def recording_compute_loss(self, model, inputs, *args, **kwargs):
        labels = inputs.get("unsafe_labels")
        unsafe_rows = 0 if labels is None else int((labels != -100).any(dim=1).sum())
        row = {
            "rank": self.accelerator.process_index,
            "train": self.model.training,
            "step": self.state.global_step,
            "unsafe_rows": unsafe_rows,
            "has_unsafe_batch": labels is not None,
        }
        with open(record_dir / f"rank{row['rank']}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return compute_loss(self, model, inputs, *args, **kwargs)

    SFTTrainer.compute_loss = recording_compute_loss
    run_recipe_recording_finals("sft_instruct", recipe_argv, record_dir, SFTTrainer)


if __name__ == "__main__":
    _run_recipe_with_recording(Path(os.environ[RECORD_DIR_ENV]), sys.argv[1:])
    sys.exit(0)


# ----------------------------------------------------------------------------------------------------------------
# Test side
# ----------------------------------------------------------------------------------------------------------------

import pytest  # noqa: E402
from tiny import save_tiny_model  # noqa: E402


def instruction_rows(path: Path, unsafe: bool, count: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if bool(row.get("unsafe_output")) == unsafe][:count]


@pytest.mark.slow
def test_safety_penalty_with_unsafe_rows_on_one_rank(tmp_path, tokenizer, two_processes):
    model_dir, out_dir, record_dir = tmp_path / "tiny", tmp_path / "out", tmp_path / "records"
    record_dir.mkdir()
    model = save_tiny_model(tokenizer, model_dir, seed=0)
    data = REPO / "recipes" / "data"
    benign, unsafe = (
        instruction_rows(data / "instructions_train.jsonl", False, 7),
        instruction_rows(data / "instructions_train.jsonl", True, 1),
    )
    train_rows = benign[:3] + unsafe + benign[3:]
    test_safe, test_unsafe = (
        instruction_rows(data / "instructions_test.jsonl", False, 2),
        instruction_rows(data / "instructions_test.jsonl", True, 2),
    )
    assert len(train_rows) == 8 and len(test_unsafe) == 2 and all(r["safety_category"] != "none" for r in test_unsafe)
    # eval batches of 1 are dealt to the ranks in turn: rank 0 gets rows 0 and 2 (unsafe), rank 1 rows 1 and 3
    test_rows = [test_unsafe[0], test_safe[0], test_unsafe[1], test_safe[1]]
    for name, rows in (("train.jsonl", train_rows), ("test.jsonl", test_rows)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_args = [
        "--model_name_or_path", str(model_dir), "--output_dir", str(out_dir),
        "--train_file", str(tmp_path / "train.jsonl"), "--test_file", str(tmp_path / "test.jsonl"),
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "1",
        "--safety_penalty_weight", str(WEIGHT), "--max_length", "96", "--max_new_tokens", "2",
        "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "true", "--seed", "0",
    ]  # fmt: skip
    two_processes(__file__, *recipe_args, env={RECORD_DIR_ENV: str(record_dir)})

    records = {
        r: [json.loads(line) for line in (record_dir / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)
    }
    assert len(records[0]) == len(records[1])  # the same number of loss computations on both ranks
    for a, b in zip(records[0], records[1]):
        assert (a["train"], a["step"]) == (b["train"], b["step"])
        assert a["has_unsafe_batch"] and b["has_unsafe_batch"]  # every batch runs the unlikelihood forward
    train_unsafe = [(a["unsafe_rows"], b["unsafe_rows"]) for a, b in zip(records[0], records[1]) if a["train"]]
    eval_unsafe = [(a["unsafe_rows"], b["unsafe_rows"]) for a, b in zip(records[0], records[1]) if not a["train"]]
    assert sorted(train_unsafe) == [(0, 0), (0, 1)] or sorted(train_unsafe) == [(0, 0), (1, 0)]
    assert set(eval_unsafe) == {(1, 0)}

    finals = [json.loads((record_dir / f"rank{r}_final.json").read_text()) for r in (0, 1)]
    assert [f["num_processes"] for f in finals] == [2, 2] and [f["global_step"] for f in finals] == [2, 2]
    assert finals[0]["param_digest"] == finals[1]["param_digest"] != param_digest(model)

    report = json.loads((out_dir / "metrics.json").read_text())
    steps = [entry for entry in report["log_history"] if "loss" in entry]
    assert len(steps) == 2 and any(entry["safety_penalty"] > 0 for entry in steps)
    for entry in steps:
        assert entry["loss"] == pytest.approx(entry["ce_loss"] + WEIGHT * entry["safety_penalty"], rel=1e-5)
    for phase in ("before", "after"):
        metrics = report[phase]
        assert metrics["safety_penalty"] > 0
        assert metrics["heldout_total_loss"] == pytest.approx(
            metrics["heldout_ce_loss"] + WEIGHT * metrics["safety_penalty"], rel=1e-5
        )
