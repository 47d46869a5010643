"""Reading user files safely: an input is checked to be a regular file before it is opened (opening a FIFO
blocks until a writer comes, a device can be endless).

Writing user files safely: every output is checked before any work (one-line errors naming the option), and
written to a temporary file beside it that replaces the target only when complete, so a refusal, a kill or a
full disk never leaves a truncated file where a good one was."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator


def check_input(path: str) -> None:
    """ValueError (one line, naming the file) unless `path` is a regular file, after following symlinks: never
    opens it, so a FIFO, a device or a folder is refused without blocking."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as error:  # a name too long, a loop of links, a folder we cannot search...
        raise ValueError(f"{path}: cannot read ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a device, pipe or socket"
        raise ValueError(f"{path}: not a regular file ({kind})")


def check_output(path: str, option: str, extensions: tuple[str, ...] | None = None) -> None:
    """ValueError (one line, naming `option`) unless `path` can be written as a regular file."""
    if not path:
        raise ValueError(f"{option} is empty: name a file")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a folder; name a file inside it")
    if extensions is not None and not path.lower().endswith(extensions):
        raise ValueError(f"{option} {path}: name a file ending in {' or '.join(extensions)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: the folder {parent} does not exist")
    if os.path.exists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{option} {path}: not a regular file (a device, pipe or socket)")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path}: not writable (permission denied)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot write in {parent} (permission denied)")


def cannot_write(option: str, path: str, error: Exception) -> ValueError:
    """A one-line error for a failed write; libraries that hide errno (libsndfile) are checked against the disk."""
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    full = full or disk_nearly_full(path, 64 << 10)
    reason = "the disk is full" if full else (getattr(error, "strerror", None) or str(error).strip().splitlines()[0])
    return ValueError(f"{option} {path}: cannot write ({reason})")


def disk_nearly_full(path: str, below: int) -> bool:
    """Whether the disk that holds `path` (or its nearest existing folder) has fewer than `below` bytes free: how a
    failed write is recognised as a full disk when the library that wrote hid the errno (libsndfile, safetensors,
    torch.save)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free < below
    except OSError:
        return False


@contextlib.contextmanager
def replaced_atomically(path: str) -> Iterator[str]:
    """Yields a temporary path beside `path` (same extension, so writers infer the format); on success it
    replaces `path` in one rename, on any failure it is removed and `path` is left as it was."""
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.{os.getpid()}.partial{ext}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def save_figure(fig, path: str, **savefig_kwargs) -> None:
    """matplotlib's savefig, atomically."""
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, **savefig_kwargs)


def save_json(value, path: str) -> None:
    """json.dump(value, indent=1), atomically."""
    import json

    with replaced_atomically(path) as tmp, open(tmp, "w") as f:
        json.dump(value, f, indent=1)
