"""Batch jobs over many files: a bad file is reported and skipped, output is JSON lines written as they are
made, and re-running the same command after a kill skips what is done (same output as an unbroken run)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable


def input_files(paths: list[str], extensions: tuple[str, ...]) -> list[str]:
    """Files as given, folders expanded to their files with one of `extensions` (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            names = sorted(f for f in os.listdir(path) if f.lower().endswith(extensions))
            files.extend(os.path.join(path, name) for name in names)
        else:
            files.append(path)
    return files


def finished_inputs(output: str, key: str = "file") -> set[str]:
    """Inputs already in the JSONL output; a line cut by a kill is dropped from the file."""
    if not os.path.exists(output):
        return set()
    with open(output) as f:
        text = f.read()
    lines = text.split("\n")
    complete = [line for line in lines[:-1] if line.strip()]  # the part after the last newline is unfinished
    if lines[-1].strip():
        with open(output, "w") as f:
            f.write("".join(line + "\n" for line in complete))
    return {json.loads(line)[key] for line in complete}


def run_batches(
    files: list[str],
    load: Callable[[str], object],
    process: Callable[[list[object]], list[dict]],
    output: str | None,
    batch_size: int,
    progress: bool = True,
    desc: str = "files",
) -> int:
    """load(file) -> item (ValueError for a bad file); process(items) -> one dict per item. Returns the
    number of files that failed. Results go to `output` (JSONL) or, without it, to stdout."""
    from tqdm import tqdm

    done = finished_inputs(output) if output else set()
    pending = [f for f in files if f not in done]
    failures = 0
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(output, "a")) if output else sys.stdout
        with tqdm(total=len(files), initial=len(files) - len(pending), desc=desc, disable=not progress,
                  file=sys.stderr) as bar:
            for start in range(0, len(pending), batch_size):
                chunk = pending[start : start + batch_size]
                loaded, results = [], {}
                for path in chunk:
                    try:
                        loaded.append((path, load(path)))
                    except ValueError as error:
                        results[path] = {"file": path, "error": str(error)}
                if loaded:
                    for (path, _), result in zip(loaded, process([item for _, item in loaded])):
                        results[path] = {"file": path, **result}
                for path in chunk:  # input order, whatever failed
                    failures += "error" in results[path]
                    sink.write(json.dumps(results[path]) + "\n")
                sink.flush()
                bar.update(len(chunk))
    return failures
