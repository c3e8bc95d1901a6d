"""Admit stage: where a request recomputes sliding-window state that no cache holds (bounded replay, CED.md),
out of the model and the engine.

At admission: the decoder's replay start (CED's decoder runs over the last n_win prompt tokens;
``model.replay_start_for``, or ``replay_start_for_scoring`` for a request that scores its prompt).

On a prefix-cache hit of P tokens (``plan``, called by the scheduler, unless the encoder-SWA pool holds the
window state at P: core/swa_pool.py restores it and nothing is replayed): the model's ``swa_state()`` says what
the hit does not bring back. None (the Llama family; Mistral's and Qwen2's window KV lives in the blocks):
compute from P. Otherwise the window state of ``layers`` layers is rebuilt by recomputing from s < P with
the window cut at s (in every layer: the decoder's cut is the later of its own replay start and s):
``mode="bounded"`` (the default) s = P - window (CED.md's encoder path: the replayed tokens rebuild SWA KV
only; their global KV and indexer keys are in the shared blocks and are never rewritten),
``mode="exact"`` s = P - (layers + 1) * window, beyond the receptive field of the window state through
every layer, so the hit reproduces a cold prefill up to float rounding (the oracle). A hit with s <= 0, or a model that needs every
prompt position (CED in exact replay mode: its decoder runs over all of them), is not used.
"""

from __future__ import annotations

import attrs

from ..core.stage import Stage

MODES = ("bounded", "exact")


def _mode(inst, attribute, mode) -> None:
    """An attrs validator, so a recipe's ``mode`` is checked when the recipe loads (core/recipe.py)."""
    if mode not in MODES:
        raise ValueError(f"swa_replay mode={mode!r} is invalid: expected one of {MODES}")


@attrs.define(eq=False)
class SwaReplayStage(Stage):
    name = "swa_replay"
    kind = "swa_replay"
    phase = "admit"
    reads = ("prompt_token_ids", "params")
    writes = ("replay_start",)

    model: object
    mode: str = attrs.field(default="bounded", validator=_mode)

    def __call__(self, st) -> None:
        n = len(st.prompt_token_ids)
        if st.params.prompt_logprobs is not None and hasattr(self.model, "replay_start_for_scoring"):
            st.replay_start = self.model.replay_start_for_scoring(n)
        else:
            st.replay_start = self.model.replay_start_for(n) if hasattr(self.model, "replay_start_for") else 0

    def plan(self, seq, hit: int) -> int:
        """First position to recompute after a hit of ``hit`` tokens (0: don't use the hit). A sequence that
        was preempted replays exactly: it resumes with the state it had, so it finishes with the output it
        would have had (up to float rounding)."""
        state = self.model.swa_state() if hasattr(self.model, "swa_state") else None
        if state is None:
            return hit
        if state.needs_all_positions:
            return 0
        exact = self.mode == "exact" or seq.num_preemptions > 0
        back = (state.layers + 1) * state.window if exact else state.window
        return max(0, hit - back)
