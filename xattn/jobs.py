"""Batch jobs over many files: a bad file is reported in its own line and the job goes on, output is JSON lines
written as they are made, and re-running the same command after a kill skips what is done (the output then
equals an unbroken run's byte for byte: batches are cut from the file list, not from what is left)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections import Counter
from collections.abc import Callable

from .files import cannot_write, check_output

_OUR_LINE_START = b'{"file": '  # how every line this module writes begins (json.dumps of a dict led by "file")


def input_files(paths: list[str], extensions: tuple[str, ...]) -> list[str]:
    """Files as given, folders expanded to their files with one of `extensions` (sorted). Nothing is opened here:
    a name that is not a regular file (a FIFO, a folder named x.png) is listed, and its loader's check refuses it in
    its own error line, so the job goes on."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            names = sorted(f for f in os.listdir(path) if f.lower().endswith(extensions))
            files.extend(os.path.join(path, name) for name in names)
        else:
            files.append(path)
    return files


def finished_inputs(output: str, key: str = "file") -> set[str]:
    """Inputs already in a JSONL file that this process writes alone (the data generators' metadata); a line cut
    by a kill is cut off the file."""
    if not os.path.exists(output):
        return set()
    with open(output, "rb+") as f:
        text = f.read()
        complete, _, tail = text.rpartition(b"\n")
        if tail.strip():
            f.truncate(len(text) - len(tail))
    return {json.loads(line)[key] for line in complete.split(b"\n") if line.strip()}


class JobOutput:
    """The JSONL output of a job, claimed before any work: checked (a folder, a missing parent, a device or pipe,
    an unwritable place or a file of other lines is refused, never rewritten), locked against a second job, and
    read for what is done. `path=None` or "-" writes to standard output (no resume)."""

    def __init__(self, path: str | None):
        self.path = None if path in (None, "-") else path
        self.done: Counter[str] = Counter()  # lines per input file (a file given twice has two)
        self.errors_before = 0
        self._fd: int | None = None
        if self.path is None:
            return
        check_output(self.path, "-o")
        created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"-o {self.path}: another xattn job is writing to it; wait for it to finish or "
                                 "choose another output") from None
            self._read_done()
        except BaseException:
            os.close(self._fd)
            self._fd = None
            if created and os.path.getsize(self.path) == 0:
                os.remove(self.path)
            raise

    def _read_done(self) -> None:
        size = os.fstat(self._fd).st_size
        text = os.pread(self._fd, size, 0)
        complete, _, tail = text.rpartition(b"\n")
        for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
            if not line.strip():
                continue
            record = _our_record(line)
            if record is None:
                raise ValueError(f"-o {self.path}: line {number} is not a result line of xattn; not writing into "
                                 "this file (choose another output)")
            self.done[record["file"]] += 1
            self.errors_before += "error" in record
        if tail.strip():
            if not (tail.startswith(_OUR_LINE_START) or _OUR_LINE_START.startswith(tail)):
                raise ValueError(f"-o {self.path}: its last line is not a result line of xattn; not writing into "
                                 "this file (choose another output)")
            os.ftruncate(self._fd, len(text) - len(tail))  # a line cut by a kill: redo that file

    def write(self, records: list[dict]) -> None:
        """Append records as JSON lines in one write (a kill leaves whole lines or a cut last line)."""
        text = "".join(json.dumps(r) + "\n" for r in records)
        if self._fd is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        data = text.encode()
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as error:
            raise ValueError(f"{cannot_write('-o', self.path, error)}; the results before it are kept: re-run the "
                             "same command to resume") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _our_record(line: bytes) -> dict | None:
    if not line.startswith(_OUR_LINE_START):
        return None
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("file"), str) else None


def run_batches(
    files: list[str],
    load: Callable[[str], object],
    process: Callable[[list[object]], list[dict]],
    output: JobOutput,
    batch_size: int,
    progress: bool = True,
    desc: str = "files",
    on_record: Callable[[dict], None] | None = None,
) -> int:
    """load(file) -> item (reading and preprocessing, one file at a time); process(items) -> one dict per item.
    A file that fails to load gets its "error" line; a batch that fails is retried one file at a time, so only
    the bad file gets one. on_record(record) sees each line written. Returns the number of "error" lines in the
    whole output (earlier runs included)."""
    from tqdm import tqdm

    failures = output.errors_before
    done = output.done.copy()
    pending = []  # per file of the list: still to do? (lines are in list order, so the first ones are done)
    for path in files:
        pending.append(done[path] <= 0)
        done[path] -= 1
    with tqdm(total=len(files), initial=pending.count(False), desc=desc, disable=not progress,
              file=sys.stderr) as bar:
        for start in range(0, len(files), batch_size):
            chunk = [f for f, todo in zip(files[start : start + batch_size], pending[start : start + batch_size])
                     if todo]
            if not chunk:
                continue
            results = _batch_results(chunk, load, process)
            records = [results[i] for i in range(len(chunk))]  # input order, whatever failed
            failures += sum("error" in r for r in records)
            output.write(records)
            if on_record is not None:
                for record in records:
                    on_record(record)
            bar.update(len(chunk))
    return failures


def _batch_results(chunk: list[str], load, process) -> list[dict]:
    loaded, results = [], [None] * len(chunk)
    for i, path in enumerate(chunk):
        try:
            loaded.append((i, load(path)))
        except Exception as error:  # one bad file, whatever the library raised for it
            results[i] = _error_record(path, error)
    groups = [loaded] if loaded else []
    while groups:
        group = groups.pop(0)
        try:
            out = process([item for _, item in group])
        except Exception as error:
            if len(group) == 1:
                results[group[0][0]] = _error_record(chunk[group[0][0]], error)
            else:  # which file broke the batch? each alone, in order
                groups = [[one] for one in group] + groups
            continue
        for (i, _), result in zip(group, out):
            results[i] = {"file": chunk[i], **result}
    return results


def _error_record(path: str, error: Exception) -> dict:
    text = one_line(error)
    return {"file": path, "error": text if text.startswith(path) else f"{path}: {text}"}


def one_line(error: BaseException) -> str:
    """An error as one line: a ValueError's own message (xattn's are written for people), an OSError naming its
    file, anything else led by its type."""
    if isinstance(error, OSError) and error.filename:
        return f"{error.filename}: {error.strerror or error}"
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(error, ValueError) and first:
        return first
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
