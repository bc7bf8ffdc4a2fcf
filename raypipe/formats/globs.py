"""Globs over object storage's flat keys, read as a local ``glob(recursive=True)`` reads
them, so a remote source lists the shards (and gives the keys) a local copy does."""

from __future__ import annotations

import fnmatch
import re

__all__ = ["glob_regex", "globbed"]
assert __all__ == sorted(__all__)


def glob_regex(pattern: str) -> re.Pattern:
    """``pattern`` as the local ``glob(recursive=True)`` reads it: ``*``, ``?`` and ``[...]``
    within one folder name, ``**`` across folders (``**/``: zero or more of them)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] in "*?":
            out.append("[^/]*" if pattern[i] == "*" else "[^/]")
            i += 1
        elif (
            pattern[i] == "["
            and (end := pattern.find("]", i + 2 + (pattern[i + 1 : i + 2] == "!"))) > 0
        ):
            out.append("(?!/)" + fnmatch.translate(pattern[i : end + 1])[4:-3])  # the class
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def globbed(files, pattern: str) -> list[str]:
    """The ``files`` (object keys, sorted) a local glob of ``pattern`` would reach: those
    it matches, and those under a folder it matches (a local source expands a matched
    folder into its files)."""
    match = glob_regex(pattern.rstrip("/")).match
    out = []
    for uri in files:
        cuts = [i for i, c in enumerate(uri) if c == "/"]
        if match(uri) or any(match(uri[:i]) for i in cuts):
            out.append(uri)
    return out
