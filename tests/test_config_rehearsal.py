"""Every bundled config in recipes/configs/ is rehearsed on CPU: its recipe runs one optimizer step (eval_math: one
evaluation) with the config's own values, so a mistake in a config file fails here rather than on a rented GPU.

Each run is ``recipes/<recipe>.py --config <file>`` started the way the command line starts it (its ``__main__``
block, in this process to share the imports), plus only these flags, derived from the config file itself by
:func:`allowed_overrides` -- nothing else may differ, which :func:`assert_config_kept` checks on the run's recorded
configuration:

1. What a CPU forces (the config asks for something this machine cannot do):
   ``--use_vllm false`` where the config sets ``use_vllm: true`` (vLLM needs CUDA); ``--backend hf`` where eval_math's
   config sets ``backend: vllm``; ``--use_cpu true`` where the config sets ``bf16: true`` (transformers refuses bf16
   without a bf16 GPU unless use_cpu; the run then keeps the config's bf16 autocast and ``dtype`` on CPU rather
   than switching precision with ``--bf16 false``).
2. Paths redirected to local stand-ins: ``--model_name_or_path`` (a Hub model -> a tiny model of the same family,
   see tests/stand_ins.py; the embedded SmolLM2 -> a tiny random Llama with the embedded tokenizer),
   ``--dataset_name`` (a Hub dataset -> a small local file with that dataset's columns), rlhf's
   ``--reward_model_path`` (its default trains a reward model on the embedded model first) and ``--output_dir``.
3. Counts kept tiny: ``--max_steps 1`` (every trainer recipe; the config's batch sizes, accumulation,
   num_generations, lengths, learning rate and schedule stay, so the one step is a full step of the config) and, for
   expert_iteration (which sizes its SFT by epochs and refuses --max_steps), ``--n_ei_steps 1``.

No length is lowered: the Qwen stand-in is taught to answer in the R1-Zero format and stop, so the 1024-token
budgets of the GPU configs are kept and completions still end after ~15 tokens. One substitution that is not a
flag: expert_iteration_cpu.yaml trains on generated arithmetic, which a random stand-in never answers right, so the
evaluation reward that filters its samples is replaced by one that keeps about half (as
tests/test_recipe_experiments.py does); without it no sample is kept and no SFT step runs.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from stand_ins import gsm8k_rows, math500_rows, math_lighteval_rows, qwen2_model, qwen2_tokenizer, response, teach, write_jsonl

from trl_ext.data.prompts import R1_ZERO_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "recipes" / "configs"
HUB_DATASETS = {  # hub id -> rows with its columns
    "openai/gsm8k": gsm8k_rows,
    "DigitalLearningGmbH/MATH-lighteval": math_lighteval_rows,
    "HuggingFaceH4/MATH-500": math500_rows,
}
QWEN_MODELS = ("Qwen/Qwen2.5-Math-1.5B",)


@dataclass
class Rehearsal:
    recipe: str
    rows: int = 0  # rows of the local dataset file, when the config names a hub dataset
    result: str = "metrics.json"


# rows: enough training prompts for one optimizer step of the config (per_device_train_batch_size x
# gradient_accumulation_steps / num_generations = 32 for the GRPO configs; expert iteration samples ei_batch_size =
# 1024 questions), plus the held-out rows a single local file gives up (its last fifth); eval_math reads 16
REHEARSALS = {
    "compare_upstream_cpu.yaml": Rehearsal("compare_upstream", result="comparison.json"),
    "compare_upstream_gsm8k.yaml": Rehearsal("compare_upstream", rows=40, result="comparison.json"),
    "dpo.yaml": Rehearsal("dpo"),
    "eval_math_gsm8k.yaml": Rehearsal("eval_math", rows=16),
    "eval_math_math500.yaml": Rehearsal("eval_math", rows=16),
    "expert_iteration_cpu.yaml": Rehearsal("expert_iteration"),
    "expert_iteration_math.yaml": Rehearsal("expert_iteration", rows=1280),
    "grpo_ablations_cpu.yaml": Rehearsal("grpo_ablations", result="baselines/comparison.json"),
    "grpo_ablations_gsm8k.yaml": Rehearsal("grpo_ablations", rows=40, result="baselines/comparison.json"),
    "grpo_ablations_math.yaml": Rehearsal("grpo_ablations", rows=40, result="baselines/comparison.json"),
    "grpo_math_cpu.yaml": Rehearsal("grpo_math"),
    "grpo_math_gsm8k.yaml": Rehearsal("grpo_math", rows=40),
    "grpo_math_math.yaml": Rehearsal("grpo_math", rows=40),
    "grpo_sort_cpu.yaml": Rehearsal("grpo_sort", result="comparison.json"),
    "reward_model.yaml": Rehearsal("reward_model"),
    "rlhf.yaml": Rehearsal("rlhf"),
    "sft_instruct.yaml": Rehearsal("sft_instruct"),
}


def allowed_overrides(config: dict, recipe: str, model_dir: str, data_file: str | None, out: Path,
                      reward_model_dir: str | None = None) -> list[str]:
    """The flags a CPU rehearsal of ``config`` (the YAML as a dict) may add; see the module docstring."""
    flags = ["--output_dir", str(out), "--model_name_or_path", model_dir]
    if config.get("use_vllm"):
        flags += ["--use_vllm", "false"]
    if config.get("backend") == "vllm":
        flags += ["--backend", "hf"]
    if config.get("bf16") and not torch.cuda.is_available():
        flags += ["--use_cpu", "true"]
    if config.get("dataset_name") is not None:
        flags += ["--dataset_name", data_file]
    if recipe == "rlhf":
        flags += ["--reward_model_path", reward_model_dir]
    if recipe == "expert_iteration":
        flags += ["--n_ei_steps", "1"]
        # questions whose samples fill one SFT optimizer step when all are kept
        one_step = config.get("per_device_train_batch_size", 8) * config.get("gradient_accumulation_steps", 1)
        questions = max(1, one_step // config.get("num_generations", 8))
        if config.get("ei_batch_size", 16) > questions:
            flags += ["--ei_batch_size", str(questions)]
    elif recipe != "eval_math":
        flags += ["--max_steps", "1"]
    accumulation = config.get("gradient_accumulation_steps", 1)
    if config.get("num_generations") and recipe != "expert_iteration" and accumulation > 1:
        # the fewest micro-batches per optimizer step that keep a generation batch whole groups
        per_device, group = config["per_device_train_batch_size"], config["num_generations"]
        fewest = next(k for k in range(1, accumulation + 1) if per_device * k % group == 0)
        if fewest < accumulation:
            flags += ["--gradient_accumulation_steps", str(fewest)]
    return flags


# ------------------------------------------------------------------------------------------------------ stand-ins
@pytest.fixture(scope="session")
def qwen_stand_in(tmp_path_factory) -> str:
    """A tiny Qwen2 model + Qwen2 tokenizer (tests/stand_ins.py), taught to answer R1-Zero prompts; saved once."""
    questions = [r["question"] for r in gsm8k_rows(64, seed=123)]
    prompts = [R1_ZERO_TEMPLATE.format(question=q) for q in questions]
    tokenizer = qwen2_tokenizer(prompts + [response(a) for a in ("4", "5")] + [r["solution"] for r in math_lighteval_rows(4)])
    model = qwen2_model(tokenizer)
    teach(model, tokenizer, prompts)
    path = tmp_path_factory.mktemp("qwen2_stand_in")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_stand_in(tmp_path_factory, tokenizer) -> str:
    """The embedded model's stand-in: a tiny random Llama with the embedded SmolLM2 tokenizer, saved once."""
    from trl_ext.models import tiny_model_for_tests

    path = tmp_path_factory.mktemp("llama_stand_in")
    tiny_model_for_tests(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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


def assert_config_kept(config: dict, record: dict, overridden: list[str]) -> None:
    """Every option of the config file, except the overridden ones, ran with the file's value."""
    ran = flatten_recorded(record)
    names = {flag[2:] for flag in overridden[::2]}
    for key, value in config.items():
        if key in names:
            continue
        assert key in ran, f"{key} is not among the recorded options"
        got = ran[key]
        if isinstance(got, list) and not isinstance(value, list):  # transformers makes report_to a list
            got = got[0] if len(got) == 1 else got
        assert got == value or str(got) == str(value), f"{key}: the run used {got!r}, the config says {value!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REHEARSALS))
def test_config_runs_one_step_on_cpu(name, tmp_path, monkeypatch, qwen_stand_in, llama_stand_in):
    rehearsal = REHEARSALS[name]
    config = yaml.safe_load((CONFIG_DIR / name).read_text())
    model = config.get("model_name_or_path")
    model_dir = qwen_stand_in if model in QWEN_MODELS else llama_stand_in
    assert model in (*QWEN_MODELS, None), f"{name}: no stand-in for {model}"
    data_file = None
    if config.get("dataset_name") is not None:
        rows = HUB_DATASETS[config["dataset_name"]](rehearsal.rows)
        data_file = str(write_jsonl(tmp_path / "data.jsonl", rows))
    out = tmp_path / "out"
    flags = allowed_overrides(config, rehearsal.recipe, model_dir, data_file, out, reward_model_dir=llama_stand_in)
    run_recipe(rehearsal.recipe, ["--config", str(CONFIG_DIR / name), *flags], monkeypatch)
    record = json.loads((out / rehearsal.result).read_text())
    assert_config_kept(config, record, flags)
