"""Fine-tune (or train from scratch) an image captioner or a speech recognizer.

    python recipes/make_scenes.py build/scenes
    python recipes/finetune.py --data build/scenes --model new-scene-captioner --out build/captioner \\
        --max-steps 6000 --batch-size 64 --learning-rate 2e-3
    python recipes/make_digits.py build/digits
    python recipes/finetune.py --data build/digits --model new-digit-recognizer --out build/recognizer ...
    python recipes/finetune.py ... --resume        # continue a killed run exactly where it stopped

--data holds train/ and validation/: Hugging Face imagefolders (images + metadata.jsonl with `text`) for a
captioner, or audio files + metadata.jsonl (file_name, text) for a recognizer. --model is a
VisionEncoderDecoder or SpeechEncoderDecoder checkpoint directory (or hub id), or `new-scene-captioner` /
`new-digit-recognizer` for the small architectures of xattn.captioning / xattn.speech with the tokenizer
found in DATA/tokenizer. The final model, tokenizer and image processor or feature extractor are saved to
OUT/final as a standard save_pretrained checkpoint.
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
