"""Every command README.md and docs/*.md show, as shown: read out of their shell code blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("python", "torchrun", "pip", "aws")


@dataclass(frozen=True)
class Shown:
    command: str        # continuation lines joined, trailing `# comment` and a `$ ` prompt removed
    page: str
    line: int
    output: str | None  # after a `$ ` prompt: the line shown as its output


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _strip_comment(s: str) -> str:
    """Drop a trailing shell comment (a `#` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(s):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and s[i - 1].isspace():
            return s[:i].rstrip()
    return s.rstrip()


def shown_commands() -> list[Shown]:
    found: list[Shown] = []
    for page in pages():
        if not page.is_file():
            continue
        lang, buf, start = None, "", 0
        lines = page.read_text().splitlines()
        for n, raw in enumerate(lines, 1):
            fence = raw.strip()
            if fence.startswith("```"):
                lang = fence[3:].strip() if lang is None else None
                continue
            if lang not in ("bash", "sh", "console", "shell", ""):
                continue
            s = raw.strip()
            if not buf:
                start = n
            s = (buf + " " + s) if buf else s
            buf = ""
            if s.endswith("\\"):
                buf = s[:-1].rstrip()
                continue
            prompt = s.startswith("$ ")
            s = re.sub(r"^\$\s+", "", s)
            if not s or s.startswith("#") or s.split()[0] not in PROGRAMS:
                continue
            output = None
            if prompt and n < len(lines) and not lines[n].strip().startswith(("$", "```")):
                output = lines[n].strip()
            found.append(Shown(_strip_comment(s), page.name, start, output))
    return found
