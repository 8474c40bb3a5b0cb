"""A registering module run twice in one process (issue 45 item 1): ``importlib.reload`` (notebooks, autoreload) and
``python my_loss.py`` (``__main__``, then imported again by name) re-register the same definition, which replaces the
entry in its place; another definition under a taken name is refused, naming both. For every registry of trl_ext."""

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from trl_ext.advantages import ADVANTAGE_ESTIMATORS
from trl_ext.aggregations import AGGREGATIONS, compute_grpo_loss
from trl_ext.losses import POLICY_LOSSES, LossConfig, policy_loss
from trl_ext.registry import Registry
from trl_ext.task_options import TASKS
from trl_ext.tasks import GRADERS


@dataclass
class Kind:
    """One registry: a module registering ``{name}`` with ``{scale}`` in its function, the attribute a dotted path
    names, what the entry computes (through the call the trainer makes) and that value for scale 1, by hand."""

    registry: Registry
    source: str
    attr: str
    value: Any  # (registry lookup: a name or a dotted path) -> float
    unit: float
    fn: Any  # entry -> the function it holds


LOG_PROBS = torch.tensor([[-1.0, -2.0, -4.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def _loss(key: str) -> float:
    per_token, _ = policy_loss(key, LOG_PROBS, LOG_PROBS, torch.tensor([[0.5]]), MASK, LossConfig())
    return float((per_token * MASK).sum())


KINDS = {
    "policy_loss": Kind(
        POLICY_LOSSES,
        """
        from trl_ext.losses import register_policy_loss

        @register_policy_loss("{name}", upstream_loss_type="{name}_trl", formula="-{scale} A log pi")  # REGISTERS
        def scaled(log_probs, old_log_probs, advantages, response_mask, config):
            return -{scale} * advantages * log_probs, {{}}
        """,
        "scaled",
        _loss,
        1.5,  # -0.5 * (-1 - 2): the third token is masked out
        lambda entry: entry.fn,
    ),
    "aggregation": Kind(
        AGGREGATIONS,
        """
        from trl_ext.aggregations import register_aggregation

        @register_aggregation("{name}", upstream_loss_type="{name}_trl")  # REGISTERS
        def scaled(per_token_loss, response_mask, normalize_constant, empty_rows):
            return {scale} * (per_token_loss * response_mask).sum()
        """,
        "scaled",
        lambda key: float(compute_grpo_loss(LOG_PROBS, MASK, length_normalization=key)),
        -3.0,  # -1 - 2
        lambda entry: entry.reduce,
    ),
    "advantage_estimator": Kind(
        ADVANTAGE_ESTIMATORS,
        """
        from trl_ext.advantages import register_advantage_estimator

        @register_advantage_estimator("{name}")  # REGISTERS
        def scaled(rewards_per_func, reward_weights, group_size, config):
            return {scale} * (rewards_per_func * reward_weights).sum(dim=1)
        """,
        "scaled",
        lambda key: (
            ADVANTAGE_ESTIMATORS.get(key)
            .fn(torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([1.0, 0.5]), 2, None)
            .sum()
            .item()
        ),
        5.0,  # (1 + 2 * 0.5) + 3
        lambda entry: entry.fn,
    ),
    "task": Kind(
        TASKS,
        """
        from trl_ext.task_options import register_task

        @register_task("{name}")  # REGISTERS
        def scaled():
            return {{"scale": {scale}}}
        """,
        "scaled",
        lambda key: TASKS.get(key)()["scale"],
        1.0,
        lambda entry: entry.make,
    ),
    "grader": Kind(
        GRADERS,
        """
        from trl_ext.tasks import GRADERS, Grader

        def scaled(response, ground_truth):
            return {{"reward": {scale} * float(response == ground_truth)}}

        GRADERS.register("{name}", Grader(scaled, None))  # REGISTERS
        """,
        "scaled",
        lambda key: GRADERS.get(key).reward_fn("7", "7")["reward"],
        1.0,
        lambda entry: entry.reward_fn,
    ),
}


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Write ``module.py`` files to an importable folder (no bytecode: a rewritten file is read again); afterwards
    unregister what they registered and forget them."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    written: list[tuple[Registry, str, str]] = []

    def write(module: str, kind: Kind, name: str, scale: float, top: str = "") -> str:
        path = tmp_path / f"{module}.py"
        path.write_text(top + textwrap.dedent(kind.source.format(name=name, scale=scale)))
        importlib.invalidate_caches()
        written.append((kind.registry, name, module))
        return str(path)

    yield write
    for registry, name, module in written:
        if name in registry:
            registry.unregister(name)
        sys.modules.pop(module, None)


def _line(path: str) -> int:
    """The line of the registering call in ``path`` (marked ``# REGISTERS``)."""
    with open(path) as f:
        return next(number for number, line in enumerate(f, 1) if "# REGISTERS" in line)


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_reloading_a_module_replaces_its_entries_in_place(kind_name, user_modules, caplog):
    kind = KINDS[kind_name]
    first, second = f"h45_{kind_name}_first", f"h45_{kind_name}_second"
    user_modules(first, kind, first, 2.0)
    user_modules(second, kind, second, 2.0)
    module = importlib.import_module(first)
    importlib.import_module(second)
    names = kind.registry.names()
    assert names[-2:] == (first, second)
    assert kind.value(first) == 2.0 * kind.unit and kind.value(f"{first}:{kind.attr}") == 2.0 * kind.unit
    old = kind.registry.get(first)

    # an edit (the scale, and the lines move) then a reload, as notebook autoreload does
    user_modules(first, kind, first, 3.0, top="# edited\n\n")
    with caplog.at_level(logging.DEBUG, logger="trl_ext.registry"):
        importlib.reload(module)
    assert kind.registry.names() == names  # the same place, not a second entry, not moved behind `second`
    new = kind.registry.get(first)
    assert kind.fn(old) is not module.scaled and kind.fn(new) is module.scaled  # the reloaded function
    assert kind.value(first) == 3.0 * kind.unit
    assert kind.value(f"{first}:{kind.attr}") == 3.0 * kind.unit  # the dotted path's cache holds no stale entry
    lines = [r.getMessage() for r in caplog.records if r.name == "trl_ext.registry"]
    assert len(lines) == 1 and f"{first}:scaled" in lines[0] and "replaces" in lines[0], lines


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_another_definition_under_a_taken_name_is_refused_naming_both(kind_name, user_modules):
    kind = KINDS[kind_name]
    first, other = f"h45_{kind_name}_taken", f"h45_{kind_name}_other"
    first_path = user_modules(first, kind, first, 2.0)
    other_path = user_modules(other, kind, first, 5.0, top="\n")  # the same qualname, in another module and file
    module = importlib.import_module(first)
    with pytest.raises(ValueError) as err:
        importlib.import_module(other)
    message = str(err.value)
    assert message.startswith(f"a {kind.registry.kind} named {first!r} is already registered: ")
    assert f"{first}:scaled (registered at {os.path.realpath(first_path)}:{_line(first_path)})" in message
    assert f"{other}:scaled (registered at {os.path.realpath(other_path)}:{_line(other_path)})" in message
    assert kind.registry.names().count(first) == 1 and kind.fn(kind.registry.get(first)) is module.scaled
    assert kind.value(first) == 2.0 * kind.unit  # the old one stays


def test_a_check_sees_the_registry_without_the_old_entry_and_a_refusal_keeps_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    seen = []

    def check(name, entry):
        seen.append(tuple(registry))
        if entry.__doc__ == "refuse":
            raise ValueError(f"colour {name!r}: refused")

    registry = Registry("colour", "paint", check=check)
    registry.register("red", lambda: "#f00")
    source = (
        'import sys\nREG = sys.modules["registry_under_test"]\n\n@REG.register("teal")\ndef teal():\n    """{doc}"""\n'
    )
    (tmp_path / "h45_colours.py").write_text(source.format(doc="a colour"))
    monkeypatch.setitem(sys.modules, "registry_under_test", registry)
    module = importlib.import_module("h45_colours")
    registry.register("blue", lambda: "#00f")
    old = registry.get("teal")
    try:
        importlib.reload(module)  # the same definition: checked without the old entry, kept in place
        assert seen[-1] == ("red", "blue") and registry.names() == ("red", "teal", "blue")
        assert registry.get("teal") is module.teal is not old
        (tmp_path / "h45_colours.py").write_text(source.format(doc="refuse"))
        importlib.invalidate_caches()
        with pytest.raises(ValueError, match="colour 'teal': refused"):
            importlib.reload(module)
        assert registry.names() == ("red", "teal", "blue") and registry.get("teal").__doc__ == "a colour"
        registry.register("blue", registry.get("blue"))  # the very same object again: fine
        # a value that is no function or class is the same only as itself
        registry.register("plain", {"formula": "#fff"})
        with pytest.raises(ValueError, match=r"'plain' is already registered: dict \(registered at .*test_registry"):
            registry.register("plain", {"formula": "#fff"})
    finally:
        sys.modules.pop("h45_colours", None)


SCRIPT = """
import json
import sys

import torch

from trl_ext.losses import POLICY_LOSSES, LossConfig, policy_loss, register_policy_loss


@register_policy_loss("scaled", upstream_loss_type="h45_scaled", formula="-2 A log pi")
def scaled(log_probs, old_log_probs, advantages, response_mask, config):
    return -2.0 * advantages * log_probs, {}


if __name__ == "__main__":
    import my_loss  # the file imports itself by name: it registers "scaled" a second time, as module my_loss

    problem = POLICY_LOSSES.problem("my_loss:scaled", flag=True)  # what the command line asks of --pg_loss_type
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    per_token, _ = policy_loss(  # what the trainer calls with args.pg_loss_type
        "my_loss:scaled", log_probs, log_probs, torch.tensor([[0.5], [-1.0]]), torch.ones(2, 2), LossConfig()
    )
    print(json.dumps({
        "problem": problem,
        "loss": per_token.tolist(),
        "names": list(POLICY_LOSSES.names()).count("scaled"),
        "fn_module": POLICY_LOSSES.get("scaled").fn.__module__,
        "same_fn": POLICY_LOSSES.get("my_loss:scaled").fn is my_loss.scaled,
    }))
"""


def test_a_script_that_is_also_imported_by_name_resolves_its_loss(tmp_path):
    (tmp_path / "my_loss.py").write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "my_loss.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # -2 * A * log pi, by hand: row 1 A = 0.5, row 2 A = -1
    assert result == {
        "problem": None,
        "loss": [[1.0, 2.0], [-1.0, -6.0]],
        "names": 1,
        "fn_module": "my_loss",
        "same_fn": True,
    }


@dataclass(frozen=True)
class Wrapped:
    fn: Any
    note: str


def test_a_dotted_path_loaded_to_a_replaced_or_removed_entry_is_loaded_again(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "h45_wrapped.py").write_text("def f():\n    return 1\n")
    module = importlib.import_module("h45_wrapped")

    def load(obj, path):  # as trl_ext's loaders do: the registered entry of that function, else a new one
        return next((entry for _, entry in registry.items() if entry.fn is obj), None) or Wrapped(obj, "loaded")

    registry = Registry("colour", "paint", load=load)
    try:
        registry.register("f", Wrapped(module.f, "first"))
        assert registry.get("h45_wrapped:f").note == "first"
        registry.register("f", Wrapped(module.f, "second"))  # the same function with other declarations
        assert registry.get("h45_wrapped:f").note == "second" and registry.names() == ("f",)
        registry.unregister("f")
        assert registry.get("h45_wrapped:f").note == "loaded"
    finally:
        sys.modules.pop("h45_wrapped", None)
