"""Publishing a freshly written checkpoint directory in place of an old one in a single
atomic step, keeping the old directory's files that the new one does not replace."""

import ctypes
import errno
import glob
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_ASIDE = ".old"  # suffix of an old checkpoint moved aside by the two-rename swap


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux `renameat2(RENAME_EXCHANGE)`).
    Returns `False` where the system or the filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sync_tree(directory: Path) -> None:
    """Flush every file under `directory`, and the directories, to disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_directory(Path(root))


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep(source: Path, target: Path) -> None:
    """Give `target` the file `source` holds: a hard link (the same file, untouched), or
    a copy where the filesystem has no links."""
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        target.mkdir()
        for entry in source.iterdir():
            _keep(entry, target / entry.name)
        shutil.copystat(source, target)
    else:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def _prefix(target: Path) -> str:
    return f".{target.name}.eqdel-save-"


def staging_directory(target: Path) -> Path:
    """A new, empty directory beside `target` to write its next contents into, after
    putting right what a save killed part-way left beside it: an old checkpoint moved
    aside by the two-rename swap goes back to `target` if `target` is missing; anything
    else is an unfinished or superseded copy and is removed."""
    for leftover in sorted(target.parent.glob(glob.escape(_prefix(target)) + "*")):
        if leftover.name.endswith(_ASIDE) and not target.exists():
            os.rename(leftover, target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    staging = target.with_name(_prefix(target) + uuid.uuid4().hex[:12])
    staging.mkdir()
    return staging


def replace_directory(new: Path, target: Path, replaced: Callable[[str], bool]) -> None:
    """Make `target` hold `new`'s files plus every entry of the old `target` whose name
    `replaced` rejects, in one atomic step: a kill at any moment leaves `target` either
    as it was or complete with the new files (where the filesystem cannot swap two
    directories, a kill between two renames leaves the old one beside `target`, which
    `staging_directory` puts back). `new` comes from `staging_directory(target)`; it
    takes the old directory's permissions and holds the old contents once the new ones
    are in place.
    """
    if target.exists():
        for entry in target.iterdir():
            if not replaced(entry.name) and not (new / entry.name).exists():
                _keep(entry, new / entry.name)
        shutil.copymode(target, new)
    _sync_tree(new)
    if not target.exists():
        os.rename(new, target)
    elif not _exchange(new, target):
        # No atomic swap here: two renames, with an instant in between when `target`
        # is absent and the old directory waits under `new`'s name.
        aside = new.with_name(new.name + _ASIDE)
        os.rename(target, aside)
        os.rename(new, target)
        os.rename(aside, new)
    _sync_directory(target.parent)
