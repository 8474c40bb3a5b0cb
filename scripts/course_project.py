"""Edit the CS336 course project's pyproject.toml (stanford-cs336/assignment5-alignment) so that trl_ext installs.

The course's file, as published, cannot take trl_ext:

- ``alpaca-eval`` comes from a git branch (nelson-liu/alpaca_eval, ``forward_kwargs_to_vllm``), which uv must
  clone from GitHub before it resolves anything. PyPI's alpaca-eval replaces it. The branch matters only to the
  supplement's AlpacaEval judge (``scripts/alpaca_eval_vllm_llama3_3_70b_fn``, Llama 3.3 70B on vLLM): PyPI's
  ``vllm_local_completions`` reads only ``tp`` from the config's ``model_kwargs`` (not ``max_model_len: 7000``).
- ``vllm==0.7.2`` pins torch 2.5.1, and trl_ext needs torch >= 2.6 (transformers 5 disables older PyTorch). CPU:
  removed. ``--gpu``: vLLM 0.22-0.30 (TRL 1.16 supports 0.22-0.31; 0.31 needs transformers < 5.18), which pins
  torch 2.13.0.
- ``flash-attn==2.7.4.post1`` builds CUDA kernels against the installed torch. CPU: removed. ``--gpu``: kept as the
  course has it (its ``no-build-isolation-package`` and ``dependency-metadata`` entries stay).

The script adds trl_ext as an editable path dependency and, on CPU, takes torch from the PyTorch CPU index
(``[[tool.uv.index]]`` with ``explicit = true`` plus ``[tool.uv.sources] torch``, as uv's PyTorch guide writes
it): 1.7 GB of environment instead of 6.1 GB of CUDA wheels. Every edit but one is a ``uv add``/``uv remove
--frozen`` (uv edits the file, nothing is resolved yet), printed as it runs; the exception is the index entry,
appended as text because ``uv add --index`` cannot mark an index explicit. Running it again converges on the same
file; ``--gpu`` after a CPU run (or the reverse) switches. Then, in the course project, ``uv sync`` (GPU:
``uv sync --no-install-package flash-attn`` and then ``uv sync``, as the course's README says).

    python scripts/course_project.py path/to/assignment5-alignment               # CPU, torch from the CPU index
    python scripts/course_project.py path/to/assignment5-alignment --torch-index pypi   # CPU, PyPI's torch
    python scripts/course_project.py path/to/assignment5-alignment --gpu         # CUDA: vLLM 0.30, flash-attn

``--torch-index URL`` names another index that serves PyTorch's CPU wheels (a mirror of it). Tested by
tests/test_course_project.py on a copy of the course's file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(os.path.abspath(__file__)).parents[1]  # abspath, not resolve: a symlinked checkout keeps its path
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_NAME = "pytorch-cpu"
GPU_VLLM = "vllm>=0.22,<0.31; sys_platform == 'linux'"
"""The vLLM range of trl_ext's own `gpu` extra (pyproject.toml): TRL 1.16's 0.22-0.31, less 0.31 (transformers <
5.18)."""
COURSE_FLASH_ATTN = "flash-attn==2.7.4.post1"


def _name(requirement: str) -> str:
    """The normalized project name of a PEP 508 requirement string (PEP 503: lowercase, runs of -_. as -)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def _spaceless(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement)  # uv writes "vllm>=0.22,<0.31 ; sys_platform == 'linux'"


def plan(pyproject: dict, *, gpu: bool, torch_index: str | None, trl_ext: str) -> list[list[str]]:
    """The uv commands (arguments after `uv`) that take the parsed ``pyproject`` to the target state.

    ``torch_index`` is the CPU index's URL, or None for PyPI's torch; ``trl_ext`` the path to write (relative to the
    course project, or absolute). Each command is needed only where the file differs from the target.
    """
    deps = {_name(d): d for d in pyproject.get("project", {}).get("dependencies", [])}
    sources = pyproject.get("tool", {}).get("uv", {}).get("sources", {})
    steps: list[list[str]] = []
    remove = []
    if "alpaca-eval" in sources:
        remove.append("alpaca-eval")
    if "vllm" in deps and (not gpu or _spaceless(deps["vllm"]) != _spaceless(GPU_VLLM)):
        remove.append("vllm")
    if "flash-attn" in deps and not gpu:
        remove.append("flash-attn")
    torch_source = sources.get("torch")
    torch_source = torch_source if isinstance(torch_source, list) else [torch_source] if torch_source else []
    wants_index = torch_index is not None and not gpu
    if torch_source and not (wants_index and [s.get("index") for s in torch_source] == [INDEX_NAME]):
        remove.append("torch")  # another source (or the CPU index where CUDA's torch is wanted): re-added below
    if remove:
        steps.append(["remove", "--frozen", *remove])
    add = []
    if "alpaca-eval" in remove or "alpaca-eval" not in deps:
        add.append("alpaca-eval")
    if gpu and ("vllm" in remove or "vllm" not in deps):
        add.append(GPU_VLLM)
    if gpu and "flash-attn" not in deps:
        add.append(COURSE_FLASH_ATTN)
    if "torch" in remove and not wants_index:
        add.append(deps.get("torch", "torch"))
    if add:
        steps.append(["add", "--frozen", *add])
    steps.append(["add", "--frozen", "--editable", trl_ext])
    if wants_index:
        steps.append(["add", "--frozen", deps.get("torch", "torch"), "--index", f"{INDEX_NAME}={torch_index}"])
    return steps


INDEX_ENTRY = f"""
[[tool.uv.index]]
name = "{INDEX_NAME}"
url = "{{url}}"
explicit = true  # only the packages that name it in [tool.uv.sources] (torch) come from it
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("course", type=Path, help="the course repository (or its pyproject.toml)")
    parser.add_argument("--gpu", action="store_true", help="keep vLLM (0.22-0.30) and flash-attn for CUDA machines")
    parser.add_argument(
        "--torch-index",
        default=None,
        help=f"CPU only: where torch comes from: an index URL (default {TORCH_CPU_INDEX}), or `pypi` for PyPI's "
        "torch (on Linux a CUDA build: the environment is 6.1 GB instead of 1.7 GB)",
    )
    parser.add_argument("--trl-ext", type=Path, default=ROOT, help="the trl_ext checkout (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    args = parser.parse_args(argv)

    path = args.course / "pyproject.toml" if args.course.is_dir() else args.course
    uv = os.environ.get("UV") or shutil.which("uv")
    problems = []
    if not path.is_file():
        problems.append(f"{args.course}: no pyproject.toml there (expected the course repository)")
    if args.gpu and args.torch_index is not None:
        problems.append("--torch-index is for the CPU set-up; with --gpu torch comes from PyPI, pinned by vLLM")
    if not (args.trl_ext / "trl_ext" / "__init__.py").is_file():
        problems.append(f"--trl-ext {args.trl_ext}: not a trl_ext checkout (no trl_ext/__init__.py)")
    if uv is None and not args.dry_run:
        problems.append("uv is not on PATH (the course project is managed with uv: https://docs.astral.sh/uv/)")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    course = path.absolute().parent
    torch_index = None if args.gpu or args.torch_index == "pypi" else args.torch_index or TORCH_CPU_INDEX
    trl_ext = os.path.relpath(args.trl_ext.absolute(), course)
    trl_ext = trl_ext if trl_ext.startswith(".") else f"./{trl_ext}"  # a bare name would be a PyPI package
    pyproject = tomllib.loads(path.read_text())
    steps = plan(pyproject, gpu=args.gpu, torch_index=torch_index, trl_ext=trl_ext)

    indexes = pyproject.get("tool", {}).get("uv", {}).get("index", [])
    if torch_index is not None and not any(i.get("name") == INDEX_NAME for i in indexes):
        print(f"append to {path}: [[tool.uv.index]] {INDEX_NAME} = {torch_index} (explicit)")
        if not args.dry_run:
            with path.open("a") as f:
                f.write(INDEX_ENTRY.format(url=torch_index))
    for step in steps:
        print("uv " + " ".join(f'"{a}"' if " " in a else a for a in step))
        if not args.dry_run:
            proc = subprocess.run([uv, *step], cwd=course, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr.rstrip(), file=sys.stderr)
                print(f"error: `uv {' '.join(step)}` failed in {course} (exit {proc.returncode})", file=sys.stderr)
                return 1
    if not args.dry_run:
        print(
            f"{path} edited. Next, in {course}: "
            + ("`uv sync --no-install-package flash-attn` then `uv sync`" if args.gpu else "`uv sync`")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
