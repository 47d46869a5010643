"""Caption images with the shipped scene captioner (or any VisionEncoderDecoder checkpoint).

    python recipes/caption.py data/samples/scene-0.png
    python recipes/caption.py build/scenes/test -o captions.jsonl --batch-size 32
    python recipes/caption.py image.png --model path/to/checkpoint --num-beams 4
    python recipes/caption.py image.png --attention-map attention.png
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["caption", *sys.argv[1:]]))
