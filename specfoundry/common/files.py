"""Small file helpers shared by every stage: atomic writes and checksums."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def process_umask() -> int:
    """The process's file-creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = process_umask()
"""Read once, on import (setting the umask to read it is not safe while other threads create files)."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write next to ``path`` and rename into place: readers see the old file or the new one. The
    file gets the permissions open() would give it (0666 less the umask), not mkstemp's 0600: an
    export is read by a serving engine that may run as another user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            # a failed write() (a full disk) names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def remove_temporaries(folder: Path) -> None:
    """Remove the temporary files (`.<name>.*.tmp`) that atomic_write_bytes leaves in `folder`
    when its process is killed mid-write. Call it only while nothing writes into the folder."""
    for p in Path(folder).glob(".*.tmp"):
        if p.is_file():
            p.unlink(missing_ok=True)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def checksum(path: Path) -> str:
    """sha256 over a file, or over a folder's files (relative names and bytes, sorted): the one
    checksum of every shard, done mark and manifest entry."""
    path = Path(path)
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if f != path:
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


TMP_SUFFIX = ".tmp"
"""What a directory being written is called beside its final name (renamed once complete)."""


def replace_dir(tmp: Path, dest: Path) -> None:
    """Put the complete directory `tmp` at `dest`: a reader sees the old directory or the new one
    (briefly neither, never a partial one). Its files get open()'s permissions first (0666 less
    the umask): safetensors writes its files owner-only, and a serving engine running as another
    user reads an export."""
    for f in Path(tmp).rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~UMASK)
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def write_dir_whole(dest: Path, fill) -> None:
    """`fill(tmp)` writes a directory's files into a fresh hidden `tmp` beside `dest`, which then
    replaces `dest` whole (replace_dir). On any failure `tmp` is removed, nothing is left behind,
    and a full disk is the one-line OSError naming `dest` (disk_full)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}{TMP_SUFFIX}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full(e, dest)
        if full is not None:
            raise full from e
        raise
    replace_dir(tmp, dest)


def disk_full(e: BaseException, path: Path) -> OSError | None:
    """The OSError (ENOSPC, naming `path`) that `e` is, where it says the disk is full: torch.save
    and safetensors raise their own types for it (RuntimeError, SafetensorError), which name no file
    and make a traceback of what is one line. None for any other error."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    if isinstance(e, Exception) and "No space left on device" in str(e):
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    return None
