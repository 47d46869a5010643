"""Each generated token's log-probability under the model's own distribution (before temperature, top-k/top-p or
penalties): the parts of avg_logprob (faster-whisper's) that do not need a model. xattn.hf.scores replays sequences
where the tokens' logits were not kept."""

from __future__ import annotations

import torch


def up_to_first_eos(generated: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """[rows, new] float, 1 for the tokens a row generated before and at its first EOS (the pad after it: 0)."""
    if not eos_token_ids:
        return torch.ones_like(generated, dtype=torch.float32)
    is_eos = torch.isin(generated, torch.tensor(eos_token_ids, device=generated.device))
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before each position
    return (eos_before == 0).float()


def mean_up_to_first_eos(token_logprobs: torch.Tensor, generated: torch.Tensor, eos_token_ids: list[int]
                         ) -> torch.Tensor:
    """[rows] avg_logprob: the mean of token_logprobs [rows, new] (each generated token's [rows, new]) over the
    tokens up to and including each row's first EOS; NaN for a row with none."""
    counted = up_to_first_eos(generated, eos_token_ids)
    count = counted.sum(-1)
    total = (token_logprobs * counted).sum(-1)
    return torch.where(count > 0, total / count.clamp(min=1), float("nan")).cpu()


class ChosenLogprobs:
    """Each chosen token's log-probability under the model's own distribution (before any filter), taken from the
    logits that chose it: avg_logprob without replaying the sequences. `complete` is False where a step never gave
    full logits (the fused greedy argmax); then, and for beams, xattn.hf.scores replays the sequences."""

    def __init__(self, rows: int, max_new: int, device: torch.device):
        self.values = torch.zeros(rows, max_new, device=device)
        self.steps, self.complete = 0, True

    def add(self, own: torch.Tensor, tokens: torch.Tensor) -> None:
        """own: log_softmax of the step's logits, taken before the search's filters (which may work in place)."""
        self.values[:, self.steps] = own.gather(-1, tokens[:, None].to(own.device))[:, 0]
        self.steps += 1

    def average(self, generated: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
        """[rows] the mean over each row's generated tokens [rows, steps] up to and including its first EOS."""
        return mean_up_to_first_eos(self.values[:, :self.steps], generated[:, :self.steps], eos_token_ids)
