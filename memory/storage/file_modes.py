"""What memproxy writes on disk is its own account's alone: the data directory 0700, its
files 0600, whatever the process's umask (docs/security.md, the files on disk).

memproxy does not change the process's umask (a library user's process would inherit it).
It makes the directories it creates 0700 and the files it owns 0600 itself. SQLite gives a
database's -wal and -shm files the mode of the database file, so a database is created 0600
before SQLite opens it. Chroma writes its files with the umask's mode; its folder is made
0700 and tightened after each write to the index, so nothing in it is ever readable by
another account (the directory alone already keeps them out).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# Group and other bits: any of them lets another local account in.
_SHARED = 0o077
# SQLite's companion files of a database in WAL mode.
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")

log = logging.getLogger("memproxy.memory.files")


def private_dir(path: Path) -> None:
    """Create `path` and its missing parents as 0700 directories; an existing directory
    keeps its mode (the operator chose it: `warn_if_shared` says when it is wider)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=PRIVATE_DIR)
            os.chmod(folder, PRIVATE_DIR)  # the umask may have taken bits from the mode


def private_file(path: Path) -> None:
    """Make a file memproxy owns 0600, if it exists."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_IMODE(path.stat().st_mode) != PRIVATE_FILE:
            os.chmod(path, PRIVATE_FILE)


def private_database(path: Path) -> None:
    """Create a SQLite database file 0600 before SQLite opens it (its WAL and SHM then
    take that mode), and tighten the files of one that exists."""
    private_dir(path.parent)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE))
    for file in (path, *(path.with_name(path.name + end) for end in SQLITE_SIDECARS)):
        private_file(file)


def private_tree(root: Path) -> None:
    """`root` and every directory under it 0700, every file 0600 (a library's files)."""
    _tighten(root, PRIVATE_DIR)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            _tighten(Path(folder, name), PRIVATE_DIR)
        for name in files:
            _tighten(Path(folder, name), PRIVATE_FILE)


def _tighten(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_IMODE(path.lstat().st_mode) & ~mode and not path.is_symlink():
            os.chmod(path, mode)


def open_data_dir(path: Path) -> None:
    """At start: create the data directory 0700, or warn when an existing one is wider."""
    if path.exists():
        warn_if_shared(path)
    else:
        private_dir(path)


def warn_if_shared(path: Path) -> bool:
    """Log a warning when an existing data directory lets other local accounts in; True
    when it does."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return False
    if not mode & _SHARED:
        return False
    log.warning(
        "the data directory %s is %04o: other local accounts can list it and read the memory "
        "files in it that are not 0600; make it 0700 (chmod 700 %s)", path, mode, path,
    )
    return True
