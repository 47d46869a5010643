"""Compiled decoding: the first call's time in a fresh process, then in a second process that finds the
compile cache the first one wrote (torch's inductor caches its compiled graphs on disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_PROBE = """
import json, time, torch, xattn
from torch._dynamo.utils import counters
from xattn.bench.decode import vit_gpt2_small
torch.set_num_threads({threads})
model = vit_gpt2_small(decoder_layers={layers})
compiled = xattn.from_hf(model).compile()
with torch.inference_mode():
    states = model.encoder(pixel_values=torch.randn(1, 3, 224, 224))[0]
    start = time.perf_counter()
    compiled.generate(encoder_hidden_states=states, max_new_tokens=4, min_new_tokens=4)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiled.generate(encoder_hidden_states=states, max_new_tokens=4, min_new_tokens=4)
print(json.dumps({{"first_call_s": first, "next_call_s": time.perf_counter() - start,
                  "graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}}))
"""


def first_calls(threads: int = 2, cache_dir: str | None = None, decoder_layers: int = 12) -> dict:
    """{"fresh_process": {...}, "second_process": {...}}: first_call_s, next_call_s and inductor's graph cache
    hits/misses in each, with one cache directory (a new temporary one unless cache_dir is given) shared by
    both processes."""
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="xattn-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    record = {"cache_dir": cache_dir}
    for name in ("fresh_process", "second_process"):
        code = _PROBE.format(threads=threads, layers=decoder_layers)
        done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        record[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return record
