"""The three uses, end to end: image captioning, speech transcription and speech synthesis (with the adapter for
Tortoise/XTTS-style GPT-2 TTS decoders), with their vision, audio and audio-code helpers."""

import os

# the models shipped in the repository (data/models/*), found from the source tree
SHIPPED_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
                              "models")
