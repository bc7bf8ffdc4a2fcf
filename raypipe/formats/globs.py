"""Globs over object storage's flat keys, read as a local ``glob(recursive=True)`` reads
them, so a remote source lists the shards (and gives the keys) a local copy does; and the
local walk of a folder, into its symlinked folders."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator

__all__ = ["glob_regex", "globbed", "hidden_below", "local_files"]
assert __all__ == sorted(__all__)


def glob_regex(pattern: str) -> re.Pattern:
    """``pattern`` as the local ``glob(recursive=True)`` reads it: ``*``, ``?`` and ``[...]``
    within one folder name, ``**`` across folders where it is a whole part of the path
    (``**/``: zero or more of them; inside a name, one ``*``); a name that starts with a dot
    (``._a.tar``, ``.cache/``) only where the pattern's part does."""
    out, i = [], 0
    while i < len(pattern):
        part = i == 0 or pattern[i - 1] == "/"
        whole = part and pattern.startswith("**", i) and pattern[i + 2 : i + 3] in ("", "/")
        if part and not whole and not pattern.startswith(".", i):
            out.append(r"(?!\.)")  # this part of the pattern names no hidden file
        if whole and pattern.startswith("**/", i):
            out.append(r"(?:(?!\.)[^/]*/)*")
            i += 3
        elif whole:
            out.append(r"(?:(?!\.)[^/]*(?:/(?!\.)[^/]*)*)?")
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
    folder into its files, hidden ones left out: `hidden_below`)."""
    base = pattern.rstrip("/")
    match = glob_regex(base).match
    # "a/**" matches the folder "a/" itself too, which a local source expands whole
    folder = glob_regex(base[:-3]).match if base.endswith("/**") else match
    files_too = not pattern.endswith("/")  # "d/*/" matches folders only
    out = []
    for uri in files:
        cuts = [i for i, c in enumerate(uri) if c == "/"]
        if (files_too and match(uri)) or any((match(uri[:i]) or folder(uri[:i]))
                             and not hidden_below(uri[:i], uri) for i in cuts):  # fmt: skip
            out.append(uri)
    return out


def local_files(root: str) -> Iterator[str]:
    """Every file under ``root``, into symlinked folders too (a class folder linked from
    another disk), each folder once (a link back up does not loop)."""
    seen: set[tuple[int, int]] = set()
    for folder, subs, names in os.walk(root, followlinks=True):
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            subs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        yield from (os.path.join(folder, n) for n in names)


def hidden_below(root: str, path: str) -> bool:
    """Whether a file or folder on ``path`` below ``root`` has a name that starts with a dot."""
    base = root.rstrip("/") + "/"
    below = path[len(base) :] if path.startswith(base) else os.path.basename(path)
    return any(part.startswith(".") for part in below.split("/"))
