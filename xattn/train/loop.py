"""Fine-tuning of transformers encoder-decoder models (VisionEncoderDecoder, SpeechEncoderDecoder).

Deterministic and resumable: the seed fixes every RNG (python's, numpy's, torch's) and the data order (a
function of (seed, epoch)); checkpoints hold the weights (safetensors), optimizer, schedule and every RNG's
state and are written atomically, so `resume=True` after a kill, even one during a checkpoint write, ends with
the same weights as an uninterrupted run.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from . import chunked_loss
from .checkpoints import error_line, latest_checkpoint, latest_words, load_checkpoint, save_checkpoint, writing

__all__ = ["TrainConfig", "batch_indices", "enable_checkpointing", "latest_checkpoint", "learning_rate_at",
           "plot_history", "seed_everything", "train"]

SEED_MAX = 2**63 - 1  # torch.manual_seed takes 64-bit seeds


@dataclass
class TrainConfig:
    output_dir: str  # checkpoints, loss curve and the final model go here
    max_steps: int = 1000  # optimizer steps
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 100  # linear warm-up, then cosine decay to 10%
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    eval_every: int = 250  # steps between evaluations (and loss-curve updates)
    save_every: int = 250  # steps between checkpoints
    seed: int = 0  # seeds python's random, numpy, torch and the data order
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    mixed_precision: str = "auto"  # "bf16", "no", or "auto" (bf16 where the CPU has native bf16)
    keep_checkpoints: int = 2

    # the valid values of each numeric field as (lowest, highest, lowest excluded); `xattn train` builds its
    # argparse types from these, so a bad option is a usage error before any work
    LIMITS: ClassVar[dict[str, tuple]] = {
        "max_steps": (1, None, False), "batch_size": (1, None, False), "learning_rate": (0, None, True),
        "warmup_steps": (0, None, False), "weight_decay": (0, None, False), "max_grad_norm": (0, None, True),
        "eval_every": (1, None, False), "save_every": (1, None, False), "seed": (0, SEED_MAX, False),
        "keep_checkpoints": (1, None, False),
    }
    MIXED_PRECISION: ClassVar[tuple[str, ...]] = ("auto", "bf16", "no")

    def __post_init__(self):
        if self.mixed_precision not in self.MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be 'auto', 'bf16' or 'no', got {self.mixed_precision!r}")
        for name, (low, high, low_open) in self.LIMITS.items():
            value = getattr(self, name)
            kind = type(getattr(TrainConfig, name))
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < low or \
                    (low_open and value == low) or (high is not None and value > high):
                bound = f"> {low}" if low_open else f">= {low}"
                raise ValueError(f"{name} must be a finite number {bound}" + (f" and <= {high}" if high else "") +
                                 f", got {value!r}")


def seed_everything(seed: int) -> None:
    """Python's random, numpy's global RNG (Wav2Vec2-BERT's time masking draws from it) and torch's."""
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # numpy seeds are 32-bit words
    torch.manual_seed(seed)


def cpu_has_native_bf16() -> bool:
    return bool(torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX") or
                getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() or
                getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing on every layer of encoder and decoder, cross-attention included.

    Non-reentrant: it replays the RNG, so dropout masks and gradients equal those of a plain run."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def learning_rate_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch_indices(step: int, dataset_size: int, batch_size: int, seed: int) -> torch.Tensor:
    """The examples of a step: epoch e is a permutation drawn from (seed, e); batches never straddle epochs."""
    per_epoch = dataset_size // batch_size
    if per_epoch == 0:
        raise ValueError(f"the training set ({dataset_size} examples) is smaller than one batch ({batch_size}): "
                         "lower --batch-size")
    epoch, offset = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed((seed * 100_003 + epoch) % 2**64)  # any 63-bit seed fits
    order = torch.randperm(dataset_size, generator=generator)
    return order[offset * batch_size : (offset + 1) * batch_size]


def train(
    model: torch.nn.Module,
    dataset,
    collate: Callable[[list[dict]], dict],
    config: TrainConfig,
    *,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
    resume: bool = False,
    run_options: dict | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Train `model` on `dataset` (anything indexable with len); collate turns examples into model kwargs
    (with `labels`). evaluate(model) -> metrics runs every eval_every steps. Returns the history.

    run_options: whatever else decides what the run computes (the data folder, augmentation): kept in each checkpoint
    and, like the config's fields that do, required to be the same on resume.

    stop_after: stop (after checkpointing) once this many steps are done in this call — for tests and for
    splitting a long run into pieces.

    Under torchrun (WORLD_SIZE > 1) it trains with DistributedDataParallel: every process takes its share of
    each global batch of `batch_size`, the loss is weighted so the gradients equal one process's on the whole
    batch, and process 0 alone evaluates and writes checkpoints.

    Problems a user can fix (an unreadable checkpoint, a full disk, a diverging loss) are ValueErrors of one
    line that name the file and say what to do; checkpoints written before stay intact for `resume=True`.
    """
    from tqdm import tqdm

    world = _distributed()
    rank = world.rank if world else 0
    if world and config.batch_size % world.size:
        raise ValueError(f"batch_size {config.batch_size} is the global batch: make it a multiple of the "
                         f"{world.size} processes")
    with writing(config.output_dir, "create the output folder", "choose another output folder"):
        os.makedirs(config.output_dir, exist_ok=True)
    seed_everything(config.seed)
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False  # no K/V cache in training (and it clashes with checkpointing)
    optimizer = _optimizer(model, config)
    step, history = load_checkpoint(model, optimizer, config.output_dir, config, run_options) if resume else \
        (0, {"step": [], "loss": [], "eval": []})
    loss_png = os.path.join(config.output_dir, "loss.png")
    step_once = _Stepper(model, optimizer, dataset, collate, config, world)

    model.train()
    # closed (a newline) even when training stops with an error, so the message gets a line of its own
    with tqdm(total=config.max_steps, initial=step, desc="training", disable=not progress or rank != 0,
              dynamic_ncols=True) as bar:
        done_here = 0
        while step < config.max_steps:
            loss = step_once(step)
            step += 1
            done_here += 1
            history["step"].append(step)
            history["loss"].append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if evaluate is not None and rank == 0 and (step % config.eval_every == 0 or step == config.max_steps):
                try:
                    _evaluate(model, evaluate, history, step, bar)
                except Exception:  # a damaged validation file, say: the steps so far are kept for --resume
                    if not world:
                        save_checkpoint(model, optimizer, step, history, config, run_options)
                    raise
                _plot(history, loss_png, config.output_dir)
            stopping = stop_after is not None and done_here >= stop_after
            if step % config.save_every == 0 or step == config.max_steps or stopping:
                if rank == 0:
                    save_checkpoint(model, optimizer, step, history, config, run_options)
                if world:
                    torch.distributed.barrier()  # nobody runs ahead of (or resumes from) a half-written checkpoint
            if stopping:
                break
    model.eval()
    model.config.use_cache = use_cache
    if rank == 0:
        _plot(history, loss_png, config.output_dir)
    return history


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
    )


class _Stepper:
    """One optimizer step on the batch of a step number: (step) -> the whole batch's loss."""

    def __init__(self, model, optimizer, dataset, collate, config: TrainConfig, world):
        self.model, self.optimizer, self.dataset, self.collate = model, optimizer, dataset, collate
        self.config, self.world = config, world
        self.bf16 = config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and cpu_has_native_bf16())
        # with the layers checkpointed, the LM head's logits are the largest activations left: chunk the loss
        self.chunked = config.gradient_checkpointing and chunked_loss.applies(model, distributed=world is not None)
        self.own_loss = chunked_loss.takes_shifted_labels(model)  # not the model's .loss: see chunked_loss
        # find_unused_parameters: encoders carry parts a captioner never uses (ViT's pooler)
        self.runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if world \
            else model

    def _loss(self, inputs: dict) -> torch.Tensor:
        if self.chunked:
            return chunked_loss.loss(self.runner, **inputs)
        if self.own_loss:
            return chunked_loss.full_loss(self.runner, **inputs)
        return self.runner(**inputs).loss

    def __call__(self, step: int) -> float:
        config, world = self.config, self.world
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate_at(step, config)
        indices = batch_indices(step, len(self.dataset), config.batch_size, config.seed)
        if world:
            indices = indices.chunk(world.size)[world.rank]
        examples = [self.dataset[int(i)] for i in indices]
        try:
            inputs = self.collate(examples)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                loss = self._loss(inputs)
        except (ValueError, RuntimeError, IndexError) as error:
            named = _batch_error(error, examples, step, lambda e: self.model(**self.collate([e])))
            if named is None:
                raise
            raise named from error
        if world:  # DDP averages gradients over processes: weight each share by its tokens in the whole batch
            loss = _global_token_mean(loss, inputs["labels"], world.size)
        logged = _whole_batch_loss(loss, world)
        if not math.isfinite(logged):  # checked before the update, so the weights stay usable
            raise ValueError(f"the training loss is {logged} at step {step + 1}: lower --learning-rate or "
                             f"--max-grad-norm (or use --mixed-precision no); {latest_words(config.output_dir)}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
        self.optimizer.step()
        return logged


def _evaluate(model, evaluate, history: dict, step: int, bar) -> None:
    model.eval()
    metrics = evaluate(model)
    model.train()
    history["eval"].append({"step": step, **metrics})
    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def _batch_error(error: Exception, examples: list, step: int, alone: Callable[[dict], object]) -> ValueError | None:
    """A batch the model cannot take (audio too short for the encoder, say) as one line naming the file: the
    examples are tried one by one, alone(example), to find the one that fails. None: nothing to add."""
    paths = [e["path"] for e in examples if isinstance(e, dict) and isinstance(e.get("path"), str)]
    reason = error_line(error)
    if len(paths) != len(examples) or any(str(error).startswith(p) for p in paths):  # nothing to name, or named
        return None
    for example in examples:
        try:
            with torch.no_grad():
                alone(example)
        except (ValueError, RuntimeError, IndexError) as failure:
            return ValueError(f"{example['path']}: the model cannot train on it ({error_line(failure)}); is it "
                              "too short, too long or damaged? Leave it out of the training data")
    named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return ValueError(f"step {step + 1}: the model cannot train on the batch of {named} ({reason})")


def _whole_batch_loss(loss: torch.Tensor, world) -> float:
    """The loss of the whole batch: under DDP the re-weighted shares of all processes sum to world size x it."""
    if not world:
        return loss.item()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / world.size


# ---- several processes (torchrun) -------------------------------------------------------------------------
@dataclass
class _World:
    rank: int
    size: int


def _distributed() -> _World | None:
    """Join torchrun's process group (gloo on CPU, nccl on GPUs) when WORLD_SIZE > 1."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return _World(dist.get_rank(), dist.get_world_size())


def _global_token_mean(local_mean: torch.Tensor, labels: torch.Tensor, world_size: int) -> torch.Tensor:
    """This process's token-mean loss re-weighted so that DDP's gradient average is the whole batch's mean."""
    import torch.distributed as dist

    local_tokens = (labels != -100).sum().to(torch.float64)
    total = local_tokens.clone()
    dist.all_reduce(total)
    return local_mean * (local_tokens * world_size / total).to(local_mean.dtype)


def _plot(history: dict, path: str, output_dir: str) -> None:
    with writing(path, "draw the loss curve", f"{latest_words(output_dir)}: free some space and rerun with "
                 "--resume"):
        plot_history(history, path)


# ---- pictures -------------------------------------------------------------------------------------------
def plot_history(history: dict, path: str) -> None:
    """Training loss (raw and smoothed) and evaluation metrics against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..files import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = history["step"], history["loss"]
    if steps:
        ax.plot(steps, losses, color="#bbbbbb", linewidth=0.8, label="train loss")
        window = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, color="#1f77b4", label=f"train loss (mean of {window})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    evals = history["eval"]
    if evals:
        other = ax.twinx()
        for key in [k for k in evals[0] if k != "step"]:
            other.plot([e["step"] for e in evals], [e[key] for e in evals], marker="o", label=key)
        other.set_ylabel("evaluation")
        other.legend(loc="center right")
    ax.legend(loc="upper right")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
