"""Text to speech with the shipped TTS model.

    python recipes/tts.py "four two seven" -o out.wav
    python recipes/tts.py "four two seven" -o out.wav --voice gb-male --stream --spectrogram out.png
    python recipes/tts.py "nine one one" --do-sample --temperature 0.6 --seed 3
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["speak", *sys.argv[1:]]))
