"""Transcribe audio with the shipped digit recognizer (or any SpeechEncoderDecoder checkpoint).

    python recipes/transcribe.py data/samples/digits-0.wav
    python recipes/transcribe.py folder/ -o transcripts.jsonl --batch-size 32
    python recipes/transcribe.py speech.flac --model path/to/checkpoint --num-beams 4
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["transcribe", *sys.argv[1:]]))
