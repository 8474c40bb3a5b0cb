"""Bad user input, in one vocabulary from the library up to the command line (a leaf: imports nothing of trl_ext).

:class:`RecipeError` is what a recipe's user can fix (a flag, a config file, a data file, an output folder);
``trl_ext.cli.main`` shows it as one ``error:`` line and exit status 2, no traceback. :func:`user_input` turns the
ValueError/FileNotFoundError of a loader into one, prefixed with the flag that named the input. :func:`read_text`
reads a user's text file the one way every reader in trl_ext does (UTF-8, byte-order marks handled, a file in another
encoding refused in one line naming it).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


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


# --------------------------------------------------------------------------------------------- user text files
_BOMS = (  # longest first: the UTF-32-LE mark begins with the UTF-16-LE one
    (b"\xff\xfe\x00\x00", "utf-32-le", "UTF-32"),
    (b"\x00\x00\xfe\xff", "utf-32-be", "UTF-32"),
    (b"\xef\xbb\xbf", "utf-8", "UTF-8"),
    (b"\xff\xfe", "utf-16-le", "UTF-16"),
    (b"\xfe\xff", "utf-16-be", "UTF-16"),
)


def decode_text(data: bytes, where: str) -> str:
    """The text of a user's file (template, data, YAML) from its bytes: UTF-8 with a byte-order mark dropped, or
    UTF-16/UTF-32 when its byte-order mark says so; line ends as ``open()`` reads them.

    Args:
        data: the file's bytes.
        where: the file, for messages.

    Raises:
        ValueError: NUL bytes (UTF-16/32 without a mark), or not UTF-8 (naming the first bad byte, its line and
            column)."""
    for bom, codec, name in _BOMS:
        if data.startswith(bom):
            try:
                text = data[len(bom) :].decode(codec)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: starts with a {name} byte-order mark but is not {name} ({err.reason})"
                ) from None
            break
    else:
        if b"\0" in data:  # no text file holds NUL; UTF-16/32 text does, in every ASCII character
            line = data.count(b"\n", 0, data.index(b"\0")) + 1
            raise ValueError(
                f"{where}: holds NUL bytes (line {line}): UTF-16 or UTF-32 without a byte-order mark?; save it as UTF-8"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
            raise ValueError(
                f"{where}: not UTF-8 text (byte 0x{data[err.start]:02x} at line {line}, column {column}; a cp1252 or "
                "latin-1 file?); save it as UTF-8"
            ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: str | os.PathLike) -> str:
    """The text of a user's file (:func:`decode_text`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: see :func:`decode_text` (the message starts with the path).
    """
    return decode_text(Path(path).read_bytes(), str(path))
