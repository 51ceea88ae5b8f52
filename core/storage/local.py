"""Storage in a local directory.

Each key is a file under ``root``. A write goes to a hidden temporary file (``.tmp-…``) in the
object's own directory, is flushed and fsynced, and is renamed over the key with ``os.replace``
only when the ``writer`` block exits cleanly; the directory is fsynced after the rename. A
failed write removes its temporary file. Concurrent writes to different keys are safe; two
concurrent writes to the same key end with one of them, whole.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from core.storage.base import (
    TEMP_PREFIX,
    ObjectNotFound,
    Storage,
    StorageError,
    check_range,
    normalize_prefix,
    validate_key,
)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    # -- paths -----------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (which need not exist)."""
        return self.root.joinpath(*validate_key(key).split("/"))

    def _dir(self, prefix: str) -> Path:
        prefix = normalize_prefix(prefix)
        return self.root.joinpath(*prefix.split("/")) if prefix else self.root

    def _prune_empty_parents(self, path: Path) -> None:
        """Remove now-empty directories from ``path`` up to (not including) the root."""
        while path != self.root and self.root in path.parents:
            try:
                path.rmdir()
            except OSError:
                return
            path = path.parent

    # -- writing ---------------------------------------------------------------------------

    def _make_temp(self, parent: Path) -> tuple[int, str]:
        # A concurrent delete may prune the directory between makedirs and mkstemp: retry.
        for attempt in range(5):
            parent.mkdir(parents=True, exist_ok=True)
            try:
                return tempfile.mkstemp(prefix=TEMP_PREFIX, dir=parent)
            except FileNotFoundError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        target = self.path(key)
        if target.is_dir():
            raise StorageError(f"cannot write {key!r}: a directory of keys has that name")
        try:
            fd, tmp = self._make_temp(target.parent)
        except (NotADirectoryError, FileExistsError) as exc:
            raise StorageError(f"cannot write {key!r}: a parent of it is an object") from exc
        stream = os.fdopen(fd, "wb")
        try:
            yield stream
            if not stream.closed:
                stream.flush()
                os.fsync(stream.fileno())
                stream.close()
            else:  # closed inside the block (e.g. by a TextIOWrapper): fsync through a new fd
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            stream.close()
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(target.parent)

    # -- reading ---------------------------------------------------------------------------

    def _open(self, key: str) -> BinaryIO:
        path = self.path(key)
        try:
            return open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise ObjectNotFound(key) from exc

    def read_range(
        self, key: str, start: int, end: int, *, chunk_size: int = 1 << 20
    ) -> Iterator[bytes]:
        check_range(start, end, chunk_size)
        stream = self._open(key)  # raise ObjectNotFound now, not at the first next()
        return self._iter_range(stream, start, end, chunk_size)

    @staticmethod
    def _iter_range(stream: BinaryIO, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        with stream:
            stream.seek(start)
            remaining = end - start
            while remaining > 0:
                chunk = stream.read(min(chunk_size, remaining))
                if not chunk:
                    return
                remaining -= len(chunk)
                yield chunk

    def size(self, key: str) -> int:
        path = self.path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        if not path.is_file():
            raise ObjectNotFound(key)
        return st.st_size

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._dir(prefix)
        if not base.is_dir():
            return []
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                keys.append(name if rel == "." else f"{rel}/{name}")
        keys.sort()
        return keys

    # -- deleting --------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return  # a "directory" of keys is not an object; delete_prefix removes those
        except PermissionError:
            if path.is_dir():  # macOS reports EPERM for unlink() on a directory
                return
            raise
        self._prune_empty_parents(path.parent)

    def delete_prefix(self, prefix: str) -> None:
        base = self._dir(prefix)
        if base == self.root:
            for child in list(self.root.iterdir()):
                if child.name.startswith(TEMP_PREFIX):
                    continue  # an in-flight write, not an object
                if child.is_dir() and not child.is_symlink():
                    self._remove_tree(child)
                else:
                    child.unlink(missing_ok=True)
            return
        self._remove_tree(base)
        self._prune_empty_parents(base.parent)

    @staticmethod
    def _remove_tree(path: Path) -> None:
        if not path.is_dir() or path.is_symlink():
            return  # a file named like the prefix is an object, not under the prefix: keep it

        def ignore_vanished(exc: BaseException) -> None:  # a concurrent delete got there first
            if not isinstance(exc, FileNotFoundError):
                raise exc

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=lambda func, p, exc: ignore_vanished(exc))
        else:
            shutil.rmtree(path, onerror=lambda func, p, info: ignore_vanished(info[1]))


__all__ = ["LocalStorage"]
