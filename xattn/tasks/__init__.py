"""The three uses, end to end: image captioning, speech transcription and speech synthesis (with the adapter for
Tortoise/XTTS-style GPT-2 TTS decoders), with their vision, audio and audio-code helpers."""

import os

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the shipped models: data/models in a source tree (an editable install), else the copy that `pip install .`
# puts in the package (pyproject.toml maps data/models to xattn.models)
SHIPPED_MODELS = next((folder for folder in (os.path.join(os.path.dirname(_PACKAGE), "data", "models"),
                                             os.path.join(_PACKAGE, "models")) if os.path.isdir(folder)),
                      os.path.join(_PACKAGE, "models"))
