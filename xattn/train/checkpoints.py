"""The training state on disk: checkpoint-N folders (weights, optimizer, history, every RNG's state), the
`latest` pointer, and the writes that make a kill or a full disk harmless.

A checkpoint is written whole under checkpoint-N.tmp, synced, renamed, and only then named by `latest` (itself
replaced by a rename), so a kill at any moment leaves `latest` naming a complete checkpoint. Failed writes and
unusable checkpoints are one-line ValueErrors naming the file and saying what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from ..files import disk_nearly_full, replaced_atomically

STATE_FILE = "trainer_state.pt"  # optimizer, step, RNG, history: tensors and plain data (weights_only load)
WEIGHTS_FILE = "weights.safetensors"
LATEST = "latest"  # a file naming the newest complete checkpoint directory
RUN_FILE = "train_config.json"  # the options of the run that wrote the checkpoint
# the TrainConfig fields that decide what a resumed run computes: a resume with another value would silently be a
# different run (another schedule, data order or loss), so it is refused; eval_every, save_every, keep_checkpoints
# and gradient checkpointing (the same gradients) may change
SHAPES_THE_RUN = ("max_steps", "batch_size", "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm",
                  "seed", "mixed_precision")


def save_checkpoint(model, optimizer, step: int, history: dict, config, run_options: dict | None = None) -> None:
    """Write checkpoint-{step} completely under a temporary name, then point `latest` at it atomically.

    A kill at any moment leaves `latest` naming a complete checkpoint; a full disk is a one-line ValueError
    that leaves the earlier checkpoints as they were. run_options: what else shapes the run (the command's data
    folder, --augment...), checked like the config on resume."""
    name = f"checkpoint-{step}"
    final = os.path.join(config.output_dir, name)
    tmp = final + ".tmp"
    pointer = os.path.join(config.output_dir, LATEST)
    with writing(tmp, f"write {name}", f"{latest_words(config.output_dir)}: free some space and rerun with "
                  "--resume", cleanup=tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        # the in-memory parameter names, exactly (save_pretrained may rename keys for older layouts)
        save_model(model, os.path.join(tmp, WEIGHTS_FILE))
        state = {"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state(), "history": history}
        torch.save(state, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, RUN_FILE), "w") as f:
            json.dump({**asdict(config), "run_options": run_options or {}}, f, indent=1)
        _sync_files(tmp)  # on disk before anything points at them (a full disk can show only here)
        replace_directory(tmp, final)
        with replaced_atomically(pointer) as partial, open(partial, "w") as f:
            f.write(name)
    _remove_old_checkpoints(config.output_dir, step, config.keep_checkpoints)


def _remove_old_checkpoints(output_dir: str, step: int, keep: int) -> None:
    """Keep checkpoint-{step} and the keep - 1 before it; drop older ones, later ones (left by an earlier run
    in this folder, or written but never pointed at before a kill) and half-written ones."""
    steps = sorted(s for s in (_checkpoint_step(d) for d in os.listdir(output_dir)) if s is not None and s < step)
    keep_steps = {step, *(steps[-(keep - 1):] if keep > 1 else [])}
    for entry in os.listdir(output_dir):
        found = _checkpoint_step(entry.removesuffix(".tmp").removesuffix(".old"))
        if found is not None and (found not in keep_steps or entry != f"checkpoint-{found}"):
            shutil.rmtree(os.path.join(output_dir, entry), ignore_errors=True)
        elif entry.startswith(f".{LATEST}.") and entry.endswith(".partial"):  # a pointer write cut by a kill
            os.remove(os.path.join(output_dir, entry))


def _checkpoint_step(name: str) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", name)
    return int(match.group(1)) if match else None


def latest_checkpoint(output_dir: str) -> str | None:
    pointer = os.path.join(output_dir, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(output_dir, f.read().strip())


def load_checkpoint(model, optimizer, output_dir: str, config=None,
                    run_options: dict | None = None) -> tuple[int, dict]:
    """Weights, optimizer, RNG and history of the checkpoint `latest` names; a ValueError naming the file (and
    what to do) for a missing, truncated or foreign one, or one written by a run with other options (config's
    SHAPES_THE_RUN fields and run_options, where the checkpoint recorded them)."""
    pointer = os.path.join(output_dir, LATEST)
    if not os.path.exists(pointer):
        return 0, {"step": [], "loss": [], "eval": []}
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{pointer}: unreadable ({error_line(error)}); {_fix_words(output_dir, None)}") from None
    if _checkpoint_step(name) is None:
        raise ValueError(f"{pointer} should name a checkpoint-N folder, it says {name[:80]!r}; "
                         f"{_fix_words(output_dir, None)}")
    path = os.path.join(output_dir, name)
    if not os.path.isdir(path):
        raise ValueError(f"{pointer} names {path}, which is missing; {_fix_words(output_dir, name)}")
    if config is not None:
        _check_same_run(path, config, run_options or {})
    state_file, weights_file = os.path.join(path, STATE_FILE), os.path.join(path, WEIGHTS_FILE)
    try:
        state = torch.load(state_file, weights_only=True)
        step, history, optimizer_state, rng = state["step"], state["history"], state["optimizer"], state.get("rng")
        _check_state(step, history, optimizer_state)
    except Exception as error:  # torch.load raises RuntimeError, EOFError, UnpicklingError... on a bad file
        raise ValueError(f"{state_file}: not a readable training state ({error_line(error)}); "
                         f"{_fix_words(output_dir, name)}") from None
    try:
        missing, unexpected = load_model(model, weights_file, strict=False)
    except Exception as error:  # safetensors' SafetensorError, OSError, RuntimeError for a size mismatch
        raise ValueError(f"{weights_file}: not readable weights for this model ({error_line(error)}); "
                         f"{_fix_words(output_dir, name)}") from None
    if missing or unexpected:
        raise ValueError(f"{weights_file} does not match the model ({len(missing)} weights missing, e.g. "
                         f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}): resume with the "
                         "--model that wrote it, or choose another --out")
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise ValueError(f"{state_file}: its optimizer state does not fit this model ({error_line(error)}); resume "
                         "with the --model that wrote it, or choose another --out") from None
    try:
        if rng is None:  # written before numpy's and python's RNG were saved
            torch.set_rng_state(state["torch_rng"])
        else:
            _set_rng_state(rng)
    except Exception as error:  # a state of another shape: KeyError, TypeError, ValueError, RuntimeError
        raise ValueError(f"{state_file}: its random states are not readable ({error_line(error)}); "
                         f"{_fix_words(output_dir, name)}") from None
    return step, history


def _check_state(step, history, optimizer_state) -> None:
    """The training state's plain parts have the types the loop reads (a hostile or foreign file may hold others)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"its step is {_shown(step)}, not a count of steps")
    if not isinstance(history, dict) or not all(isinstance(history.get(key), list) for key in ("step", "loss", "eval")):
        raise ValueError("its history is not lists of step, loss and eval")
    if not isinstance(optimizer_state, dict):
        raise ValueError(f"its optimizer state is a {type(optimizer_state).__name__}, not a dict")


def _check_same_run(path: str, config, run_options: dict) -> None:
    """Refuse to resume with options other than those the checkpoint was written with: the result would be neither
    the interrupted run nor a fresh one."""
    run_file = os.path.join(path, RUN_FILE)
    try:
        with open(run_file, encoding="utf-8") as f:
            recorded = json.load(f)
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return  # written before the options were kept: nothing to compare
    except (OSError, ValueError) as error:
        raise ValueError(f"{run_file}: unreadable ({error_line(error)}); start over without --resume, or choose "
                         "another --out") from None
    ours = {**{name: getattr(config, name) for name in SHAPES_THE_RUN}, **run_options}
    theirs = {**{name: recorded[name] for name in SHAPES_THE_RUN if name in recorded},
              **(recorded.get("run_options") if isinstance(recorded.get("run_options"), dict) else {})}
    for name, value in ours.items():
        if name in theirs and theirs[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{path} was written by a run with {flag} {_shown(theirs[name])}, this one has "
                             f"{flag} {_shown(value)}: resume with the same options, or start a new run in "
                             "another --out")


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else repr(value)


def _fix_words(output_dir: str, broken: str | None) -> str:
    """What to do about an unusable checkpoint: point `latest` at another complete one, or start over."""
    others = sorted((d for d in os.listdir(output_dir) if _checkpoint_step(d) is not None and d != broken
                     and os.path.isfile(os.path.join(output_dir, d, WEIGHTS_FILE))
                     and os.path.isfile(os.path.join(output_dir, d, STATE_FILE))), key=_checkpoint_step)
    pointer = os.path.join(output_dir, LATEST)
    if others:
        return (f"to resume from {others[-1]}, write {others[-1]!r} into {pointer}; or start over without "
                "--resume")
    return f"no other checkpoint is there: start over without --resume (or delete {pointer})"


def latest_words(output_dir: str) -> str:
    path = latest_checkpoint(output_dir)
    return f"{os.path.basename(path)} in {output_dir} is intact" if path else "no checkpoint was written yet"


def _rng_state() -> dict:
    """Every RNG training draws from, as tensors and plain data (loadable with weights_only=True)."""
    version, words, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(words), gauss],
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    saved = state["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["position"], saved["has_gauss"],
                         saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- writing files --------------------------------------------------------------------------------------
@contextlib.contextmanager
def writing(path: str, what: str, advice: str, cleanup: str | None = None) -> Iterator[None]:
    """Turns a failed write of `path` (a full disk, no permission) into a one-line ValueError that says what
    failed and what to do; `cleanup` (a partial folder) is removed first, to give its space back.

    A full disk is an OSError from Python's own files, but a SafetensorError from safetensors and a
    RuntimeError with a message about zip offsets from torch.save: those say "No space left" from the disk."""
    try:
        yield
    except Exception as error:
        if not isinstance(error, (OSError, RuntimeError)) and type(error).__name__ != "SafetensorError":
            raise
        reason = error_line(error)
        if not isinstance(error, OSError) and disk_nearly_full(path, 1 << 20):
            reason = "No space left on device"
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise ValueError(f"{path}: cannot {what} ({reason}); {advice}") from None


def replace_directory(tmp: str, final: str) -> None:
    """Put the complete folder `tmp` in place of `final` (which may exist) by renames."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _sync_files(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def error_line(error: BaseException) -> str:
    """An error's reason in one short line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__
