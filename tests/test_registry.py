"""trl_ext.registry: register / decorator, get with did-you-mean naming the option, package.module:attr loading,
names and help read when asked (a --help printed after a registration lists it)."""

import argparse
import copy
import pickle
import textwrap

import pytest

from trl_ext.registry import LiveText, Registry


def make(**kwargs) -> Registry:
    return Registry("colour", "paint", describe=lambda entry: entry["formula"], **kwargs)


def test_register_get_and_the_order_of_names():
    reg = make()
    red = reg.register("red", {"formula": "#f00"})

    @reg.register("green")
    def green():  # the decorator registers the object and hands it back unchanged
        return "#0f0"

    assert red == {"formula": "#f00"} and green() == "#0f0" and reg.get("green") is green
    assert reg.names() == ("red", "green") and list(reg) == ["red", "green"] and len(reg) == 2
    assert "red" in reg and "blue" not in reg and reg.items() == [("red", red), ("green", green)]
    assert reg.unregister("red") is red and reg.names() == ("green",)
    with pytest.raises(KeyError):
        reg.unregister("red")


def test_names_are_refused_when_taken_empty_or_dotted():
    reg = make()
    reg.register("red", {"formula": "#f00"})
    with pytest.raises(ValueError, match="a colour named 'red' is already registered"):
        reg.register("red", {"formula": "#e00"})
    for bad in ("", "pkg.mod:red", 3):
        with pytest.raises(ValueError, match="expected a non-empty string without ':'"):
            reg.register(bad, {"formula": "x"})


def test_check_refuses_an_entry_before_it_is_added():
    def check(name, entry):
        if not entry["formula"].startswith("#"):
            raise ValueError(f"colour {name!r}: expected a hex formula")

    reg = make(check=check)
    with pytest.raises(ValueError, match="colour 'red': expected a hex formula"):
        reg.register("red", {"formula": "red"})
    assert reg.names() == ()


def test_an_unknown_name_names_the_option_the_closest_names_and_every_one():
    reg = make()
    for name in ("grpo_clip", "grpo_no_clip", "no_baseline"):
        reg.register(name, {"formula": name})
    with pytest.raises(ValueError) as err:
        reg.get("grpo_clp")
    assert str(err.value) == (
        "paint='grpo_clp' is not supported: no such colour (did you mean 'grpo_clip' or 'grpo_no_clip'?); "
        "expected one of 'grpo_clip', 'grpo_no_clip', 'no_baseline'"
    )
    # no close name: no hint; another argument name for a function whose parameter is called otherwise
    with pytest.raises(ValueError, match=r"^loss_type='ppo' is not supported: no such colour; expected one of"):
        reg.get("ppo", argument="loss_type")
    # the command line's wording names the flag as typed; a known name has no problem
    assert reg.problem("grpo_clp", flag=True).startswith(
        "--paint grpo_clp: no such colour (did you mean 'grpo_clip' or 'grpo_no_clip'?)"
    )
    assert reg.problem("no_baseline") is None and reg.problem("no_baseline", flag=True) is None


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A package of the user's, importable as ``my_colours``."""
    (tmp_path / "my_colours.py").write_text(
        textwrap.dedent(
            '''
            class Palette:
                teal = {"formula": "#088"}

            def mauve():
                """A soft purple."""

            not_callable = 42
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_colours"


def test_a_dotted_path_is_imported_once_and_passed_through_load(user_module):
    calls = []

    def load(obj, path):
        calls.append(path)
        if not callable(obj) and not isinstance(obj, dict):
            raise TypeError(f"{path} is a {type(obj).__name__}; expected a function or a colour")
        return {"formula": f"loaded {path}", "obj": obj}

    reg = make(load=load)
    reg.register("red", {"formula": "#f00"})
    teal = reg.get("my_colours:Palette.teal")  # attributes of attributes
    assert teal["obj"] == {"formula": "#088"}
    assert reg.get("my_colours:Palette.teal") is teal and calls == ["my_colours:Palette.teal"]  # loaded once
    assert reg.get("my_colours:mauve")["formula"] == "loaded my_colours:mauve"
    assert reg.names() == ("red",) and "my_colours:mauve" not in reg  # loaded, not registered: not in the help
    assert reg.problem("my_colours:mauve") is None
    # each way a dotted path can fail says how, in the option's words
    assert reg.problem("no_such_module_xyz:f", flag=True) == (
        "--paint no_such_module_xyz:f: cannot import no_such_module_xyz (ModuleNotFoundError: No module named "
        "'no_such_module_xyz')"
    )
    assert reg.problem("my_colours:cerise") == (
        "paint='my_colours:cerise' is not supported: my_colours has no attribute 'cerise'"
    )
    assert reg.problem("my_colours:not_callable") == (
        "paint='my_colours:not_callable' is not supported: my_colours:not_callable is a int; expected a function or a "
        "colour"
    )
    assert "expected package.module:attr" in reg.problem(":f")
    # without a loader a dotted path is just an unknown name, and the message does not offer one
    plain = make()
    plain.register("red", {"formula": "#f00"})
    assert plain.problem("my_colours:mauve").endswith("no such colour; expected one of 'red'")
    assert reg.problem("blue").endswith("expected one of 'red', or a package.module:attr of your own")


def test_help_is_built_when_it_is_asked_for():
    reg = make()
    reg.register("red", {"formula": "#f00, 100% red"})
    help_text = reg.live_help("Colours: ", ". Default 'red'.")
    assert str(help_text) == "Colours: 'red' (#f00, 100%% red). Default 'red'."  # % escaped for argparse
    reg.register("blue", {"formula": "#00f"})
    reg.register("plain", {"formula": ""})  # no description: the name alone
    assert reg.help() == "'red' (#f00, 100% red), 'blue' (#00f), 'plain'"
    assert str(help_text) == "Colours: 'red' (#f00, 100%% red), 'blue' (#00f), 'plain'. Default 'red'."
    # as argparse prints it: help % params, after the registration
    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paint", help=help_text)
    reg.register("green", {"formula": "#0f0"})
    printed = " ".join(parser.format_help().split())
    assert "'blue' (#00f), 'plain', 'green' (#0f0). Default 'red'." in printed and "100% red" in printed
    # ArgumentDefaultsHelpFormatter appends with +
    defaults = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults.add_argument("--paint", default="red", help=help_text)
    assert "'green' (#0f0). Default 'red'. (default: red)" in " ".join(defaults.format_help().split())


def test_live_text_reads_like_the_text_of_the_moment():
    state = {"n": 1}
    text = LiveText(lambda: f"n={state['n']}")
    state["n"] = 2
    assert str(text) == "n=2" and f"{text}" == "n=2" and text + "!" == "n=2!" and "<" + text == "<n=2"
    assert text.strip() == "n=2" and text % {} == "n=2"
    assert pickle.loads(pickle.dumps(text)) == "n=2" and copy.deepcopy(text) == "n=2"
