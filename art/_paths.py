"""Where a file or a directory the user names will be written: checked at start-up, without
writing it, so a bad path fails before any model is built instead of at the first save.

Each check returns what is wrong (one clause for an error message) or None. Writability is
tried, not inferred from permission bits (root passes those everywhere, while a read-only
mount or /proc refuses anyway): a temporary file is created in the directory that a save
would write into, or in its nearest existing ancestor when that directory does not exist
yet, and removed again.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def file_path_problem(path: str | Path) -> str | None:
    """What stops `path` from being read and replaced as a regular file (written through a
    temporary beside it, its missing parent directories created), or None."""
    target = Path(path)
    if target.is_dir():
        return (f"is a directory, not a file; name a file inside it, e.g. "
                f"{target / 'profiles.json'}")
    if target.exists() and not target.is_file():
        return "exists and is not a regular file; name a regular file (or a new one)"
    parent = target.parent
    problem = directory_problem(parent)
    return None if problem is None else f"its directory {parent} {problem}"


def directory_problem(path: str | Path) -> str | None:
    """What stops files from being written into the directory `path` (created with its
    parents when missing), as a clause whose subject is the directory, or None."""
    directory = Path(path) if str(path) else Path(".")
    ancestor = directory
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        where = "is" if ancestor == directory else f"is under {ancestor}, which is"
        return f"{where} a file, not a directory; choose a path under a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".art-write-check-", dir=ancestor)
    except OSError as error:
        where = "it" if ancestor == directory else f"{ancestor}, to create it,"
        return (f"cannot be written (creating a file in {where} fails: "
                f"{error.strerror or error}); choose a writable location")
    os.close(fd)
    os.unlink(probe)
    return None
