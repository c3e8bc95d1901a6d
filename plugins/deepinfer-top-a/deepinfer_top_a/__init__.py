"""Top-a sampling as a DeepInfer stage plugin.

Top-a keeps, in each row, the tokens whose probability is at least
``a * max_prob ** 2``: when the model is sure of one token (max_prob near 1)
little else survives; when it is unsure the cut is mild. The kept tokens are
sampled in proportion to their probability.

Per row, the stage honours what the engine's SamplingBatch carries: banned
tokens (stop tokens under ``min_tokens``), presence/frequency/repetition
penalties and temperature. Greedy rows (temperature 0) take the argmax; rows
with a seed draw from their own generator; the rest share the engine's
generator in one batched draw. It replaces top-k/top-p/min-p: those
SamplingParams fields are ignored in a pipeline that uses this stage.
"""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

from deepinfer import Stage, hookimpl

__all__ = ["TopASample", "top_a_filter", "deepinfer_register_stages"]

_GREEDY_EPS = 1e-5  # the temperature below which a row is greedy, as SamplingParams.greedy decides


def _check_a(inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"top_a: a={value!r} is invalid: must be a finite number >= 0")


def top_a_filter(probs: torch.Tensor, a: float) -> torch.Tensor:
    """probs [S, V] -> bool mask [S, V] of the tokens top-a keeps (p >= a * max_p**2; the most likely always)."""
    max_p = probs.max(dim=-1, keepdim=True).values  # [S, 1]
    return (probs >= a * max_p * max_p) | (probs == max_p)


@attrs.define(eq=False)
class TopASample(Stage):
    name = "top_a"
    kind = "sample"
    reads = ("logits", "sampling")
    writes = ("next_tokens",)

    a: float = attrs.field(default=0.2, validator=_check_a)
    generator: Optional[torch.Generator] = None  # engine-wide, for rows without their own seed

    def __call__(self, state) -> None:
        batch = state.sampling
        logits = state.logits.float()  # [S, V]
        from deepinfer.backends.reference.sampling import apply_penalties  # pure torch, any device

        logits = apply_penalties(logits, batch)
        if batch.banned is not None:
            logits = logits.masked_fill(batch.banned, float("-inf"))
        greedy_tok = logits.argmax(dim=-1)  # [S]
        if batch.all_greedy:
            state.next_tokens = greedy_tok
            return
        greedy = batch.temperature < _GREEDY_EPS  # [S]
        temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # [S]
        probs = (logits / temp.unsqueeze(1)).softmax(dim=-1)  # [S, V]
        probs = probs * top_a_filter(probs, self.a)  # [S, V], unnormalized: multinomial does not need it
        out = greedy_tok.clone()
        # Only rows that sample (not greedy) draw; seeded ones from their own generator.
        is_random = (~greedy).tolist()
        seeded = [i for i, g in enumerate(batch.generators) if g is not None and is_random[i]]
        shared = [i for i, r in enumerate(is_random) if r and batch.generators[i] is None]
        for i in seeded:
            out[i] = torch.multinomial(probs[i], 1, generator=batch.generators[i])[0]
        if shared:
            rows = torch.tensor(shared, device=probs.device)
            out[rows] = torch.multinomial(probs[rows], 1, generator=self.generator).squeeze(1)
        state.next_tokens = out


@hookimpl
def deepinfer_register_stages(register) -> None:
    register.stage(kind=TopASample.kind, name=TopASample.name, factory=TopASample)
