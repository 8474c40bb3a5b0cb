"""TRL's options whose normalization spans processes, on two real processes: trl_ext.GRPOTrainer given an upstream
``trl.GRPOConfig`` with ``loss_type`` cispo or vespo (DAPO's token mean over every process's tokens),
``scale_rewards="batch"`` (the std of every process's rewards) or ``multi_objective_aggregation="normalize_then_sum"``
(the batch normalization over every process's rollouts) ends with upstream's weights, under DDP with gradient
accumulation.

The test launches this file with ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml`` (gloo on
CPU). In each process the ``__main__`` block trains, for each option, upstream ``trl.GRPOTrainer`` and then
``trl_ext.GRPOTrainer`` from the same saved tiny model and seed, with the settings of
tests/test_grpo_upstream_options.py (2 optimizer steps of 2 accumulated micro-batches of 2 completions from one
generation batch, here of 16 completions over the 2 processes). Each process writes its digests and the largest
weight differences; the test reads them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import largest_difference, param_digest, tiny_model_reports_of_two_processes, write_rank_report

OUT_ENV = "TRL_EXT_TEST_UPSTREAM_OPTIONS_DIR"
OPTIONS = ("cispo", "vespo", "batch_std", "normalize_then_sum")


def _launched(out: Path, model_dir: str) -> None:
    import trl
    from test_grpo_upstream_options import CASES, train

    import trl_ext

    tokenizer = trl_ext.models.load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    report = {}  # PartialState (write_rank_report) only after the first trainer: use_cpu=True sets it up for the CPU
    for name in OPTIONS:
        option, reward_funcs, *_ = CASES[name]
        _, theirs, _ = train(trl.GRPOTrainer, tokenizer, model_dir, out / f"{name}-a", reward_funcs, option)
        args, ours, logs = train(trl_ext.GRPOTrainer, tokenizer, model_dir, out / f"{name}-b", reward_funcs, option)
        report[name] = dict(estimator=str(args.advantage_estimator), pg_loss_type=str(args.pg_loss_type))
        report[name].update(upstream_digest=param_digest(theirs), ours_digest=param_digest(ours))
        report[name].update(ours_vs_upstream=largest_difference(ours, theirs))
        report[name].update(num_tokens=[e["num_tokens"] for e in logs if "num_tokens" in e])
    write_rank_report(out, report)


if __name__ == "__main__":
    _launched(Path(os.environ[OUT_ENV]), sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402


@pytest.mark.slow
def test_options_that_normalize_across_processes_train_as_upstream_on_two(tokenizer, tmp_path):
    ranks = tiny_model_reports_of_two_processes(__file__, tokenizer, tmp_path, OUT_ENV, timeout=1200)
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert [ranks[0][name]["pg_loss_type"] for name in OPTIONS] == ["cispo", "vespo", "grpo_clip", "grpo_clip"]
    assert [ranks[0][name]["estimator"] for name in OPTIONS][2:] == ["batch_std", "normalize_then_sum"]
    for name in OPTIONS:
        # DDP: both ranks hold the same weights, for each trainer
        assert ranks[0][name]["upstream_digest"] == ranks[1][name]["upstream_digest"], name
        assert ranks[0][name]["ours_digest"] == ranks[1][name]["ours_digest"], name
        for r in ranks:
            assert r[name]["ours_vs_upstream"] < 1e-6, name
        # the tokens trained differ from a full-length batch (16 x 12 per generation), so the token counts mattered
        assert 0 < ranks[0][name]["num_tokens"][-1] < 16 * 12, name
