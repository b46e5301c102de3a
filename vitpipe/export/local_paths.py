"""No local path in what export writes for sharing.

A stored config holds resolved absolute paths (``paths.*``, ``data.root``, ``model.pretrained``,
``module.distill.teacher``, ...) and Hydra's ``overrides.yaml`` holds the command as typed: shown raw,
a card pushed to the Hub reads ``/home/<user>/...``. Every absolute path found in a string
(``/x``, ``~/x``, ``~user/x``, ``file:///x``, ``C:\\x``) is rewritten: relative to the directory training
was started in (``paths.root_dir``) when it lies under it (``data/cifar10``, as the command would be
typed there), else ``<local path>``. URLs (``https://host/a``, ``s3://bucket/a``) are not local paths
and stay.
"""

from __future__ import annotations

import posixpath
import re

LOCAL = "<local path>"
# how a path starts: "/x" (not "//": a URL's), "~/x" or "~user/x", "file:///x", "C:\\x"
_START = r"""(?:file://)?(?:/(?!/)|~[\w.-]*(?=/|$)|[A-Za-z]:\\)"""
# inside other text a path starts after the text's start, a space, a quote, "=", "(", "[", "{", "," or ":"
# (not after a letter: "a/b" and "https://x/y" are no match) and runs to a space, quote or bracket
_IN_TEXT = re.compile(r"""(?:^|(?<=[\s"'=(\[{,:]))""" + _START + r"""[^\s"'`,;)\]}]*""")
_WHOLE = re.compile(_START)


def _rewrite(path: str, root: str | None) -> str:
    path = path.removeprefix("file://")
    if root and path.startswith("/"):
        norm = posixpath.normpath(path)
        if norm == root or norm.startswith(root.rstrip("/") + "/"):
            return posixpath.relpath(norm, root)
    return LOCAL


def _root(root) -> str | None:
    return posixpath.normpath(str(root)) if root and str(root).startswith("/") else None


def scrub(text: str, root: str | None = None) -> str:
    """``text`` with each absolute path made relative to ``root`` (when under it) or replaced by ``<local path>``.

    A text that starts with a path is one path, spaces included (a value such as ``/data/my images``);
    in any other text each path runs to the next space, quote or bracket.
    """
    root = _root(root)
    if _WHOLE.match(text):
        return _rewrite(text, root)
    return _IN_TEXT.sub(lambda m: _rewrite(m.group(0), root), text)


def scrub_tree(value, root: str | None = None):
    """A copy of a JSON-like value (dicts, lists, strings) with every string ``scrub``-bed (keys too)."""
    if isinstance(value, dict):
        return {scrub(str(k), root): scrub_tree(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_tree(v, root) for v in value]
    return scrub(value, root) if isinstance(value, str) else value


def scrub_override(override: str, root: str | None = None) -> str:
    """A Hydra command-line override (``key=value``, the value possibly quoted) with its paths ``scrub``-bed."""
    key, eq, value = override.partition("=")
    if not eq:
        return scrub(override, root)
    quote = value[0] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else ""
    inner = scrub(value[1:-1] if quote else value, root)
    if not quote and inner != LOCAL and any(c.isspace() for c in inner):
        quote = "'"
    return f"{scrub(key, root)}={quote}{inner}{quote}"
