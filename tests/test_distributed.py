"""Training under torchrun: 2 CPU processes (gloo) end with the weights of one process on the same global
batches (within float tolerance: the gradient sum is split differently)."""

import os
import subprocess
import sys

import pytest
import torch
from test_train import RandomCaptions, collate

from xattn.train.loop import TrainConfig, train

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # dropout masks differ between processes
KWARGS = dict(max_steps=5, batch_size=8, learning_rate=3e-3, warmup_steps=2, save_every=2, eval_every=100, seed=3,
              mixed_precision="no")

_RUN = """
import sys
sys.path.insert(0, {tests!r})
from conftest import tiny_captioner
from test_distributed import NO_DROPOUT, ragged
from test_train import collate
from xattn.train.loop import TrainConfig, train

train(tiny_captioner(seed=70, **NO_DROPOUT), ragged(), collate, TrainConfig(output_dir={out!r}, **{kwargs!r}),
      progress=False)
"""


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_two_processes_equal_one(tmp_path, checkpointing):
    """The one process trains without checkpointing; the two with it chunk the loss, the tied head's gradient put in
    .grad before DDP's hooks fire."""
    from safetensors.torch import load_file

    from conftest import tiny_captioner

    kwargs = {**KWARGS, "gradient_checkpointing": checkpointing}
    data = ragged()
    single = tiny_captioner(seed=70, **NO_DROPOUT)
    train(single, data, collate, TrainConfig(output_dir=str(tmp_path / "one"), **KWARGS), progress=False)

    out = str(tmp_path / "two")
    script = tmp_path / "run.py"
    script.write_text(_RUN.format(tests=os.path.dirname(__file__), out=out, kwargs=kwargs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(os.path.join(out, "latest")) as f:
        weights = load_file(os.path.join(out, f.read().strip(), "weights.safetensors"))
    assert weights.keys() and set(weights) <= set(single.state_dict())
    initial = tiny_captioner(seed=70, **NO_DROPOUT).state_dict()
    for name, value in weights.items():  # Adam's normalisation amplifies rounding differences to ~1e-5
        torch.testing.assert_close(value, single.state_dict()[name], atol=1e-4, rtol=1e-4, msg=name)
    moved = sum(not torch.equal(value, initial[name]) for name, value in weights.items())
    assert moved > len(weights) // 2  # training really changed the weights


def ragged():
    """Captions of different lengths, so the two processes' shares hold different numbers of tokens."""
    data = RandomCaptions()
    for i in range(len(data)):
        data.labels[i, 3 + i % 4 :] = -100
    return data
