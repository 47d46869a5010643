"""Tokenizer files that every transformers xattn supports reads (4.57 and 5.x).

transformers 5 saves a fast tokenizer as "tokenizer_class": "TokenizersBackend" (a class 4.57 does not have) and
its extra special tokens as a list (4.57 reads a dict there). The tokenizer itself lives in tokenizer.json; the
config only has to name a class both lines know, PreTrainedTokenizerFast (5.x maps it to TokenizersBackend)."""

from __future__ import annotations

import json
import os

_FIVE_ONLY_KEYS = ("backend", "is_local", "local_files_only")  # 5.x bookkeeping 4.57 would keep as init kwargs


def save_tokenizer(tokenizer, folder: str) -> None:
    """tokenizer.save_pretrained(folder), with a tokenizer_config.json both transformers lines load."""
    tokenizer.save_pretrained(folder)
    file = os.path.join(folder, "tokenizer_config.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in _FIVE_ONLY_KEYS:
        config.pop(key, None)
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    with open(file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
