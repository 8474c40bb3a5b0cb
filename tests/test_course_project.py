"""scripts/course_project.py on a verbatim copy of the CS336 course project's pyproject.toml
(tests/fixtures/cs336_assignment5_pyproject.toml): the edits it makes, that the unedited file does not resolve with
trl_ext (and what uv says), and that the edited file resolves against PyPI with the versions trl_ext needs, CPU and
GPU. The resolution tests skip without PyPI; the CPU-index test skips without a PyTorch CPU wheel on disk."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
COURSE_PYPROJECT = ROOT / "tests" / "fixtures" / "cs336_assignment5_pyproject.toml"
SCRIPT = ROOT / "scripts" / "course_project.py"

spec = importlib.util.spec_from_file_location("course_project", SCRIPT)
course_project = importlib.util.module_from_spec(spec)
spec.loader.exec_module(course_project)

UNREACHABLE = ("Failed to fetch", "dns error", "Could not connect", "Could not resolve host", "error sending request")


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` exports UV, the path of its own binary
    if uv is None:
        pytest.skip("uv is not on PATH (the tests run with `uv run pytest`)")
    return uv


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without the venv variables of trl_ext's own project, uv's interpreter fixed to
    this one (the course's file leaves it to discovery)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT")}
    return {**env, "UV": _uv(), "UV_PYTHON": sys.executable, **extra}


@pytest.fixture
def course(tmp_path) -> Path:
    """A course project folder holding the course's pyproject.toml (and the package folder it names)."""
    shutil.copy(COURSE_PYPROJECT, tmp_path / "pyproject.toml")
    (tmp_path / "cs336_alignment").mkdir()
    (tmp_path / "cs336_alignment" / "__init__.py").touch()
    (tmp_path / "README.md").touch()
    return tmp_path


def _script(course: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(course), *options],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**env),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _lock(course: Path) -> subprocess.CompletedProcess:
    """`uv lock` in the course project; skips the test when PyPI cannot be reached."""
    proc = subprocess.run([_uv(), "lock"], cwd=course, capture_output=True, text=True, timeout=600, env=_env())
    if proc.returncode and "github.com" not in proc.stderr and any(s in proc.stderr for s in UNREACHABLE):
        pytest.skip(f"PyPI cannot be reached: {proc.stderr.strip().splitlines()[-1]}")
    return proc


def _locked(course: Path) -> dict[str, list[dict]]:
    packages: dict[str, list[dict]] = {}
    for package in tomllib.loads((course / "uv.lock").read_text())["package"]:
        packages.setdefault(package["name"], []).append(package)
    return packages


def _dependencies(course: Path) -> dict[str, str]:
    project = tomllib.loads((course / "pyproject.toml").read_text())["project"]
    return {course_project._name(d): d for d in project["dependencies"]}


COURSE_DEPENDENCIES = {
    "accelerate": "accelerate>=1.5.2",
    "jupyter": "jupyter>=1.1.1",
    "math-verify": "math-verify[antlr4-13-2]>=0.7.0",
    "pylatexenc": "pylatexenc==2.10",
    "notebook": "notebook>=7.4.2",
    "pytest": "pytest>=8.3.5",
    "torch": "torch",
    "tqdm": "tqdm>=4.67.1",
    "transformers": "transformers>=4.50.0",
    "typer": "typer>=0.15.4",
    "wandb": "wandb>=0.19.8",
    "xopen": "xopen>=2.0.2",
}
"""The course's requirements the script leaves as they are (copied from the fixture by hand)."""


def test_the_fixture_is_the_course_file():
    text = COURSE_PYPROJECT.read_text()
    assert "eb2c562e05802d3c9ee4c4ec2eec43b104d77e9e" in text.splitlines()[1]
    deps = {course_project._name(d): d for d in tomllib.loads(text)["project"]["dependencies"]}
    assert deps == {
        **COURSE_DEPENDENCIES,
        "alpaca-eval": "alpaca-eval",
        "flash-attn": "flash-attn==2.7.4.post1",
        "vllm": "vllm==0.7.2",
    }


def test_the_plan_for_the_course_file():
    pyproject = tomllib.loads(COURSE_PYPROJECT.read_text())
    assert course_project.plan(pyproject, gpu=False, torch_index="https://x/cpu", trl_ext="../trl_ext") == [
        ["remove", "--frozen", "alpaca-eval", "vllm", "flash-attn"],
        ["add", "--frozen", "alpaca-eval"],
        ["add", "--frozen", "--editable", "../trl_ext"],
        ["add", "--frozen", "torch", "--index", "pytorch-cpu=https://x/cpu"],
    ]
    assert course_project.plan(pyproject, gpu=False, torch_index=None, trl_ext="../trl_ext") == [
        ["remove", "--frozen", "alpaca-eval", "vllm", "flash-attn"],
        ["add", "--frozen", "alpaca-eval"],
        ["add", "--frozen", "--editable", "../trl_ext"],
    ]
    assert course_project.plan(pyproject, gpu=True, torch_index=None, trl_ext="../trl_ext") == [
        ["remove", "--frozen", "alpaca-eval", "vllm"],
        ["add", "--frozen", "alpaca-eval", "vllm>=0.22,<0.31; sys_platform == 'linux'"],
        ["add", "--frozen", "--editable", "../trl_ext"],
    ]


def test_the_script_edits_the_course_file_offline_and_a_second_run_changes_nothing(course):
    _script(course, UV_OFFLINE="1")  # the default: PyTorch's CPU index
    pyproject = tomllib.loads((course / "pyproject.toml").read_text())
    assert _dependencies(course) == {**COURSE_DEPENDENCIES, "alpaca-eval": "alpaca-eval", "trl-ext": "trl-ext"}
    uv = pyproject["tool"]["uv"]
    assert uv["sources"] == {
        "trl-ext": {"path": os.path.relpath(ROOT, course), "editable": True},
        "torch": {"index": "pytorch-cpu"},
    }
    assert uv["index"] == [{"name": "pytorch-cpu", "url": "https://download.pytorch.org/whl/cpu", "explicit": True}]
    assert (course / uv["sources"]["trl-ext"]["path"]).resolve() == ROOT
    # what the script does not touch
    assert uv["package"] is True and uv["no-build-isolation-package"] == ["flash-attn"]
    assert pyproject["tool"]["pytest"] == {"ini_options": {"log_cli": True, "log_cli_level": "WARNING"}}
    assert pyproject["project"]["requires-python"] == ">=3.11,<3.13"
    edited = (course / "pyproject.toml").read_text()
    second = _script(course, UV_OFFLINE="1")
    assert (course / "pyproject.toml").read_text() == edited
    assert "append" not in second.stdout and "remove" not in second.stdout


def test_gpu_after_cpu_switches_torch_back_to_pypi_and_restores_the_course_flash_attn(course):
    _script(course, UV_OFFLINE="1")
    _script(course, "--gpu", UV_OFFLINE="1")
    deps = _dependencies(course)
    assert deps["vllm"].replace(" ", "") == "vllm>=0.22,<0.31;sys_platform=='linux'"
    assert deps["flash-attn"] == "flash-attn==2.7.4.post1" and deps["torch"] == "torch"
    sources = tomllib.loads((course / "pyproject.toml").read_text())["tool"]["uv"]["sources"]
    assert set(sources) == {"trl-ext"}


def test_bad_arguments_are_one_error_line_each(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--gpu", "--torch-index", "pypi"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {tmp_path}: no pyproject.toml there (expected the course repository)",
        "error: --torch-index is for the CPU set-up; with --gpu torch comes from PyPI, pinned by vLLM",
    ]


def test_the_unedited_course_file_does_not_resolve_with_trl_ext(course):
    """As published, uv must clone alpaca-eval's git branch first (without GitHub: that error); with that source
    replaced by PyPI's alpaca-eval, vllm 0.7.2's torch pin conflicts with trl_ext's torch >= 2.6, in these words."""
    subprocess.run(
        [_uv(), "add", "--frozen", "--editable", str(ROOT)], cwd=course, check=True, capture_output=True, env=_env()
    )
    proc = _lock(course)
    said = " ".join(proc.stderr.split())
    assert proc.returncode != 0
    assert "nelson-liu/alpaca_eval.git" in said or "vllm==0.7.2 depends on torch==2.5.1" in said, proc.stderr
    subprocess.run([_uv(), "remove", "--frozen", "alpaca-eval"], cwd=course, check=True, env=_env())
    subprocess.run([_uv(), "add", "--frozen", "alpaca-eval"], cwd=course, check=True, env=_env())
    proc = _lock(course)
    said = " ".join(proc.stderr.split())  # uv wraps its explanation to the terminal
    assert proc.returncode != 0
    assert "No solution found when resolving dependencies" in said, proc.stderr
    assert "trl-ext==0.1.0 depends on torch>=2.6" in said and "vllm==0.7.2 depends on torch==2.5.1" in said, said


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "cuda"])  # (a test id "gpu" would mark it a GPU test)
def test_the_edited_course_file_resolves_with_trl_ext(course, gpu):
    """CPU with PyPI's torch (`--torch-index pypi`: download.pytorch.org is not reachable from the test machines) and
    GPU: trl_ext from this checkout, TRL 1.16.0, torch >= 2.6, NumPy 2, transformers >= 5.6, nothing from git; on
    GPU, vLLM within TRL 1.16's range, which pins torch 2.13.0, and the course's flash-attn."""
    _script(course, *(["--gpu"] if gpu else ["--torch-index", "pypi"]))
    proc = _lock(course)
    assert proc.returncode == 0, proc.stderr
    locked = _locked(course)
    (trl_ext,) = locked["trl-ext"]
    assert (course / trl_ext["source"]["editable"]).resolve() == ROOT
    assert [p["version"] for p in locked["trl"]] == ["1.16.0"]
    assert all(Version(p["version"]) >= Version("2.6") for p in locked["torch"])
    assert all(Version(p["version"]) >= Version("2.0") for p in locked["numpy"])
    assert all(Version(p["version"]) >= Version("5.6") for p in locked["transformers"])
    assert not [p["name"] for ps in locked.values() for p in ps if "git" in p.get("source", {})]
    assert [p["source"] for p in locked["alpaca-eval"]] == [{"registry": "https://pypi.org/simple"}]
    if not gpu:
        assert "vllm" not in locked and "flash-attn" not in locked
    else:
        (vllm,) = locked["vllm"]
        assert Version("0.22") <= Version(vllm["version"]) < Version("0.31")
        assert [p["version"] for p in locked["torch"]] == ["2.13.0"]  # vLLM 0.27-0.30 pin it
        assert [p["version"] for p in locked["flash-attn"]] == ["2.7.4.post1"]


def _cpu_torch_wheels() -> list[Path]:
    """PyTorch CPU wheels on this disk: in $TRL_EXT_TORCH_CPU_WHEELS or in pip's find-links folders."""
    folders = os.environ.get("TRL_EXT_TORCH_CPU_WHEELS", "").split(os.pathsep)
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    return sorted(w for f in folders if f and Path(f).is_dir() for w in Path(f).glob("torch-*+cpu-*.whl"))


def test_the_cpu_index_gives_a_torch_without_cuda(course, tmp_path_factory):
    """The CPU set-up's index entry and torch source, with the index's URL pointed at a local copy of the PyTorch CPU
    index (a PEP 503 page listing the CPU torch wheels on this disk): torch resolves to a +cpu build from that
    index and no NVIDIA package is locked (the PyPI torch of the test above brings about 3 GB of them)."""
    wheels = _cpu_torch_wheels()
    if not wheels:
        pytest.skip(
            "no PyTorch CPU wheel on this disk (set TRL_EXT_TORCH_CPU_WHEELS to a folder of torch-*+cpu-*.whl); "
            "download.pytorch.org itself is not reachable from the test machines"
        )
    index = tmp_path_factory.mktemp("pytorch_cpu_index")
    (index / "torch").mkdir()
    links = "".join(f'<a href="{w.as_uri()}">{w.name}</a>\n' for w in wheels)
    (index / "torch" / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    _script(course, "--torch-index", index.as_uri())
    proc = _lock(course)
    assert proc.returncode == 0, proc.stderr
    locked = _locked(course)
    (torch,) = locked["torch"]
    assert torch["version"].endswith("+cpu") and Version(torch["version"]) >= Version("2.6")
    assert Path(torch["source"]["registry"]).resolve() == index.resolve()
    assert [p["version"] for p in locked["trl"]] == ["1.16.0"]
    assert not [name for name in locked if name.startswith("nvidia-")]
