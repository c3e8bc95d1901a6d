"""The model contract every architecture implements.

Two paths over the same weights: the engine path (``forward``: ragged tokens
of many sequences over a paged KV cache) and the full-sequence path
(``forward_full``: one whole sequence, masks, no cache) that is its oracle.
"""

from __future__ import annotations

from typing import Iterable, Optional

import attrs
import torch
from torch import nn


class CausalLM(nn.Module):
    vocab_size: int
    max_position: int  # the checkpoint's context length (max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """input_ids [T] of many sequences, AttnMetadata, the cache from allocate_kv_cache -> hidden [T, d]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> float32 logits [N, V]."""
        raise NotImplementedError

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One whole sequence input_ids [L] -> float32 logits [L, V], no cache (the oracle)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def allocate_kv_cache(self, num_slots: int, dtype: torch.dtype, device, block_size: int = 16,
                          max_seqs: int = 1) -> object:
        """The model's KV storage for ``num_slots`` paged token slots (num_slots // block_size blocks)
        plus any per-sequence state for ``max_seqs`` state slots."""
        raise NotImplementedError

    def replay_start_for(self, num_prompt_tokens: int) -> int:
        """Position from which the model recomputes per-sequence state at prefill (bounded replay); 0 = all."""
        return 0

    def swa_state(self) -> Optional["SwaState"]:
        """What a prefix-cache hit does not bring back (read by the swa_replay stage): None when every bit of
        per-sequence state lives in the paged blocks (the Llama family; Mistral's and Qwen2's sliding-window
        layers keep their window's KV in the blocks too). A model that returns a SwaState gets rows that
        recompute tokens before their hit point: it must cut their windows at ``meta.swa_cuts`` and write no
        paged KV below ``meta.write_floors`` (those blocks are shared; CED's engine path does both)."""
        return None

    def load_weights(self, weights: Iterable) -> None:
        """weights: (checkpoint tensor name, tensor) pairs; raises naming a missing or misshapen tensor."""
        raise NotImplementedError

    def hf_state_dict(self) -> dict:
        """The weights under the checkpoint's own tensor names (for writing a checkpoint)."""
        raise NotImplementedError


@attrs.frozen
class SwaState:
    """Sliding-window state kept outside the paged blocks (CED's SWA rings): a prefix hit at P must rebuild it
    by recomputing tokens before P with the window cut at the first one (bounded replay, CED.md)."""

    window: int  # n_win: bounded replay recomputes [P - window, P)
    layers: int  # layers whose window state is rebuilt (CED: all); exact replay goes back (layers + 1) windows
    needs_all_positions: bool = False  # a later part runs over every prompt position (CED's exact decoder):
    # nothing before the prompt's end can be skipped, so no hit is usable


class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape; the message names it."""


def hf_get(cfg: dict, *names, default=None):
    """First present key among transformers 4 and 5 spellings."""
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default
