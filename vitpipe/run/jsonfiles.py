"""The one JSON reader for every JSON file or request body someone hands us: bounded in depth and size.

Python's parser recurses once per nested array or object: a 2 KB text nested 1,000 deep raises
RecursionError (an uncaught crash, a plain-text 500 in a server), and a file of gigabytes is read
whole. ``loads`` measures the nesting before parsing (a scan outside strings, no recursion) and refuses
more than ``max_depth`` levels; ``read_json`` refuses a file over ``max_bytes`` before reading it. Both
raise ``JSONInputError`` (a ValueError, as a JSON syntax error is) with a message naming the limit, so
a caller that already turns ValueError into a one-line error or a 4xx needs nothing more.

What vitpipe hands itself (calibration.json, thresholds.json, a request body) is a few levels deep;
``MAX_DEPTH`` leaves room for any such record and none for a stack overflow.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path

MAX_DEPTH = 32  # arrays/objects inside each other
MAX_FILE_BYTES = 16 * 2**20

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONInputError(ValueError):
    """A JSON text refused before parsing: nested too deep or too large."""


def nesting_depth(text: str) -> int:
    """How many arrays/objects ``text`` holds inside each other at most (brackets inside strings not
    counted; no recursion, so any depth is measured)."""
    steps = map(_STEP.__getitem__, _BRACKET.findall(_STRING.sub("", text)))
    return max(accumulate(steps), default=0)


def loads(data: str | bytes | bytearray, *, max_depth: int = MAX_DEPTH):
    """``json.loads(data)`` after checking that it nests at most ``max_depth`` levels.

    Raises JSONInputError (too deep), json.JSONDecodeError (not JSON) or UnicodeDecodeError (bytes in
    no JSON encoding): all ValueErrors."""
    text = data.decode(json.detect_encoding(data), "surrogatepass") if isinstance(data, (bytes, bytearray)) else data
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONInputError(f"the JSON is nested {depth} levels deep (arrays/objects inside each other); "
                             f"at most {max_depth} are read")
    try:
        return json.loads(text)
    except RecursionError:  # unreachable within max_depth; kept so no caller ever sees it
        raise JSONInputError(f"the JSON is nested too deeply to parse; at most {max_depth} levels are read") from None


def read_json(path, *, max_bytes: int = MAX_FILE_BYTES, max_depth: int = MAX_DEPTH):
    """The JSON value in the file ``path`` (``loads``'s checks), refusing a file over ``max_bytes``
    without reading it whole. Raises OSError (unreadable) or a ValueError naming the problem."""
    with Path(path).open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JSONInputError(f"the file is over {max_bytes / 2**20:g} MiB; a JSON file vitpipe reads is at most that")
    return loads(data, max_depth=max_depth)
