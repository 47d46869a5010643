"""Write the samples shipped in data/samples/: scene images from the held-out test seed with their captions
(metadata.jsonl), and spoken digits from the speech test split (held-out voice variants), saved at several
sample rates, channel counts and formats, with their transcripts (transcripts.jsonl).

    python recipes/make_samples.py data/samples        # needs espeak-ng for the speech
"""

import argparse
import json
import os

from xattn.datasets.scenes import draw, scene_for

TEST_SEED = 3  # the test split's seed: never seen in training
SPEECH_TEST_SEED = 13  # the speech test split's seed (held-out voice variants)
# (sample rate, channels, file name) of the speech samples: what people's files look like
SPEECH_FORMATS = [(22050, 1, "digits-0.wav"), (8000, 1, "digits-1.wav"), (44100, 2, "digits-2.flac"),
                  (16000, 1, "digits-3.ogg"), (48000, 2, "digits-4.wav"), (16000, 1, "digits-5.wav")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=8)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metadata.jsonl"), "w") as f:
        for i in range(args.count):
            scene = scene_for(TEST_SEED, i)
            name = f"scene-{i}.png" if i % 4 else f"scene-{i}.jpg"  # a few JPEGs too
            image = draw(scene)
            image.save(os.path.join(args.out, name), **({"quality": 95} if name.endswith(".jpg") else {}))
            f.write(json.dumps({"file_name": name, "text": scene.caption}) + "\n")
    write_speech(args.out)
    print(f"wrote {args.count} scenes and {len(SPEECH_FORMATS)} speech samples to {args.out}")


def write_speech(out: str) -> None:
    import tempfile

    import numpy as np
    import soundfile

    from xattn.datasets.digits import HELD_OUT_VARIANTS, synthesize, utterance_for
    from xattn.tasks.audio import load_audio

    with open(os.path.join(out, "transcripts.jsonl"), "w") as f, tempfile.TemporaryDirectory() as tmp:
        for i, (rate, channels, name) in enumerate(SPEECH_FORMATS):
            utterance = utterance_for(SPEECH_TEST_SEED, i, HELD_OUT_VARIANTS)
            spoken = os.path.join(tmp, "spoken.wav")
            synthesize(utterance, spoken)
            samples = load_audio(spoken, rate)
            if channels == 2:  # the right channel a little quieter, as in a real stereo recording
                samples = np.stack([samples, 0.8 * samples], axis=1)
            soundfile.write(os.path.join(out, name), samples, rate)
            f.write(json.dumps({"file_name": name, "text": utterance.text, "voice": utterance.voice,
                                "variant": utterance.variant, "sampling_rate": rate, "channels": channels}) + "\n")


if __name__ == "__main__":
    main()
