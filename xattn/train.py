"""Fine-tuning of transformers encoder-decoder models (VisionEncoderDecoder, SpeechEncoderDecoder).

Deterministic and resumable: the data order is a function of (seed, epoch), checkpoints hold the weights
(safetensors), optimizer, schedule and RNG state and are written atomically, so `resume=True` after a kill
ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_model, save_model

STATE_FILE = "trainer_state.pt"  # optimizer, step, RNG, history: tensors and plain data (weights_only load)
WEIGHTS_FILE = "weights.safetensors"
LATEST = "latest"  # a file naming the newest complete checkpoint directory


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
    seed: int = 0
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    mixed_precision: str = "auto"  # "bf16", "no", or "auto" (bf16 where the CPU has native bf16)
    keep_checkpoints: int = 2

    def __post_init__(self):
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise ValueError(f"mixed_precision must be 'auto', 'bf16' or 'no', got {self.mixed_precision!r}")
        if self.max_steps < 1 or self.batch_size < 1:
            raise ValueError("max_steps and batch_size must be >= 1")


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
        raise ValueError(f"the dataset ({dataset_size} examples) is smaller than one batch ({batch_size})")
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[offset * batch_size : (offset + 1) * batch_size]


def train(
    model: torch.nn.Module,
    dataset,
    collate: Callable[[list[dict]], dict],
    config: TrainConfig,
    *,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Train `model` on `dataset` (anything indexable with len); collate turns examples into model kwargs
    (with `labels`). evaluate(model) -> metrics runs every eval_every steps. Returns the history.

    stop_after: stop (after checkpointing) once this many steps are done in this call — for tests and for
    splitting a long run into pieces.

    Under torchrun (WORLD_SIZE > 1) it trains with DistributedDataParallel: every process takes its share of
    each global batch of `batch_size`, the loss is weighted so the gradients equal one process's on the whole
    batch, and process 0 alone evaluates and writes checkpoints.
    """
    from tqdm import tqdm

    world = _distributed()
    rank = world.rank if world else 0
    os.makedirs(config.output_dir, exist_ok=True)
    torch.manual_seed(config.seed)
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False  # no K/V cache in training (and it clashes with checkpointing)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
    )
    history = {"step": [], "loss": [], "eval": []}
    step = 0
    if resume:
        step, history = _load_checkpoint(model, optimizer, config.output_dir)
    use_bf16 = config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and cpu_has_native_bf16())
    if world and config.batch_size % world.size:
        raise ValueError(f"batch_size {config.batch_size} is the global batch: make it a multiple of the "
                         f"{world.size} processes")
    # find_unused_parameters: encoders carry parts a captioner never uses (ViT's pooler)
    runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if world else model

    model.train()
    bar = tqdm(total=config.max_steps, initial=step, desc="training", disable=not progress or rank != 0,
               dynamic_ncols=True)
    done_here = 0
    while step < config.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, config)
        indices = batch_indices(step, len(dataset), config.batch_size, config.seed)
        if world:
            indices = indices.chunk(world.size)[rank]
        inputs = collate([dataset[int(i)] for i in indices])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = runner(**inputs).loss
        optimizer.zero_grad(set_to_none=True)
        if world:  # DDP averages gradients over processes: weight each share by its tokens in the whole batch
            loss = _global_token_mean(loss, inputs["labels"], world.size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        step += 1
        done_here += 1
        history["step"].append(step)
        if world:  # log the whole batch's loss: the re-weighted shares sum to world size x the mean
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world.size
        history["loss"].append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{history['loss'][-1]:.4f}")
        if evaluate is not None and rank == 0 and (step % config.eval_every == 0 or step == config.max_steps):
            model.eval()
            metrics = evaluate(model)
            model.train()
            history["eval"].append({"step": step, **metrics})
            bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            plot_history(history, os.path.join(config.output_dir, "loss.png"))
        stopping = stop_after is not None and done_here >= stop_after
        if step % config.save_every == 0 or step == config.max_steps or stopping:
            if rank == 0:
                _save_checkpoint(model, optimizer, step, history, config)
            if world:
                torch.distributed.barrier()  # nobody runs ahead of (or resumes from) a half-written checkpoint
        if stopping:
            break
    bar.close()
    model.eval()
    model.config.use_cache = use_cache
    if rank == 0:
        plot_history(history, os.path.join(config.output_dir, "loss.png"))
    return history


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


# ---- checkpoints ----------------------------------------------------------------------------------------
def _save_checkpoint(model, optimizer, step: int, history: dict, config: TrainConfig) -> None:
    """Write checkpoint-{step} completely under a temporary name, then point `latest` at it atomically."""
    name = f"checkpoint-{step}"
    final = os.path.join(config.output_dir, name)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # the in-memory parameter names, exactly (save_pretrained may rename keys for older layouts)
    save_model(model, os.path.join(tmp, WEIGHTS_FILE))
    torch.save(
        {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(), "history": history},
        os.path.join(tmp, STATE_FILE),
    )
    with open(os.path.join(tmp, "train_config.json"), "w") as f:
        json.dump(asdict(config), f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = os.path.join(config.output_dir, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(name)
    os.replace(pointer + ".tmp", pointer)
    checkpoints = sorted(
        (d for d in os.listdir(config.output_dir) if d.startswith("checkpoint-") and not d.endswith(".tmp")),
        key=lambda d: int(d.split("-")[1]),
    )
    for old in checkpoints[: -config.keep_checkpoints]:
        shutil.rmtree(os.path.join(config.output_dir, old), ignore_errors=True)


def latest_checkpoint(output_dir: str) -> str | None:
    pointer = os.path.join(output_dir, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(output_dir, f.read().strip())


def _load_checkpoint(model, optimizer, output_dir: str) -> tuple[int, dict]:
    path = latest_checkpoint(output_dir)
    if path is None:
        return 0, {"step": [], "loss": [], "eval": []}
    missing, unexpected = load_model(model, os.path.join(path, WEIGHTS_FILE), strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    state = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]


# ---- pictures -------------------------------------------------------------------------------------------
def plot_history(history: dict, path: str) -> None:
    """Training loss (raw and smoothed) and evaluation metrics against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
