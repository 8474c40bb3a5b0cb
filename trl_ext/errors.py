"""Bad user input, in one vocabulary from the library up to the command line (a leaf: imports nothing of trl_ext).

:class:`RecipeError` is what a recipe's user can fix (a flag, a config file, a data file, an output folder);
``trl_ext.cli.main`` shows it as one ``error:`` line and exit status 2, no traceback. :func:`user_input` turns the
ValueError/FileNotFoundError of a loader into one, prefixed with the flag that named the input.
"""

from __future__ import annotations

from contextlib import contextmanager


class RecipeError(ValueError):
    """Bad user input (a flag, a config file, a data file, an output folder): shown as one line, no traceback."""


@contextmanager
def user_input(what: str = ""):
    """Turn ValueError/FileNotFoundError raised while reading user input (data files, options) into RecipeError."""
    try:
        yield
    except RecipeError:
        raise
    except (ValueError, FileNotFoundError) as err:
        raise RecipeError(f"{what}{err}") from None
