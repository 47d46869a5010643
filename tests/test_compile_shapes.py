"""A compiled model takes any batch size and any option without failing or compiling again where the graph is the
same: after B=1 (a static graph), one more graph serves every other batch size; min_new_tokens changes nothing."""

import pytest
import torch
from torch._dynamo.utils import counters

import xattn
from conftest import tiny_captioner

BATCH_SIZES = [1, 2, 3, 5, 4, 7, 9, 11, 6, 8, 10, 12]  # more than torch's recompile limit (8)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _pixels(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))


def test_twelve_batch_sizes_through_one_compiled_model_give_the_eager_tokens():
    torch._dynamo.reset()
    model = tiny_captioner(seed=31)
    eager, compiled = xattn.from_hf(model), xattn.from_hf(model).compile()
    before = _graphs()
    for batch in BATCH_SIZES:
        pixels = _pixels(batch)
        assert torch.equal(compiled.generate(pixel_values=pixels, max_new_tokens=4),
                           eager.generate(pixel_values=pixels, max_new_tokens=4)), batch
    assert _graphs() - before == 2  # B=1, then every other size in one graph with a symbolic batch


@pytest.mark.kernels
def test_min_new_tokens_does_not_recompile_the_packed_greedy_step():
    """The packed greedy step takes the ids min_new_tokens forbids (none, or the EOS ids): any length, one graph."""
    torch._dynamo.reset()
    model = tiny_captioner(seed=31)
    eager, compiled = xattn.from_hf(model, weights="packed"), xattn.from_hf(model, weights="packed").compile()
    pixels = _pixels(2)
    kwargs = dict(pixel_values=pixels, max_new_tokens=6)
    assert torch.equal(compiled.generate(**kwargs), eager.generate(**kwargs))
    graphs = _graphs()
    for options in (dict(min_new_tokens=3), dict(min_new_tokens=6), dict(min_new_tokens=2, eos_token_id=[2, 5])):
        assert torch.equal(compiled.generate(**kwargs, **options), eager.generate(**kwargs, **options)), options
    assert _graphs() == graphs


def test_past_torchs_recompile_limit_the_step_runs_eagerly():
    torch._dynamo.reset()
    # dynamo's own patch(): monkeypatch's restore of a config attribute leaves it deleted for later tests
    with torch._dynamo.config.patch(recompile_limit=1):
        model = tiny_captioner(seed=31)
        eager, compiled = xattn.from_hf(model), xattn.from_hf(model).compile(dynamic=False, backend="eager")
        assert torch.equal(compiled.generate(pixel_values=_pixels(1), max_new_tokens=4),
                           eager.generate(pixel_values=_pixels(1), max_new_tokens=4))
        with pytest.warns(UserWarning, match="recompile limit"):
            got = compiled.generate(pixel_values=_pixels(2), max_new_tokens=4)
        assert torch.equal(got, eager.generate(pixel_values=_pixels(2), max_new_tokens=4))
    torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit >= 8
