"""Per-request records and the per-step state that flows through the stages.

Fields are marked with the stage kind (or the engine) that owns them, as
mini-sglang does; only the owner writes a field, the others read it.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import attrs
import torch

from .params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Sequence:
    """One generated sequence (a request with n=2 owns two)."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list  # prompt then output, appended by the engine
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order, for FCFS and fairness
    priority: int = 0  # lower is served first, ties by arrival (vLLM's priority scheduling)
    generator: Optional[torch.Generator] = None
    status: SeqStatus = SeqStatus.WAITING
    block_table: list = attrs.field(factory=list)  # owned by the scheduler's block pool
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0
    replay_start: int = 0  # bounded-replay start; belongs to the request, survives preemption
    # Prefix caching (core/prefix_cache.py, stages/prefix_cache.py, stages/swa_replay.py). cache_root None: this
    # sequence neither looks up nor registers blocks.
    cache_root: Optional[bytes] = None  # the hash its block 0 chains from (engine identity, cache_salt)
    block_hashes: list = attrs.field(factory=list)  # hashes of its full blocks computed so far
    num_committed_blocks: int = 0  # leading blocks of block_table registered (or hit) in the cache
    num_cached_tokens: int = 0  # tokens of the last admission's hit: their paged KV is shared, never rewritten
    prefix_replay_start: int = 0  # first position recomputed after that hit (< num_cached_tokens: SWA replay)
    # (P, snapshot) when that hit brings the window state back from the encoder-SWA pool (core/swa_pool.py)
    # instead of replaying: restored before the sequence's next step, then None.
    swa_restore: Optional[tuple] = None
    draft: list = attrs.field(factory=list)  # speculative tokens proposed for its next step (core/speculative.py)
    draft_probs: Any = None  # [len(draft), V] the distributions the drafts were drawn from (None: point masses)
    # the target's hidden states a drafter conditions on (stages/dspark_draft.py): a tensor or a layout.HiddenRow
    draft_context: Any = None
    draft_survival: Any = None  # [len(draft)] predicted probability that drafts 1..i all stand (dynamic lengths)
    draft_state: Any = None  # a drafter's own per-sequence state, fed by its observe() (stages/mtp_draft.py: MTP KV)
    spec_stats: Any = None  # a SpecStats of this sequence's verified steps (RequestOutput.metrics), once it has one
    wait_for: Optional["Sequence"] = None  # a sibling (n > 1) waits for this one to compute the shared prompt
    state_slot: int = -1  # per-sequence state (SWA rings, compressor tails) while it holds KV; scheduler-owned
    # Tokens sampled by launched steps but not yet collected (engine-owned): each a negative reference into the
    # engine's device buffer of future tokens, the input ids of the positions after token_ids. At most two
    # (the step in flight and the one being launched) with overlap scheduling, at most one without.
    pending: list = attrs.field(factory=list)
    draining: bool = False  # its last token is pending (max_tokens / max_model_len): never scheduled again
    # Output side, owned by the engine (folded from detokenize/sample results).
    text: str = ""
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    error: Optional[str] = None
    detok: Any = None  # IncrementalDetokenizer
    stopper: Any = None  # StopChecker

    @property
    def num_tokens(self) -> int:
        """Known tokens, sampled-but-pending ones included (what the scheduler schedules over)."""
        return len(self.token_ids) + len(self.pending)

    def input_ids(self, start: int, n: int) -> list:
        """Token ids of positions start .. start+n-1; pending positions give their future references (< 0), and
        positions past every known token its draft tokens (a speculative step)."""
        known = self.token_ids[start:start + n]
        if len(known) < n:
            k = max(start - len(self.token_ids), 0)
            known = known + self.pending[k:k + n - len(known)]
        if len(known) < n:
            k = max(start - self.num_tokens, 0)
            known = known + self.draft[k:k + n - len(known)]
        return known

    @property
    def prompt_token_ids(self) -> list:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids) without the copy (asked per row and token every step)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


def window_cuts(seq) -> tuple:
    """A sequence's SWA cuts, as models that keep window state outside the paged blocks read them: the decoder's
    (its replay start, or a prefix hit's replay start if later: its rings start there) and the other layers'
    (the prefix hit's replay start, or 0)."""
    return max(int(seq.replay_start), seq.prefix_replay_start), seq.prefix_replay_start


@attrs.define(eq=False, slots=False)
class AdmitState:
    """State of the admit phase, one per request."""

    request_id: str  # engine
    prompt: Any  # engine: str, token ids or {"prompt_token_ids": [...]}
    params: SamplingParams  # engine
    prompt_token_ids: Optional[list] = None  # tokenize
    cache_root: Optional[bytes] = None  # prefix_cache: the key its blocks chain from (None: no prefix caching)
    replay_start: int = 0  # swa_replay: the bounded-replay start of its prompt


@attrs.define(eq=False)
class ScheduledBatch:
    """What the scheduler decided for one step (engine input, read-only for stages)."""

    seqs: list  # [B] Sequence, in batch order
    num_tokens: list  # [B] tokens of each sequence computed this step
    start: list  # [B] first position computed this step (== seq.num_computed_tokens before the step)
    samples: list  # [B] bool: the step completes the sequence's known tokens, so it samples one
    future: Optional[torch.Tensor] = None  # engine: device buffer that negative (pending) input ids index
    drafts: Optional[list] = None  # [B] draft tokens each row verifies after its last token (None: no row drafts)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class StepState:
    """One engine step over the whole batch. Plugins may add fields of their own."""

    def __init__(self, batch: ScheduledBatch, sampling: Any, kv_cache: Any):
        self.batch = batch  # engine: scheduled sequences
        self.sampling = sampling  # engine: SamplingBatch of the sampling rows
        self.kv_cache = kv_cache  # engine: the paged KV tensors
        self.inputs: Any = None  # prefill: core.inputs.ForwardInputs, every row as one ragged token stream
        self.hidden: Optional[torch.Tensor] = None  # forward: [T, d] final hidden states of the stream
        self.logits: Optional[torch.Tensor] = None  # verify: [S, V] logits of the sampling rows, in batch order
        self.draft_logits: Optional[torch.Tensor] = None  # verify: [D, V] logits at the drafted positions (row order)
        self.prompt_logprobs: Optional[dict] = None  # verify: seq_id -> (first position, prompt logprob entries)
        self.bad_rows: Optional[torch.Tensor] = None  # engine: [S] bool, sampling rows whose logits were not finite
        self.logits_kept = False  # engine: reset before each stage; a logits writer that left them as they were sets it
        self.next_tokens: Optional[torch.Tensor] = None  # sample: [S] int64
        self.logprobs: Any = None  # sample: LogprobsTensors or None
        self.outputs: Optional[list] = None  # detokenize: [S] SeqUpdate

    @property
    def sample_rows(self) -> list:
        """Indices into batch.seqs of the rows that sample this step."""
        return [i for i, s in enumerate(self.batch.samples) if s]


ADMIT_INPUTS = ("request_id", "prompt", "params")
STEP_INPUTS = ("batch", "sampling", "kv_cache")
ADMIT_OUTPUTS = ("prompt_token_ids",)  # the engine needs these from the admit phase
STEP_OUTPUTS = ("next_tokens", "outputs")  # ... and these from the step phase
