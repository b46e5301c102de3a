"""Text from data (class names) inside markdown: a table cell that stays one cell, a code block that stays one block.

``escape(text)`` makes inline text (a table cell, a list item's text) render as exactly that text in
CommonMark and GitHub's markdown (GFM): no emphasis, code, links, HTML, math or extra table columns.
Markdown punctuation gets a backslash; ``& < >`` become HTML entities, so no tag is ever raw; ``:``,
``@`` and the dot of ``www.`` become entities, because GFM turns ``http://x``, ``www.x`` and
``a@b.c`` into links without any brackets; newlines and the spaces a table cell would trim become
numeric entities. Rendering the result and reading the text back gives ``text`` unchanged.

``fenced(text, info)`` is a fenced code block whose fence is longer than any run of backticks in
``text``, so no content closes it early.
"""

from __future__ import annotations

import re

_BACKSLASHED = frozenset("\\`*_[]|~$")  # emphasis, code, links, table columns, strikethrough, GitHub math
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", ":": "&#58;", "@": "&#64;", "\n": "&#10;", "\r": "&#13;"}
_WWW = re.compile(r"(?i)(www)\.")
_EDGE_SPACE = " \t"


def escape(text: str) -> str:
    """``text`` as inline markdown that renders to ``text`` itself (see the module docstring)."""
    text = str(text)
    out = "".join(_ENTITIES.get(ch) or ("\\" + ch if ch in _BACKSLASHED else ch) for ch in text)
    out = _WWW.sub(r"\1&#46;", out)
    core = out.strip(_EDGE_SPACE)  # a table cell drops its edge spaces; entities keep them
    if core == out:
        return out
    lead = out[:len(out) - len(out.lstrip(_EDGE_SPACE))]
    trail = out[len(out.rstrip(_EDGE_SPACE)):] if core else ""
    return "".join(f"&#{ord(c)};" for c in lead) + core + "".join(f"&#{ord(c)};" for c in trail)


def fenced(text: str, info: str = "") -> str:
    """``text`` in a fenced code block (ending in a newline) that nothing inside it can close."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{fence}\n"
