"""The metadata.jsonl of a data folder (an imagefolder split or a speech split): its rows, each with the `path`
of its file, which must lie inside the folder.

A data folder may come from anyone. A `file_name` that is absolute, climbs out with `..` or is a symlink to a
file elsewhere would make training read (and learn, and ship in the weights) files from outside the folder, so
each one is resolved (symlinks included) and refused with a one-line ValueError naming metadata.jsonl and the
line, as is every line that is not a JSON object with the needed string fields.

An empty (or blank) "text" is a mistake in a captioning or speech data set, except in a row of audio without
speech marked "no_speech": true, whose text must be empty: a recognizer learns from those rows to say nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

METADATA = "metadata.jsonl"
NO_SPEECH = "no_speech"  # a row's mark that its file holds no speech and its empty "text" is meant


def read_metadata(directory: str, required: tuple[str, ...] = ("file_name",),
                  check: Callable[[dict], None] | None = None) -> list[dict]:
    """The rows of directory/metadata.jsonl with `path` = the real path of `file_name` inside `directory`.

    required: keys whose values must be strings. check(row) may raise ValueError for a row it cannot use; the
    message is prefixed with the file and line."""
    file = os.path.join(directory, METADATA)
    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such file (a data folder holds its files and a {METADATA} naming them)")
    root = os.path.realpath(directory)
    rows = []
    try:
        with open(file, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not a readable UTF-8 text file ({error})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        missing = [key for key in required if not isinstance(row.get(key), str)]
        if missing:
            raise ValueError(f"{where}: needs {', '.join(repr(k) for k in missing)} as text")
        if "text" in required:
            _check_text(row, where)
        row["path"] = _inside(root, row["file_name"], where)
        if check is not None:
            try:
                check(row)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        rows.append(row)
    if not rows:
        raise ValueError(f"{file}: no rows (no examples in {directory})")
    return rows


def _check_text(row: dict, where: str) -> None:
    """Text, or empty text in a row marked no_speech, and nothing in between."""
    no_speech = row.get(NO_SPEECH, False)
    if not isinstance(no_speech, bool):
        raise ValueError(f"{where}: {NO_SPEECH!r} must be true or false, got {no_speech!r}")
    if no_speech and row["text"]:
        raise ValueError(f"{where}: a row with {NO_SPEECH!r}: true has empty 'text', got {row['text'][:200]!r}")
    if not no_speech and not row["text"].strip():
        raise ValueError(f"{where}: empty 'text' (only a file without speech has one, and its row says "
                         f"{NO_SPEECH!r}: true)")


def _inside(root: str, name: str, where: str) -> str:
    """The real path of `name` relative to `root`, which must be an existing file under `root`."""
    if not name or "\0" in name or os.path.isabs(name):
        raise ValueError(f"{where}: file_name {name[:200]!r} must be a path relative to its folder")
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{where}: file_name {name[:200]!r} leads outside {root} (through '..' or a symlink); "
                         "data files must lie inside their folder")
    if not os.path.isfile(path):
        raise ValueError(f"{where}: file_name {name[:200]!r}: no such file in {root}")
    return path
