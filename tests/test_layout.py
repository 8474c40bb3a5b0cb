"""The shape of the code a newcomer reads first (issues 20 and 28), measured: thin recipes that nothing imports, one
report mechanism, one home for each rule that used to be copied, and imports that point down.

Each recipe in recipes/ is a script read top to bottom (config -> task/data -> model -> trainer -> evaluation ->
report): ``main`` fits on a screen, it imports few trl_ext names, it writes its results through ``trl_ext.report``
only, and it calls no private method of TRL. Tests load recipes to run them in-process; nothing else imports one.

The library's modules form layers (``trl_ext.LAYERS``, read here, written nowhere else): every ``import`` of a
trl_ext module -- at the top of a file or inside a function, ``TYPE_CHECKING`` blocks aside -- goes to the same layer
or one below, and the import graph has no cycle. A lazy import is there for speed (not loading TRL's trainers at
``import trl_ext``), never to hide a circle. No module of the library or the recipes is over 1,000 lines.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import trl_ext

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.py"))
RECIPE_NAMES = {p.stem for p in RECIPES}
MAIN_MAX_LINES = 70
TRL_EXT_MAX_NAMES = 4
LIBRARY = ROOT / "trl_ext"

LAYERS = trl_ext.LAYERS  # the one list of the layers, bottom first (trl_ext/__init__.py)
MODULE_MAX_LINES = 1000


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _main(path: Path) -> ast.FunctionDef:
    return next(n for n in _tree(path).body if isinstance(n, ast.FunctionDef) and n.name == "main")


def test_there_are_recipes_to_check():
    assert {
        "grpo_math",
        "eval_math",
        "compare_upstream",
        "grpo_ablations",
        "grpo_sort",
        "expert_iteration",
        "sft_instruct",
        "reward_model",
        "dpo",
        "rlhf",
    } <= RECIPE_NAMES


def test_no_file_imports_a_recipe():
    """The library, the recipes, scripts and benchmarks import no recipe and change no import path (a recipe that
    needs another recipe's work runs it as a program, or the work moves into the library)."""
    offenders = []
    for folder in ("trl_ext", "recipes", "scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(_tree(path)):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module.split(".")[0]]
                offenders += [f"{path.relative_to(ROOT)}: imports {n}" for n in names if n in RECIPE_NAMES]
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("insert", "append")
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "path"
                    and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "sys"
                ):
                    offenders.append(f"{path.relative_to(ROOT)}: line {node.lineno} changes sys.path")
    assert offenders == []


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_main_fits_on_a_screen(path):
    main = _main(path)
    start = min([main.lineno] + [d.lineno for d in main.decorator_list])
    assert main.end_lineno - start + 1 <= MAIN_MAX_LINES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_imports_at_most_four_trl_ext_names(path):
    names = []
    for node in _tree(path).body:
        if isinstance(node, ast.Import):
            names += [a.asname or a.name for a in node.names if a.name.split(".")[0] == "trl_ext"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl_ext":
            names += [a.asname or a.name for a in node.names]
    assert len(names) <= TRL_EXT_MAX_NAMES, names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_results_go_through_one_report_call(path):
    """A recipe writes no file itself (no open, write_text, json.dump, savefig, rich tables): ``trl_ext.report``
    does, in one ``report.finish`` / ``report.finish_comparison`` call of ``main``."""
    tree = _tree(path)
    writes = [
        f"line {n.lineno}: {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id in ("open", "Table"))
            or (isinstance(n.func, ast.Attribute) and n.func.attr in ("write_text", "write_bytes", "dump", "savefig"))
        )
    ]
    assert writes == []
    calls = [
        n
        for n in ast.walk(_main(path))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "report"
        and n.func.attr in ("finish", "finish_comparison")
    ]
    assert len(calls) == 1


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_calls_no_private_method(path):
    """``obj._name(...)`` or ``obj._name = ...`` in a recipe reaches into TRL's (or trl_ext's) internals; the
    library wraps what a recipe needs in a public, seam-checked method."""
    private = [
        f"line {n.lineno}: .{n.attr}"
        for n in ast.walk(_tree(path))
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    ]
    assert private == []


def test_the_embedded_models_name_and_the_entropy_rule_live_once():
    """``DEFAULT_MODEL`` names the embedded model (trl_ext/models.py) and ``observations.entropy_collapsed`` is the
    entropy-collapse rule; neither is written again elsewhere in the library or the recipes."""
    for path in [*sorted((ROOT / "trl_ext").rglob("*.py")), *RECIPES]:
        text = path.read_text()
        if path.name != "models.py":
            assert '"embedded:SmolLM2-135M-Instruct"' not in text, path
        if path.name != "observations.py":
            assert "< 0.1 or" not in text and " / 5" not in text, path


# ------------------------------------------------------------------------------------------- imports point down
def _library_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _room(module: str) -> str:
    """``trl_ext.compare.arms`` -> ``compare``; ``trl_ext.cli`` -> ``cli``; ``trl_ext`` -> ``trl_ext``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (imports for annotations only, never executed)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            inside |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return inside


def _imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """``(imported trl_ext module, line)`` for every import statement of ``module``, top-level or inside a function
    (``TYPE_CHECKING`` blocks aside); ``from X import name`` counts as an import of ``X.name`` when that is a module,
    else of ``X``; relative imports are resolved against ``module``'s package."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "trl_ext" and (found := resolve(target)) and found != module:
                yield found, node.lineno


def _import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over every module of trl_ext."""
    modules = _library_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in _imports(module, path, modules):
            edges.setdefault(target, line)
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module], path[len(path) :] = "open", [module]
        for target in sorted(graph.get(module, {})):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def _layer_problems(graph: dict[str, dict[str, int]], layers=LAYERS) -> list[str]:
    """Every module whose room has no layer, and every import that points up, as ``file:line: a imports b``."""
    rank = {room: i for i, rooms in enumerate(layers) for room in rooms}
    modules = _library_modules()
    problems = sorted(
        {f"{_room(m)} ({modules[m].relative_to(ROOT)}) is in no layer of LAYERS" for m in graph if _room(m) not in rank}
    )
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            low, high = rank.get(_room(module)), rank.get(_room(target))
            if low is not None and high is not None and high > low:
                problems.append(
                    f"{modules[module].relative_to(ROOT)}:{line}: {module} (layer {low}: {_room(module)}) imports "
                    f"{target} (layer {high}: {_room(target)}), above it"
                )
    return problems


def test_the_library_has_no_import_cycle():
    graph = _import_graph()
    assert len(graph) >= 40 and graph["trl_ext.cli"], "the graph must cover the library"
    cycle = _cycle(graph)
    modules = _library_modules()
    assert cycle is None, f"import cycle {' -> '.join(cycle)}: " + "; ".join(
        f"{modules[a].relative_to(ROOT)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])
    )


def test_the_library_imports_point_down():
    problems = _layer_problems(_import_graph())
    assert not problems, "imports that point up (or modules in no layer):\n" + "\n".join(problems)


def test_the_import_check_finds_what_it_must(tmp_path):
    """The check itself, on made-up graphs: an upward arrow (named with its file and line), a cycle, a lazy import."""
    graph = _import_graph()
    bad = {**graph, "trl_ext.errors": {**graph["trl_ext.errors"], "trl_ext.cli": 7}}
    assert _layer_problems(bad) == [
        "trl_ext/errors.py:7: trl_ext.errors (layer 0: errors) imports trl_ext.cli (layer 12: cli), above it"
    ]
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "d": {"c": 1}}) is None
    # lazy imports count, TYPE_CHECKING ones do not
    assert "trl_ext.trainers" in graph["trl_ext"] and "trl_ext.trainers.resume" in graph["trl_ext.run"]
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from trl_ext.cli import x\n"  # for annotations only: not an import of cli
        "from trl_ext import errors\n"
    )
    assert [module for module, _ in _imports("trl_ext.m", source, _library_modules())] == ["trl_ext.errors"]


def test_every_room_is_a_lazy_attribute_of_the_package():
    """``trl_ext.LAYERS`` names every module and subpackage of the library, once, and nothing else; ``trl_ext.<room>``
    works for each: ``functional`` and ``quantized`` (a leaf that must act before TRL imports bitsandbytes) are
    imported with the package, the others by ``trl_ext.__getattr__`` on first use (its ``_SUBMODULES``, read from
    LAYERS)."""
    import importlib.util

    named = [room for layer in LAYERS for room in layer]
    assert len(named) == len(set(named)), "a room in two layers"
    rooms = set(named) - {"trl_ext"}
    assert rooms == {_room(m) for m in _library_modules()} - {"trl_ext"}
    assert {"functional", "quantized", *trl_ext._SUBMODULES} == rooms
    assert all(importlib.util.find_spec(f"trl_ext.{room}") for room in rooms)
    assert set(dir(trl_ext)) >= rooms


def test_the_layers_are_written_in_one_place():
    """The package docstring and the README point to ``trl_ext.LAYERS`` instead of listing the rooms again (a second
    copy drifts): neither names the layers' rooms in order, and the test file holds no list of its own."""
    readme = (ROOT / "README.md").read_text()
    assert "trl_ext.LAYERS" in readme and "LAYERS" in trl_ext.__doc__
    for text in (readme, trl_ext.__doc__):
        listed = [room for room in ("registry", "errors", "options", "machine", "observations") if f"`{room}`" in text]
        assert len(listed) < 3, listed
    assert not re.search(r"^LAYERS\s*=\s*\(", Path(__file__).read_text(), re.MULTILINE)


# ------------------------------------------------------------------------------------------- no module too long
def test_no_module_is_over_a_thousand_lines():
    """Every Python file of the library and the recipes fits in 1,000 lines (split a cohesive part out instead)."""
    files = [*sorted(LIBRARY.rglob("*.py")), *sorted((ROOT / "recipes").rglob("*.py"))]
    assert len(files) > 50
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert long == {}, long


def test_no_private_helper_is_imported_across_modules():
    """A name with a leading underscore is its module's own (issue 46): another module neither imports it (``from
    trl_ext.x import _helper``) nor reaches it through the module (``x._helper``); what two rooms share is public.
    Dunder names and an underscore alias kept for old pickles (``_Derived``) defined in place are not imports."""
    modules = _library_modules()
    found = []
    for path in modules.values():
        tree = _tree(path)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trl_ext"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("trl_ext")})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}")
    assert found == []


_CHAINS_SCRIPT = """
import ast, importlib.util, json, os, sys
import accelerate, datasets, torch, transformers, trl  # loaded once; trl_ext is loaded afresh in each child

def check(path):
    spec = importlib.util.spec_from_file_location("recipe_under_test", path)
    module = sys.modules["recipe_under_test"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the recipe's own imports only: main runs under __name__ == "__main__"
    broken, checked = [], 0
    for node in ast.walk(ast.parse(open(path).read())):
        parts, value = [], node
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if parts and isinstance(value, ast.Name) and value.id == "trl_ext":
            checked += 1
            obj = module.trl_ext
            for name in reversed(parts):
                if not hasattr(obj, name):
                    broken.append("trl_ext." + ".".join(reversed(parts)))
                    break
                obj = getattr(obj, name)
    return {"broken": sorted(set(broken)), "checked": checked}

results = {}
assert not any(name == "trl_ext" or name.startswith("trl_ext.") for name in sys.modules)
for path in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child: a fresh trl_ext, this recipe's imports only
        os.close(read)
        try:
            out = json.dumps(check(path))
        except BaseException as err:
            out = json.dumps({"broken": [f"load failed: {err!r}"], "checked": 0})
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        results[os.path.basename(path)] = json.loads(pipe.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="one child process per recipe")
def test_every_dotted_trl_ext_name_a_recipe_uses_resolves_after_its_own_imports():
    # `trl_ext.objective.course.mean_response_entropy(...)` in recipes/expert_iteration.py raised AttributeError when
    # the recipe ran alone: nothing it imported imported the submodule (the whole test suite had, earlier, by luck).
    # Each recipe, loaded with a fresh trl_ext, must reach every `trl_ext.a.b...` it names through its own imports.
    recipes = sorted(str(p) for p in (ROOT / "recipes").glob("*.py"))
    run = subprocess.run(
        [sys.executable, "-c", _CHAINS_SCRIPT, *recipes], capture_output=True, text=True, check=True, cwd=ROOT
    )
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(Path(p).name for p in recipes)
    assert all(result["checked"] > 0 for result in results.values()), results
    assert {name: result["broken"] for name, result in results.items() if result["broken"]} == {}
