"""The decode step compiles with torch.compile(fullgraph=True) (CPU inductor) and gives the eager tokens."""

import torch

import xattn
from conftest import tiny_captioner


def test_compiled_decode_step_gives_the_eager_tokens():
    torch._dynamo.reset()
    model = tiny_captioner(seed=31)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    eager = xattn.from_hf(model)
    compiled = xattn.from_hf(model).compile()
    for kwargs in (dict(max_new_tokens=10, min_new_tokens=10), dict(max_new_tokens=10, num_beams=3)):
        expected = eager.generate(pixel_values=pixels, **kwargs)
        assert torch.equal(compiled.generate(pixel_values=pixels, **kwargs), expected)
        assert torch.equal(expected, model.generate(pixel_values=pixels, **kwargs))
