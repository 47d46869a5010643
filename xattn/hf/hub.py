"""What a --model name points to: a local checkpoint folder, or a Hugging Face hub id resolved to a folder of the
local cache by huggingface_hub, as from_pretrained resolves it (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_ENDPOINT, revision). Everything after this reads the folder, so a hub checkpoint goes through the same checks
as a local one (xattn.hf.loading: never its code)."""

from __future__ import annotations

import os

# what a checkpoint needs: configs, tokenizer files, safetensors weights, a TTS codebook (numpy, read without pickle)
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.npz"]
_PICKLED_WEIGHTS = ["*.bin"]


def resolve_checkpoint(name: str, revision: str | None = None, allow_pickle: bool = False) -> str:
    """The local folder of a checkpoint named by a path or a hub id; ValueError in one line when there is none."""
    if os.path.isdir(name):
        if revision is not None:
            raise ValueError(f"{name} is a local folder; --revision applies only to hub ids")
        return name
    if not _is_hub_id(name):
        raise ValueError(f"{name}: no such checkpoint directory")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f" at revision {revision}" if revision else ""
    try:
        return snapshot_download(name, revision=revision, allow_patterns=_FILES + (_PICKLED_WEIGHTS if allow_pickle
                                                                                   else []))
    except RevisionNotFoundError:
        raise ValueError(f"{name}: the hub ({constants.ENDPOINT}) has no revision {revision!r} of it") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{name}: no such local folder, and no such model on the hub ({constants.ENDPOINT}), "
                         "or it is private: log in with `hf auth login` or set HF_TOKEN") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            how = "HF_HUB_OFFLINE is set, so the hub was not asked"
        else:
            how = f"the hub ({constants.ENDPOINT}) could not be reached"
        raise ValueError(f"{name}: no such local folder, and not in the Hugging Face cache{at} "
                         f"({constants.HF_HUB_CACHE}); {how}") from None


def _is_hub_id(name: str) -> bool:
    """'name' or 'owner/name' as the hub spells ids (a path such as ./x, /x or a/b/c is never one)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "~")) or os.path.isabs(name) or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
