"""Crash-safe writes: build in a temporary sibling, fsync, then rename over the target.

The contract, for a file (:func:`atomic_write`) and a folder (:func:`atomic_directory`) alike:

- a write that fails part-way (a full disk, a file size limit, an I/O error) raises one :class:`WriteError` naming
  the path, removes its temporary sibling (a full disk is not made fuller) and leaves the previous file / folder at
  ``target`` as it was;
- a process killed while writing leaves the previous one at ``target`` too; its temporary sibling is removed by the
  next write of the same target from the same host (the writer's pid is in the name, and it is dead);
- the new file / folder has the permissions of any file / folder the process creates (0644 / 0755 under a umask of
  022), not the private 0600 / 0700 of the temporary sibling it was built in: a model meant to be shared can be read;
- once the call returns, the new one is durable: its files and folders are fsynced before the rename, the parent
  folder after it (power loss keeps either the old or the new, never an empty file).

A folder replaces a folder in one step where the filesystem has ``renameat2(RENAME_EXCHANGE)`` (Linux: ext4, xfs,
btrfs, tmpfs...). Elsewhere (NFS, Lustre, macOS) it takes two renames, ``target -> .<name>.old`` and
``tmp -> target``; a process killed between the two (microseconds) leaves the previous folder whole at
``.<name>.old``: the next write of ``target`` renames it back first, and :func:`readable_path` (the project's
readers) reads it there meanwhile. One writer per target (rank 0 writes checkpoints and exports).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


class WriteError(OSError):
    """A file or folder could not be written; nothing at ``path`` was replaced. ``reason``: the storage's own words
    ("No space left on device", "File too large")."""

    def __init__(self, path: str | Path, reason: str, code: int | None = None):
        super().__init__(code, reason)
        self.path, self.reason = Path(path), " ".join(str(reason).split())

    @classmethod
    def of(cls, path: str | Path, error: BaseException) -> "WriteError":
        cause = storage_cause(error) or error
        code = getattr(cause, "errno", None)
        return cls(path, (os.strerror(code) if code else "") or f"{type(cause).__name__}: {cause}", code)

    def __reduce__(self):  # OSError's own would rebuild it from (errno, strerror)
        return type(self), (str(self.path), self.reason, self.errno)

    def __str__(self) -> str:
        return (f"could not write {str(self.path)!r} ({self.reason}); nothing was replaced: the previous "
                f"{self.path.name}, if any, is intact")


def is_write_failure(err: BaseException) -> bool:
    """An error of the storage (a full disk, a size limit, an I/O error), as the writers we use raise them."""
    return isinstance(err, OSError) or type(err).__name__ == "SafetensorError"  # safetensors: "I/O error: ..."


def storage_cause(error: BaseException | None) -> BaseException | None:
    """The storage's own error behind ``error``: itself, one it was raised from, or one a rank of a distributed
    checkpoint raised (``torch.distributed.checkpoint``'s CheckpointException holds them by rank)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if is_write_failure(error):
            return error
        failures = getattr(error, "failures", None)  # CheckpointException: {rank: (error, traceback)}
        for failure in failures.values() if isinstance(failures, dict) else ():
            found = storage_cause(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        error = error.__cause__ or error.__context__
    return None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _temp_prefix(target: Path) -> str:
    """``.<name>.tmp-<host>-<pid>-``: hidden (no reader lists it), and whose it is (see :func:`remove_stale_temps`)."""
    return f".{target.name}.tmp-{_host()}-{os.getpid()}-"


def _old_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temps(target: Path) -> None:
    """Remove the temporary siblings of ``target`` left by killed writers of this host (their pid is dead)."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.tmp-{re.escape(_host())}-(\d+)-")
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return
    for sibling in siblings:
        match = pattern.match(sibling.name)
        if match and not _alive(int(match.group(1))):
            _remove(sibling)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (its entries); a filesystem that cannot fsync a folder is let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (folders after their contents)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``); False where the system or the filesystem
    has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def recover_directory(target: Path) -> None:
    """A writer killed between the fallback's two renames left no ``target`` and the previous one whole at
    ``.<name>.old``: rename it back."""
    old = _old_name(target)
    if not os.path.lexists(target) and old.is_dir():
        os.rename(old, target)


def remove_directory(target: str | Path) -> None:
    """Remove the folder ``target`` (and an earlier one a killed writer left at ``.<name>.old``, which would otherwise be
    renamed back) so that no reader finds a half-removed one: each is first renamed to a hidden temporary sibling,
    then deleted; what a killed remover leaves there goes with the next write's clean-up (:func:`remove_stale_temps`)."""
    target = Path(target)
    for folder in (_old_name(target), target):  # the .old one first: alone it would be recovered as target
        if not folder.is_dir() or folder.is_symlink():
            continue
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
        os.rename(folder, tmp)  # onto the empty folder: one atomic step
        _sync_parent(target)
        shutil.rmtree(tmp, ignore_errors=True)


def readable_path(path: str | Path) -> Path:
    """``path``, or where it lies while a writer killed between the fallback's two renames left its folder (or a
    folder above it) at ``.<name>.old`` (see the module docstring)."""
    path = Path(path)
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            return path
        old = _old_name(folder)
        if old.is_dir():
            return old / path.relative_to(folder)
    return path


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux: /proc/self/status)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only way to read it is to set it (and put it back at once)
    os.umask(mask)
    return mask


def as_created(path: str | Path, folder: bool = False, mask: int | None = None) -> None:
    """Give a temporary file (0600) or folder (0700) the permissions ``open`` / ``mkdir`` would have given it (an
    executable file stays executable where the umask lets it)."""
    executable = folder or os.stat(path).st_mode & 0o111
    os.chmod(path, (0o777 if executable else 0o666) & ~(umask() if mask is None else mask))


def as_created_tree(root: Path) -> None:
    """:func:`as_created` for ``root`` and everything under it: writers that keep their files private (safetensors
    writes 0600) or build in a temporary folder (0700) leave what the umask gives."""
    mask = umask()
    for folder, _, files in os.walk(root):
        as_created(folder, folder=True, mask=mask)
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):  # a link's mode is its target's: not ours to change
                as_created(os.path.join(folder, name), mask=mask)


def new_temp_directory(target: str | Path) -> Path:
    """A fresh temporary sibling of ``target`` to build the new folder in (after recovering ``target`` and removing
    what killed writers left), with a new folder's permissions."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(target)
    remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    as_created(tmp, folder=True)
    return tmp


def discard(tmp: Path) -> None:
    """Remove a temporary folder a failed write leaves (a full disk is not made fuller)."""
    shutil.rmtree(tmp, ignore_errors=True)


def replace_directory(tmp: Path, target: Path) -> None:
    """Make the whole folder ``tmp`` the new ``target`` (fsynced, with the permissions the umask gives), and remove the
    previous one."""
    as_created_tree(tmp)
    fsync_tree(tmp)
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif exchange(tmp, target):  # tmp now holds the previous folder
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = _old_name(target)
        shutil.rmtree(old, ignore_errors=True)  # a partly removed one from an earlier write (target exists)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _sync_parent(target)


def _sync_parent(target: Path) -> None:
    """The rename made durable; the new one is in place already, so a failure here is no failed write."""
    try:
        fsync_path(target.parent)
    except OSError:
        pass


@contextmanager
def atomic_directory(target: str | Path):
    """Yield a fresh temporary directory; once the block ends it replaces ``target`` whole.

    A failure inside the block or of the write itself removes the temporary directory and leaves the previous
    ``target``; a storage error (:func:`is_write_failure`) is raised as :class:`WriteError` naming ``target``.
    """
    target = Path(target)
    try:
        tmp = new_temp_directory(target)
    except OSError as err:
        raise WriteError.of(target, err) from err
    try:
        yield tmp
        replace_directory(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, WriteError) and (err.path == tmp or tmp in err.path.parents):  # a file inside: name target
            raise WriteError(target, err.reason, err.errno) from err
        if is_write_failure(err) and not isinstance(err, WriteError):
            raise WriteError.of(target, err) from err
        raise


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, fsync, then rename onto ``path`` (and fsync its folder). A storage error raises
    :class:`WriteError` naming ``path``; the temporary file is removed and ``path`` left as it was."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), dir=path.parent)
        os.close(fd)
        write(tmp)
        as_created(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if is_write_failure(err) and not isinstance(err, WriteError):
            raise WriteError.of(path, err) from err
        raise
    _sync_parent(path)
