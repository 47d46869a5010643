"""The load bench's peer: transformers' own `generate` behind xattn's HTTP API (the same app, uploads, limits and
micro-batcher; only the decoding is transformers'). Run as `python -m xattn.bench.serve_peer --captioner DIR
--port N`; each micro-batch (requests that wait together, up to --max-batch-size) is one `generate` call, which
is what transformers can batch."""

from __future__ import annotations

import argparse

import torch

from ..logprobs import mean_up_to_first_eos
from ..tasks.captioning import Captioner


class TransformersCaptioner(Captioner):
    """A Captioner whose captions come from VisionEncoderDecoderModel.generate; avg_logprob is the mean of the
    generated tokens' log-probabilities up to and including the first EOS, as xattn reports it."""

    def __init__(self, model: str):
        from transformers import VisionEncoderDecoderModel

        from ..hf.loading import load_image_processor, load_model, load_tokenizer
        from ..tasks.confidence import Confidence

        self.engine = load_model(VisionEncoderDecoderModel, model).eval()  # the app reads engine.generation_config
        self.tokenizer = load_tokenizer(model)
        self.processor = load_image_processor(model)
        self.confidence = Confidence.from_pretrained(model)

    @torch.no_grad()
    def caption_results(self, pixels: list[torch.Tensor], **generate_kwargs) -> list[dict]:
        out = self.engine.generate(pixel_values=torch.stack(pixels), return_dict_in_generate=True,
                                   output_scores=True, **generate_kwargs)
        scores = self.engine.compute_transition_scores(out.sequences, out.scores, out.get("beam_indices"),
                                                       normalize_logits=True)
        eos = self.engine.generation_config.eos_token_id
        avg_logprob = mean_up_to_first_eos(scores, out.sequences[:, -scores.shape[1]:],
                                           eos if isinstance(eos, list) else [eos])
        return self.results(out.sequences, avg_logprob)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from ..serve.app import OFF, Settings, create_app

    parser = argparse.ArgumentParser(prog="python -m xattn.bench.serve_peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--captioner", required=True, help="VisionEncoderDecoder checkpoint folder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    settings = Settings(captioner=args.captioner, recognizer=OFF, speaker=OFF, inflight=False,
                        max_batch_size=args.max_batch_size, max_queue=args.max_queue, timeout_s=args.timeout_s,
                        threads=args.threads)
    app = create_app(settings, captioner=TransformersCaptioner(args.captioner))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
