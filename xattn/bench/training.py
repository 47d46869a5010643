"""The training bench: seconds per AdamW step and memory, measured apart, fine-tuning the ViT-B/16 + GPT-2 small
captioner with or without gradient checkpointing (recipes/bench_training.py runs each setting in a fresh process)."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch


def live_activation_mb(forward_backward) -> float:
    """The peak of live tensors other than weights, gradients and optimizer state during forward_backward(), in
    MB, from torch's memory profiler (its timeline of every tensor's creation and destruction, by category)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        forward_backward()
    state = {Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE}
    # the timeline's columns: uncategorised tensors first (kept), then each category at its index + 1
    columns = [index + 1 for category, index in _CATEGORY_TO_INDEX.items() if category not in state]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        with warnings.catch_warnings():  # deprecated for CUDA in favour of snapshots; CPU has no other
            warnings.simplefilter("ignore")
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return max(sum(row[c] for c in columns) for row in sizes) / 2**20


def training_step_cost(checkpointing: bool, batch: int = 8, tokens: int = 32, steps: int = 2,
                       threads: int = 2) -> dict:
    """One AdamW step training the ViT-B/16 + GPT-2 small captioner, with or without gradient checkpointing (with
    it, the LM-head loss in chunks, as `xattn train --gradient-checkpointing` does): seconds per step (best of
    `steps`), and memory measured apart. `activation_mb`: the peak RSS of forward + backward above the RSS holding
    weights, gradients and optimizer state (after a first step, gradients kept, the heap's free pages returned
    first); `activation_live_mb`: the same peak counted in live tensors by torch's
    memory profiler (what the allocator keeps beside them left out); `optimizer_peak_mb`: the RSS peak of the
    optimizer's step; the bytes of weights, gradients and optimizer
    state from their tensors. Run each setting in its own process: peak RSS is per process."""
    import gc

    from ..fast import release_freed_memory
    from ..train import chunked_loss
    from ..train.loop import enable_checkpointing
    from .decode import best_of, vit_gpt2_small
    from .memory import _reset_peak, _status_mb

    torch.set_num_threads(threads)
    model = vit_gpt2_small().train()
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, 224, 224, generator=generator)
    labels = torch.randint(0, 50000, (batch, tokens), generator=generator)

    def forward_backward():
        if checkpointing:
            loss = chunked_loss.loss(model, labels=labels, pixel_values=pixels)
        else:
            loss = model(pixel_values=pixels, labels=labels).loss
        loss.backward()

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def settled_rss() -> float:
        gc.collect()
        release_freed_memory()
        _reset_peak()
        return _status_mb("VmRSS")

    step()  # the optimizer's state exists from here on, as in a real run
    seconds, _ = best_of(step, steps)
    peak_rss_mb = _status_mb("VmHWM")  # the process's peak over whole steps (before the resets below)
    optimizer.zero_grad(set_to_none=False)  # gradients held, as during a step's backward
    held = settled_rss()
    forward_backward()
    activation_mb = _status_mb("VmHWM") - held
    held = settled_rss()
    optimizer.step()
    optimizer_peak_mb = _status_mb("VmHWM") - held
    optimizer.zero_grad(set_to_none=False)
    live_mb = live_activation_mb(forward_backward)

    def mb(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"gradient_checkpointing": checkpointing, "chunked_loss": checkpointing, "batch": batch,
            "tokens": tokens, "seconds_per_step": seconds, "weights_mb": mb(model.parameters()),
            "gradients_mb": mb(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer_state_mb": mb(state), "held_rss_mb": held, "activation_mb": activation_mb,
            "activation_live_mb": live_mb,
            "optimizer_peak_mb": optimizer_peak_mb, "peak_rss_mb": peak_rss_mb}
