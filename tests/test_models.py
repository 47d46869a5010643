"""Entry points: load() from a saved checkpoint, GPT2Model + head, streaming, no copy of the weights."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import GPT2Config, GPT2Model

import xattn
from conftest import tiny_captioner, tiny_gpt2


def test_load_a_saved_checkpoint_gives_transformers_tokens(tmp_path):
    model = tiny_captioner(seed=51)
    model.save_pretrained(tmp_path)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    loaded = xattn.load(str(tmp_path))
    for kwargs in (dict(max_new_tokens=9), dict(max_new_tokens=9, num_beams=3)):
        expected = model.generate(pixel_values=pixels, **kwargs)
        assert torch.equal(loaded.generate(pixel_values=pixels, **kwargs), expected)


def test_gpt2_model_plus_separate_head():
    lm = tiny_gpt2(seed=52)
    bare = GPT2Model(lm.config).eval()
    bare.load_state_dict(lm.transformer.state_dict())
    states = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    prompt = torch.tensor([[1, 4], [1, 8]])
    expected = lm.generate(prompt, attention_mask=torch.ones_like(prompt), encoder_hidden_states=states,
                           max_new_tokens=8)
    got = xattn.from_hf(bare, lm_head=lm.lm_head).generate(prompt, encoder_hidden_states=states, max_new_tokens=8)
    assert torch.equal(got, expected)


def test_stream_yields_the_generated_tokens_step_by_step():
    model = tiny_captioner(seed=53)
    engine = xattn.from_hf(model)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    full = engine.generate(pixel_values=pixels, max_new_tokens=10)
    steps = list(engine.stream(pixel_values=pixels, max_new_tokens=10))
    assert len(steps) == full.shape[1] - 1
    assert torch.equal(torch.stack(steps, dim=1), full[:, 1:])


def test_the_engine_reads_the_models_own_parameters():
    model = tiny_captioner(seed=54)
    engine = xattn.from_hf(model)
    hf_storage = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in hf_storage for p in engine.decoder.parameters())
    # and a change to the transformers weights is seen by xattn at once
    pixels = torch.randn(1, 3, 32, 32)
    before = engine.generate(pixel_values=pixels, max_new_tokens=6, min_new_tokens=6)
    with torch.no_grad():
        model.decoder.lm_head.weight[before[0, 1]] -= 100.0
    after = engine.generate(pixel_values=pixels, max_new_tokens=6, min_new_tokens=6)
    assert after[0, 1] != before[0, 1]


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, gc, torch, xattn
    from xattn.bench import vit_gpt2_small
    torch.set_num_threads(2)

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    model = vit_gpt2_small()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    pixels = torch.randn(1, 3, 224, 224)
    gc.collect()
    engine = xattn.from_hf(model)
    base = rss("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    engine.generate(pixel_values=pixels, max_new_tokens=16, num_beams=4)
    print(json.dumps({"params": params, "base": base, "peak": rss("VmHWM:")}))
    """
)


def test_peak_memory_of_generation_stays_within_a_tenth_of_the_model():
    """ViT-B/16 + GPT-2 small, beam 4: what generation adds on top of the loaded model is < 10% of its size."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    m = json.loads(out.stdout.strip().splitlines()[-1])
    extra = m["peak"] - m["base"]
    message = f"generation added {extra / 2**20:.0f} MiB to a {m['params'] / 2**20:.0f} MiB model"
    assert extra <= 0.1 * m["params"], message


def test_caller_supplied_embeddings_and_head_match_transformers_forward():
    """A Tortoise/XTTS-shaped decoder: GPT2Model whose wpe is zero, prefix embeddings from the caller, its own
    token/position embeddings and final norm + head. Greedy tokens equal transformers' uncached forward."""
    torch.manual_seed(55)
    gpt = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=8, n_positions=64,
                               add_cross_attention=False)).eval()
    with torch.no_grad():
        gpt.wpe.weight.zero_()
    tokens_embedding, positions_embedding = torch.nn.Embedding(40, 32), torch.nn.Embedding(30, 32)
    norm, head = torch.nn.LayerNorm(32), torch.nn.Linear(32, 40)
    prefix = torch.randn(2, 5, 32)
    start = 38

    def embed(ids, positions):  # generated token i sits at position i of the audio sequence
        return tokens_embedding(ids) + positions_embedding(positions - prefix.shape[1])

    decoder = xattn.GPT2CrossAttentionDecoder(gpt, embed=embed, head=lambda h: head(norm(h)))
    with torch.no_grad():
        cache = decoder.new_cache(2, 20)
        decoder.prefill(cache, inputs_embeds=prefix)
        ids = torch.full((2, 1), start)
        logits = decoder.prefill(cache, input_ids=ids)
        ours = []
        for pos in range(prefix.shape[1] + 1, prefix.shape[1] + 9):
            nxt = logits.argmax(-1)
            ours.append(nxt)
            assert cache.length == pos
            logits = decoder.decode_step(nxt, cache)

        seq = ids
        theirs = []
        for _ in range(8):  # transformers, no cache: the whole sequence every step
            audio = tokens_embedding(seq) + positions_embedding(torch.arange(seq.shape[1]))
            hidden = gpt(inputs_embeds=torch.cat([prefix, audio], 1)).last_hidden_state
            nxt = head(norm(hidden[:, -1])).argmax(-1)
            theirs.append(nxt)
            seq = torch.cat([seq, nxt[:, None]], 1)
    assert torch.equal(torch.stack(ours, 1), torch.stack(theirs, 1))
