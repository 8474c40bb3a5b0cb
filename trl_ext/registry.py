"""One small registry of named choices: policy losses, length normalizations, advantage estimators (and tasks).

A :class:`Registry` maps the value of one option (``pg_loss_type``, ``length_normalization``, ...) to an entry: it
registers entries (a call or a decorator), finds one by name -- or imports ``package.module:attr`` for a user's own,
as TRL names a reward function by its dotted path -- and says what is registered when it is asked (``names``,
``help``), so a ``--help`` printed after a user registered an entry lists it. An unknown name gets one error that
names the option, the closest registered names (difflib) and every registered one::

    LOSSES = Registry("policy loss", "pg_loss_type", PolicyLoss)   # entries: PolicyLoss(name, fn, **declarations)
    @LOSSES.register("grpo_clip", uses_old_log_probs=True, formula="...")   # above the loss function
    LOSSES.get("grpo_clp")   # ValueError: pg_loss_type='grpo_clp' is not supported: no such policy loss (did you
                             # mean 'grpo_clip'?); expected one of 'grpo_clip', ..., or a package.module:attr ...
    LOSSES.problem("grpo_clp", flag=True)        # "--pg_loss_type grpo_clp: no such policy loss (did you mean ..."
    LOSSES.get("my_pkg.losses:my_loss")          # imports my_pkg.losses, passes my_loss through ``load``

After verl's ``register_policy_loss`` / ``get_policy_loss_fn`` (verl/trainer/ppo/core_algos.py) and nanochat's
name -> task dicts; the did-you-mean is argparse's (Python 3.12+, ``suggest_on_error``). This leaf imports nothing of
trl_ext.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "LiveText"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_THIS_FILE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(_THIS_FILE)


class LiveText(str):
    """A help text rebuilt each time it is read, for a dataclass field's ``metadata={"help": ...}``.

    ``argparse`` formats a help as ``help % params`` when it prints it; this ``%`` (and ``str()``, ``format``, ``+``)
    calls ``build()`` then, so ``--help`` lists what a :class:`Registry` holds at that moment, including entries
    registered after the config class was defined. As a plain ``str`` it holds the text of when it was made.
    ``build`` must return text whose ``%`` signs are escaped as ``%%`` (argparse's rule; :meth:`Registry.help`
    escapes the entries' descriptions).
    """

    _build: Callable[[], str]

    def __new__(cls, build: Callable[[], str]) -> LiveText:
        text = super().__new__(cls, build())
        text._build = build
        return text

    def __str__(self) -> str:
        return self._build()

    def __mod__(self, params: Any) -> str:
        return self._build() % params

    def __add__(self, other: str) -> str:
        return self._build() + other

    def __radd__(self, other: str) -> str:
        return other + self._build()

    def __format__(self, spec: str) -> str:
        return format(self._build(), spec)

    def strip(self, chars: str | None = None) -> str:
        return self._build().strip(chars)

    def __reduce__(self):  # pickles (and deep-copies) as the plain text of the moment
        return (str, (self._build(),))


class _NotFound(Exception):
    """Why a name names no entry (the message after ``<option>=<name> is not supported: ``)."""


def _is_definition(obj: Any) -> bool:
    return inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj)


def _definitions(entry: Any) -> tuple[Any, ...]:
    """The functions and classes an entry is made of: the entry itself when it is one, else those its dataclass
    fields (or instance attributes) hold, in order (a ``PolicyLoss``'s ``fn``, a ``TaskFactory``'s ``make``)."""
    if _is_definition(entry):
        return (entry,)
    if dataclasses.is_dataclass(entry):
        values = [getattr(entry, field.name, None) for field in dataclasses.fields(entry)]
    else:
        values = list(getattr(entry, "__dict__", {}).values())
    return tuple(value for value in values if _is_definition(value))


def _source_file(obj: Any) -> str | None:
    """The real path of the file that defines ``obj`` (its module's ``__file__``, else its code's file), or None."""
    path = getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "__file__", None)
    if not path:
        code = getattr(obj, "__code__", None)
        path = getattr(code, "co_filename", None)
    return os.path.realpath(path) if path and not path.startswith("<") else None


def _same_definition(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are one definition run twice: the same qualified name, in the same module or the same source
    file (``python my_loss.py`` runs it as ``__main__``, then ``import my_loss`` again as ``my_loss``)."""
    if getattr(a, "__qualname__", None) != getattr(b, "__qualname__", None):
        return False
    if getattr(a, "__module__", None) == getattr(b, "__module__", None):
        return True
    file = _source_file(a)
    return file is not None and file == _source_file(b)


def _same_entry(old: Any, new: Any) -> bool:
    """``new`` is ``old`` registered again: the same object, or the same definitions (:func:`_same_definition`) in an
    entry of the same class. An entry made of no function or class (a plain value) is only the same as itself."""
    if old is new:
        return True
    if _is_definition(old) or _is_definition(new):
        return _is_definition(old) and _is_definition(new) and _same_definition(old, new)
    before, after = _definitions(old), _definitions(new)
    return (
        _same_definition(type(old), type(new))
        and bool(before)
        and len(before) == len(after)
        and all(map(_same_definition, before, after))
    )


def _place(entry: Any, site: str | None) -> str:
    """Where an entry comes from, for messages: ``module:qualname`` of its first definition (else its type), and the
    ``file:line`` that registered it."""
    definitions = _definitions(entry)
    what = f"{definitions[0].__module__}:{definitions[0].__qualname__}" if definitions else type(entry).__name__
    return f"{what} (registered at {site})" if site else what


def _call_site() -> str | None:
    """``file:line`` of the code that registers: the first caller outside trl_ext (a user's module, whether it calls
    :meth:`Registry.register` or a ``register_*`` decorator of trl_ext); for trl_ext's own entries, which its modules
    register as Python imports them, the last caller inside trl_ext."""
    frame = sys._getframe(1)
    inside: str | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith("<frozen "):  # the import machinery running a module of trl_ext
            return inside
        path = path if path.startswith("<") else os.path.abspath(path)  # "<string>", "<stdin>": code of a user's
        where = f"{path}:{frame.f_lineno}"
        if not path.startswith(_PACKAGE_DIR + os.sep):
            return where
        if path != _THIS_FILE:
            inside = where
        frame = frame.f_back
    return inside


class Registry(Generic[T]):
    """Named entries of one kind, in registration order, chosen by one option.

    Args:
        kind: what an entry is, in words (``"policy loss"``), for messages.
        option: the config field that names an entry (``"pg_loss_type"``); errors name it, and with ``flag=True``
            the command-line flag ``--pg_loss_type``.
        entry_type: the frozen dataclass an entry is (``PolicyLoss``), whose field ``wraps`` holds the function and
            whose other fields are the declarations :meth:`register` takes; None: entries are stored as given.
        wraps: the field of ``entry_type`` that holds the function (default ``"fn"``).
        expects: the function an entry wraps, in words, for the error of a dotted path naming something else.
        describe: ``entry -> one line`` for :meth:`help` (default: the entry's ``formula`` or ``description``).
        check: ``(name, entry) -> None``, called before an entry is added; raises ValueError to refuse it (e.g. a
            claim another entry already holds).
        shown: ``(name, entry) -> how the name is written`` in lists and help (default: the name).
        unique: ``{field: how messages name it}``: a field whose value (when not None) no two entries share, e.g.
            ``{"upstream_loss_type": "TRL's loss_type"}`` (one TRL name means one entry).
        dotted_as_registered: a dotted path to a function registered here loads that entry, declarations and all
            (default True); False: always a plain entry of the function (the graders: a course ``reward_fn`` named
            by its path says nothing of the answer it reads).
        load: ``(object, "package.module:attr") -> entry`` in place of :meth:`load`, for entries that are not an
            ``entry_type`` (raises TypeError for an object it cannot use). Dotted paths are accepted where there is
            an ``entry_type`` or a ``load``.

    An entry loaded from a dotted path is kept (loaded once per object the path names: a path whose module was
    reloaded or imported again is loaded again), but is not registered: it is not listed by :meth:`names` or
    :meth:`help`.
    """

    def __init__(
        self,
        kind: str,
        option: str,
        entry_type: type | None = None,
        *,
        wraps: str = "fn",
        expects: str = "a function",
        describe: Callable[[T], str] | None = None,
        check: Callable[[str, T], None] | None = None,
        load: Callable[[Any, str], T] | None = None,
        shown: Callable[[str, T], str] | None = None,
        unique: dict[str, str] | None = None,
        dotted_as_registered: bool = True,
    ):
        self.kind = kind
        self.option = option
        self.entry_type = entry_type
        self.wraps = wraps
        self.expects = expects
        self._describe = describe or _said
        self._check = check
        self._custom_load = load
        self._shown = shown or (lambda name, entry: name)
        self._dotted_as_registered = dotted_as_registered
        self._unique = unique or {}
        self._dotted = entry_type is not None or load is not None
        self._entries: dict[str, T] = {}
        self._sites: dict[str, str | None] = {}  # name -> file:line that registered it, for messages
        self._loaded: dict[str, tuple[Any, T]] = {}  # dotted path -> (the object it named, its entry)

    # -- adding and removing ----------------------------------------------------------------------------------

    def register(self, name: str, entry: Any = None, **declarations: Any) -> Any:
        """The one way to register: ``@REGISTRY.register("name", **declarations)`` above a function registers it
        as an ``entry_type`` holding it, with ``declarations`` (the entry's other fields; its ``formula`` or
        ``description`` defaults to the docstring's first line), and returns the function unchanged. With
        ``entry`` (a finished ``entry_type``), adds it and returns it.

        A module that registers may run twice in one process (``python my_loss.py``, which runs it as ``__main__``
        and imports it again by name; ``importlib.reload``; notebook autoreload). Registering the same definition
        again -- the same object, or an entry of the same class whose functions and classes have the same qualified
        names and come from the same module or the same source file -- replaces the old entry in its place (``check``
        runs on the new entry without the old one; a dotted path loaded to the old entry is loaded again), with one
        debug log line.

        Raises:
            ValueError: ``name`` is held by another definition (naming the old and the new one, ``module:qualname``
                and the ``file:line`` that registered each), is empty, or contains ``:`` (the mark of a dotted path); a
                declaration the entry does not have; ``entry`` not an ``entry_type``; or ``check`` refuses the entry.
            TypeError: the decorated object is not a function.
        """
        if entry is None:

            def decorate(obj: Any) -> Any:
                self._add(name, self._entry(name, obj, declarations))
                return obj

            return decorate
        if self.entry_type is not None and not isinstance(entry, self.entry_type):
            said = f"{self.entry_type.__module__}.{self.entry_type.__qualname__}"
            raise ValueError(f"{self.kind} {name!r}: expected a {said}, got {type(entry).__name__}")
        return self._add(name, entry)

    def _add(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(
                f"{self.kind} name {name!r}: expected a non-empty string without ':' (a name with ':' is a "
                "package.module:attr to import)"
            )
        site = _call_site()
        if name in self._entries:
            old = self._entries[name]
            if not _same_entry(old, entry):
                raise ValueError(
                    f"a {self.kind} named {name!r} is already registered: {_place(old, self._sites.get(name))}; "
                    f"{_place(entry, site)} is another definition (unregister {name!r} first to replace it, or choose "
                    "another name)"
                )
            order = list(self._entries.items())  # checked without the old one (whose claims the new one repeats)
            del self._entries[name]
            try:
                self._checked(name, entry)
            finally:
                self._entries.clear()
                self._entries.update(order)
            self._entries[name] = entry  # an existing key: the same place in the order
            logger.debug(
                "%s %r: %s replaces %s, the same definition run again (a reload, or a script imported by name)",
                self.kind,
                name,
                _place(entry, site),
                _place(old, self._sites.get(name)),
            )
            self._sites[name] = site
            self._forget(old)
            return entry
        self._checked(name, entry)
        self._entries[name] = entry
        self._sites[name] = site
        return entry

    def _checked(self, name: str, entry: T) -> None:
        """Refuse ``entry`` (ValueError) when a ``unique`` field's value is another entry's, or ``check`` refuses it."""
        for field, said in self._unique.items():
            value = getattr(entry, field, None)
            holder = next(
                (n for n, e in self._entries.items() if value is not None and getattr(e, field, None) == value), None
            )
            if holder is not None:
                raise ValueError(f"{said} {value!r} already means {holder!r}")
        if self._check is not None:
            self._check(name, entry)

    def _entry(self, name: str, obj: Any, declarations: dict[str, Any], path: str = "") -> T:
        """``obj`` as an entry: an ``entry_type`` as it is, a function wrapped with ``declarations``."""
        if self.entry_type is None or isinstance(obj, self.entry_type):
            if declarations:
                raise ValueError(f"{self.kind} {name!r}: declarations go with a function, not a finished entry")
            return obj
        if not callable(obj):
            said = path or f"{self.kind} {name!r}"
            raise TypeError(f"{said} is a {type(obj).__name__}; expected {self.expects}")
        known = {f.name for f in dataclasses.fields(self.entry_type)}
        unknown = sorted(set(declarations) - known - {"name", self.wraps})
        if unknown:
            allowed = ", ".join(sorted(known - {"name", self.wraps}))
            raise ValueError(f"{self.kind} {name!r}: no declaration(s) {unknown}; expected some of {allowed}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in declarations.items()}
        values[self.wraps] = obj
        if "name" in known:
            values["name"] = name
        for text in ("formula", "description"):
            if text in known and not values.get(text):
                values[text] = _first_line(obj)
        if path and "source" in known and not values.get("source"):
            values["source"] = path
        return self.entry_type(**values)

    def load(self, obj: Any, path: str) -> T:
        """What ``package.module:attr`` names, as an entry -- the one loader of every registry: an entry as it is;
        a function registered when its module was imported, that entry (with its declarations); any other
        function, an entry that declares nothing (every declaration at its conservative default).

        Raises:
            TypeError: ``obj`` is neither an entry nor a function (naming ``path`` and what was expected).
        """
        if self._custom_load is not None:
            return self._custom_load(obj, path)
        registered = [
            e for e in self._entries.values() if getattr(e, self.wraps, e) is obj and self._dotted_as_registered
        ]
        return registered[0] if registered else self._entry(path, obj, {}, path)

    def unregister(self, name: str) -> T:
        """Remove the entry called ``name`` and return it (tests, and a user replacing a built-in).

        Raises:
            KeyError: no entry is called ``name``.
        """
        entry = self._entries.pop(name)
        self._sites.pop(name, None)
        self._forget(entry)
        return entry

    def _forget(self, entry: T) -> None:
        """Drop the dotted paths loaded to ``entry`` (replaced or removed), so the next lookup loads them again."""
        self._loaded = {path: loaded for path, loaded in self._loaded.items() if loaded[1] is not entry}

    # -- finding --------------------------------------------------------------------------------------------------

    def problem(self, name: Any, flag: bool = False) -> str | None:
        """Why ``name`` names no entry, in one line, or None when :meth:`get` finds (or imports) one.

        Args:
            name: a registered name or a ``package.module:attr`` path.
            flag: word it for the command line (``--pg_loss_type grpo_clp: no such ...``) instead of Python
                (``pg_loss_type='grpo_clp' is not supported: no such ...``).
        """
        try:
            self._find(name)
        except _NotFound as err:
            said = f"--{self.option} {name}: " if flag else f"{self.option}={name!r} is not supported: "
            return said + str(err)
        return None

    def get(self, name: str, argument: str | None = None) -> T:
        """The entry called ``name``; or, for ``package.module:attr``, what ``load`` makes of that object (loaded
        once per object: again when the path names another object, after its module was reloaded or imported again).

        Args:
            name: a registered name or a dotted path.
            argument: the name errors give the option (default: ``option``), for a function whose parameter has
                another name (``loss_type``).

        Raises:
            ValueError: ``<option>=<name> is not supported: ...``: no entry is called ``name`` (naming the closest
                names and every registered one), or the dotted path cannot be imported, names no attribute, or
                names something ``load`` cannot use (saying which).
        """
        try:
            return self._find(name)
        except _NotFound as err:
            raise ValueError(f"{argument or self.option}={name!r} is not supported: {err}") from None

    def _find(self, name: Any) -> T:
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and ":" in name and self._dotted:
            obj = self._import(name)
            loaded = self._loaded.get(name)
            # first time, or the module was reloaded or imported again: not the old entry (a bound method is made
            # anew by each getattr: equal, not identical)
            if loaded is None or not (loaded[0] is obj or (inspect.ismethod(obj) and loaded[0] == obj)):
                try:
                    loaded = (obj, self.load(obj, name))
                except TypeError as err:
                    raise _NotFound(str(err)) from None
                self._loaded[name] = loaded
            return loaded[1]
        close = difflib.get_close_matches(str(name), list(self._entries), n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        dotted = ", or a package.module:attr of your own" if self._dotted else ""
        listed = ", ".join(repr(self._shown(n, e)) for n, e in self._entries.items())
        raise _NotFound(f"no such {self.kind}{hint}; expected one of {listed}{dotted}")

    def _import(self, path: str) -> Any:
        """The object ``package.module:attr`` names (the module imported if it is not yet)."""
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise _NotFound("expected package.module:attr")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise _NotFound(f"cannot import {module_name} ({type(err).__name__}: {err})") from None
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise _NotFound(f"{module_name} has no attribute {attr!r}")
            obj = getattr(obj, part)
        return obj

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs, in registration order."""
        return list(self._entries.items())

    def help(self) -> str:
        """``"'name' (description), ..."`` of every registered entry, built now."""

        def one(name: str, entry: T) -> str:
            text = self._describe(entry)
            said = repr(self._shown(name, entry))
            return f"{said} ({text})" if text else said

        return ", ".join(one(name, entry) for name, entry in self._entries.items())

    def live_help(self, before: str, after: str = "") -> LiveText:
        """A :class:`LiveText` ``before + help() + after`` for a config field's help, rebuilt whenever it is read
        (the entries' ``%`` escaped as ``%%`` for argparse; ``before`` and ``after`` follow argparse's rule
        themselves)."""
        return LiveText(lambda: before + self.help().replace("%", "%%") + after)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.option!r}: {', '.join(self._entries)})"


def _first_line(obj: Any) -> str:
    """A function's docstring's first line ("" without one)."""
    lines = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    return lines[0] if lines else ""


def _said(entry: Any) -> str:
    """An entry's line in :meth:`Registry.help`: its ``formula`` or ``description`` ("" for neither)."""
    return getattr(entry, "formula", "") or getattr(entry, "description", "") or ""
