"""The one CSV writer and reader of every table vitpipe writes (predictions, reports, sweeps, histories).

Cells come from names someone handed us (class folders, labels files, image paths, overrides), and a
spreadsheet evaluates a cell that begins with ``=``, ``+``, ``-`` or ``@`` as a formula (CSV injection).
So the writer prefixes such a cell with a single quote, OWASP's recommendation
(https://owasp.org/www-community/attacks/CSV_Injection), and the reader strips exactly that quote:

* escaped: a cell whose text begins with ``= + - @``, a tab, CR or LF, their full-width forms, or a
  quote ``'`` itself (so a name that begins with ``'`` reads back unchanged), unless the whole cell is a
  plain decimal number (``-0.5``, ``-1e-3``: a spreadsheet reads those as numbers, never as formulas);
* a row holding a CR anywhere is written with every cell quoted (Python's writer quotes only the
  line terminator ``\\n``, and a bare CR would end the row for a reader).

``csv_text``/``write_csv`` and ``read_csv``/``read_csv_dicts`` are the pair: what the first writes, the
second gives back cell for cell, as strings. Labels files (``data.labels=<name>.csv``) are the user's
own format and read literally (``vitpipe.data.multilabel``), not through here.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path

from vitpipe.run.files import atomic_write_text

QUOTE = "'"
FORMULA_STARTS = frozenset("=+-@\t\r\n\uff1d\uff0b\uff0d\uff20")  # OWASP's list, LF, full-width = + - @
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def escape_cell(value) -> str:
    """The text a cell holding ``value`` is written as (see the module docstring)."""
    text = "" if value is None else value if isinstance(value, str) else str(value)  # None: empty, as csv writes it
    if text and (text[0] == QUOTE or (text[0] in FORMULA_STARTS and not _NUMBER.fullmatch(text))):
        return QUOTE + text
    return text


def unescape_cell(text: str) -> str:
    """The value ``escape_cell`` wrote as ``text``: one leading quote removed."""
    return text[1:] if text.startswith(QUOTE) else text


def csv_text(rows: Iterable[Sequence], header: Sequence[str] | None = None) -> str:
    """``header`` then ``rows`` (sequences of cells) as CSV text, ``\\n`` line ends, every cell escaped."""
    buf = io.StringIO()
    plain = csv.writer(buf, lineterminator="\n")
    quoted = csv.writer(buf, lineterminator="\n", quoting=csv.QUOTE_ALL)
    for row in chain([header] if header is not None else [], rows):
        cells = [escape_cell(c) for c in row]
        (quoted if any("\r" in c for c in cells) else plain).writerow(cells)
    return buf.getvalue()


def dict_csv_text(rows: Iterable[dict], columns: Sequence[str], *, missing: str = "") -> str:
    """``rows`` (dicts) under the header ``columns``; a key not in ``columns`` is left out, a column a
    row lacks is ``missing``."""
    return csv_text(([r.get(c, missing) for c in columns] for r in rows), header=list(columns))


def write_csv(path, rows: Iterable[Sequence], header: Sequence[str] | None = None) -> Path:
    """``csv_text`` written through a temporary file and a rename (``atomic_write_text``)."""
    atomic_write_text(Path(path), csv_text(rows, header))
    return Path(path)


def read_csv(path) -> list[list[str]]:
    """Every row of a CSV vitpipe wrote (the header first), cells unescaped."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        return [[unescape_cell(c) for c in row] for row in csv.reader(f)]


def read_csv_dicts(path) -> list[dict[str, str]]:
    """The rows after the header as {column: cell}, cells and column names unescaped."""
    rows = read_csv(path)
    if not rows:
        return []
    header = rows[0]
    return [dict(zip(header, r)) for r in rows[1:]]


def read_header(path) -> list[str]:
    """The header row alone (unescaped); [] for an empty file."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        return [unescape_cell(c) for c in next(csv.reader(f), [])]
