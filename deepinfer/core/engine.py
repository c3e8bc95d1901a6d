"""Engine.step(): schedule -> pipeline stages -> fold results back into the sequences.

A request that cannot be served fails alone: its output carries
finish_reason "error" and a message, and the engine keeps serving the others.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time

import torch

from ..layout import HiddenRow, to_host
from ..outputs import Logprob, entries_from
from ..backends.batch_invariant import kernel_mode
from .block_tables import BlockTables
from .sampling_state import SamplingState
from .kv_cache import BlockPool, blocks_needed
from .kv_offload import block_mover
from .prefix_cache import PrefixCache
from .swa_pool import SwaStatePool, wanted as swa_pool_wanted
from .draft_gate import DraftGate
from .survival_calibration import CALIBRATE_EVERY, SurvivalCalibration
from .speculative import (SpecStats, SpeculativeConfig, SpeculativeConfigError, StepTime, build_drafter, can_speculate,
                          choose_lengths, verify_width, wants_hidden)
from .spec_step import launch_acceptance
from .params import SamplingParams, completion_seed
from .scheduler import Scheduler
from .requests import Request, request_output
from .stage import RowError
from .state import AdmitState, ScheduledBatch, SeqStatus, Sequence, StepState

log = logging.getLogger(__name__)


def _decodes_only(batch) -> bool:
    """Every row of the step decodes (its last token, plus its drafts): no prefill chunk, whose tokens would
    price as decode tokens in the step-time curve."""
    drafts = batch.drafts or [()] * len(batch.seqs)
    return all(batch.samples) and all(n == 1 + len(d) for n, d in zip(batch.num_tokens, drafts))


def _guard_logits(state, ops) -> None:
    """Zero the logits of rows that hold a NaN or +inf or are all -inf (on the device, no host sync) and
    record them in ``state.bad_rows``: the sampler then draws harmlessly and the engine fails those rows."""
    lg = state.logits
    if not isinstance(lg, torch.Tensor) or lg.ndim != 2 or lg.shape[0] == 0:
        return
    state.bad_rows = ops.guard_logits(lg, state.bad_rows)


class _Launched:
    """A step whose device work is queued: its state, sampling rows, and the tokens' copy to the host."""

    def __init__(self, state, sample_seqs: list):
        self.state, self.sample_seqs = state, sample_seqs
        self.host_tokens = None
        self.host_bad = None  # [S] bool: rows whose logits were not finite
        self.event = None
        self.collected = False
        self.spec = None  # core.spec_step.SpecLaunch of a verify step
        self.captured_hidden = None  # the model's kept hidden states of this step (a drafter's context)
        self.gate_plain = False  # a dynamic engine's overlapped plain step, decodes only (timed for the gate)
        self.gate_steady = False  # ... launched by a call that collected one: in a stream of them (timed)


class Engine:
    def __init__(self, config, model, tokenizer, pipeline, ops, num_blocks: int, max_model_len: int,
                 identity: str = "", model_path=None):
        """identity: what the model's KV depends on besides the tokens (checkpoint, dtype, cache layout); prefix
        caching keys blocks by it, so a slower tier shared between engines never serves another model's KV."""
        self.config, self.model, self.tokenizer, self.pipeline, self.ops = config, model, tokenizer, pipeline, ops
        self.max_model_len = max_model_len
        self.device = ops.device
        # Device stages (and the CUDA graphs that hold them) run in this context: batch-invariant kernels or none.
        self.kernel_mode = kernel_mode(config.batch_invariant, ops)
        dtype = next(model.parameters()).dtype
        use_graphs = (not config.enforce_eager and self.device.type == "cuda"
                      and getattr(model, "supports_cuda_graphs", False)
                      and not wants_hidden(pipeline, config, model, model_path))
        # With CUDA graphs one extra block is scratch space for the padded rows of a captured batch.
        self.kv_cache = model.allocate_kv_cache((num_blocks + use_graphs) * config.block_size, dtype, self.device,
                                                block_size=config.block_size, max_seqs=config.max_num_seqs)
        reserve = getattr(model, "reserve_positions", None)
        if reserve is not None:
            reserve(max_model_len)
        self.kv_bytes_per_token = model.kv_bytes_per_token(dtype)
        self.pool = getattr(model, "block_pool", BlockPool)(num_blocks)  # parallel/workers.py: one per rank
        self.cache_identity = f"{type(model).__name__}|{dtype}|block {config.block_size}|{identity}"
        self.prefix_cache = None
        if config.enable_prefix_caching:
            mover = block_mover(config, model, self.kv_cache, self.cache_identity, self.device)
            per_rank = getattr(self.pool, "prefix_cache", None)  # data-parallel attention: one per rank's blocks
            self.prefix_cache = per_rank(config.block_size, mover) if per_rank is not None \
                else PrefixCache(self.pool, config.block_size, mover, config.disk_write_through)
        self.swa_pool = SwaStatePool(model, self.kv_cache, config) if self.prefix_cache is not None \
            and swa_pool_wanted(config, model) else None
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampling_state = SamplingState(config.max_num_seqs, model.vocab_size,
                                            tokenizer.eos_token_ids if tokenizer else (), self.device)
        self.block_tables = BlockTables(config.max_num_seqs, blocks_needed(max_model_len, config.block_size),
                                        self.device, scratch_block=num_blocks if use_graphs else None)
        self.decode_graphs = None
        self.graph_bytes = 0
        if use_graphs:  # captured now, at start-up, not while serving
            from ..backends.cuda_graph import DecodeGraphs, capture_sizes

            self.decode_graphs = DecodeGraphs(model, self.kv_cache, self.block_tables, config.block_size,
                                              self.device, capture_sizes(config.cuda_graph_sizes, config.max_num_seqs))
            width = verify_width(pipeline, config, model, model_path)
            if width:  # speculative verify steps get graphs of their own (padded to k + 1 tokens a row)
                self.decode_graphs.enable_verify(width, max_model_len)
            enable_pass_graphs = getattr(model, "enable_pass_graphs", None)  # CED: bounded replay's decoder pass
            if enable_pass_graphs is not None:
                enable_pass_graphs(self.kv_cache)
        context = dict(config=config, model=model, ops=ops, tokenizer=tokenizer, vocab_size=model.vocab_size,
                       device=self.device, generator=self.generator, engine_config=config,
                       decode_graphs=self.decode_graphs, block_tables=self.block_tables,
                       cache_identity=self.cache_identity, model_path=None if model_path is None else str(model_path))
        self.stages = pipeline.build(context)
        replay = next((st for st in self.stages["admit"] if getattr(st, "kind", "") == "swa_replay"), None)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                                   watermark=config.watermark, aging_steps=config.scheduling_aging_steps,
                                   prefix=self.prefix_cache, replay=getattr(replay, "plan", None),
                                   swa_pool=self.swa_pool)
        self.requests: dict = {}  # not yet reported as finished
        self._to_report: list = []  # failed at admission or aborted since the last step
        self.warned: set = set()  # what add_request has warned about (once per engine)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.stats = {"steps": 0, "step_time": 0.0, "forward_tokens": 0}
        overlap = config.overlap_scheduling
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        # Sampled tokens by launch parity: the next step's inputs read the previous step's half.
        self.max_rows = config.max_num_seqs
        self.future = torch.zeros(2 * self.max_rows, dtype=torch.long, device=self.device)
        if self.decode_graphs is not None:  # (before capture: graphs may read it, backends/cuda_graph.py)
            self.decode_graphs.future = self.future
        self._parity = 0
        self._inflight = None
        step_stages = self.stages["step"]
        self._n_device_stages = next((i for i, st in enumerate(step_stages) if getattr(st, "host", False)),
                                     len(step_stages))
        # Structured outputs (stages/constrain.py): the stage that compiles grammars at admission, the device
        # stages before the first one that reads the tokens of the step in flight, and the jump-forward hook.
        self._admit_hooks = [st for st in step_stages if hasattr(st, "admit_request")]
        self._n_before_known = next((i for i, st in enumerate(step_stages[:self._n_device_stages])
                                     if getattr(st, "reads_known_tokens", False)), self._n_device_stages)
        self._jumpers = [st for st in step_stages if hasattr(st, "jump_forward")]
        # Speculative decoding (core/speculative.py): the drafter, and no overlap (drafting reads the last token).
        self.spec = SpeculativeConfig.parse(config.speculative_config)
        self.drafter, self.spec_stats, self.step_time = None, SpecStats(), StepTime()
        # dynamic: whether a step drafts at all, from measured drafting and plain steps (core/draft_gate.py)
        self.draft_gate = DraftGate() if self.spec is not None and self.spec.dynamic else None
        # and the drafter's predicted survival scaled to what verification found (core/survival_calibration.py)
        self.survival_cal = SurvivalCalibration() if self.draft_gate is not None else None
        self._drafter_ran = True  # whether the last step's drafts were asked for (the gate was open)
        self._gate_kind = None  # the last call's decode-only step for the gate: "draft", "plain" (in flight) or None
        self._gate_todo: list = []  # (record, args) of past steps, done while the device runs one (_gate_chores)
        self._drafts_asked = True  # ... or a seeded request's (``_drafting``)
        self._overlap_plain = False  # whether a plain step of a dynamic engine runs under overlap scheduling
        self._length_steps, self._calibrate = 0, False  # dynamic drafting steps; whether this one feeds calibration
        if self.spec is not None and self.spec.step_time is not None:
            self.step_time = StepTime.load(self.spec.step_time)
        if self.spec is not None:
            try:
                self.drafter = build_drafter(pipeline.registry, self.spec, context, model)
                # A step the gate keeps plain may still overlap the next launch with its collection (a drafter
                # that observes every step's hidden states, MTP, reads them at collection: never).
                self._overlap_plain = self.overlap and self.draft_gate is not None \
                    and not hasattr(self.drafter, "observe")
                self.overlap = False
            except (ValueError, FileNotFoundError) as exc:
                if not self.spec.optional or isinstance(exc, SpeculativeConfigError):
                    raise
                log.info("speculative decoding off (optional %r drafter unavailable: %s)", self.spec.method, exc)
                self.spec = None
        # Graphs captured now, after the stages and the drafter: a DSpark drafter asks the model to keep hidden
        # states, which the graphs then return (captured before it, they returned none: a stale draft context).
        if use_graphs:
            with torch.no_grad(), self.kernel_mode():
                self.graph_bytes = self.decode_graphs.capture_all(progress=log.isEnabledFor(logging.INFO))
            log.info("CUDA graphs: %d captured (batch sizes %s), %.2f GiB", len(self.decode_graphs.graphs),
                     list(self.decode_graphs.batch_buckets), self.graph_bytes / 2**30)
            capture = getattr(self.drafter, "capture_graphs", None)  # a drafter's own graphs (stages/dspark_draft.py)
            if capture is not None:
                with torch.no_grad():  # (drafting runs outside kernel_mode: _propose_drafts)
                    capture(list(self.decode_graphs.batch_buckets), self.spec.num_speculative_tokens)

    # Admission.
    def add_request(self, request_id: str, prompt, params: SamplingParams, stream: bool = False,
                    priority: int = 0) -> Request:
        """Admit a request. ``stream``: report it after every step that changes it, not only when it finishes.
        ``priority``: lower is served first, ties by arrival (as vLLM's priority scheduling)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} is invalid: must be an int")
        req = Request(request_id, prompt, params)
        req.stream = stream
        self.requests[request_id] = req
        try:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
            st = AdmitState(request_id=request_id, prompt=prompt, params=params)
            for stage in self.stages["admit"]:
                stage(st)
            ids = params.truncate(list(st.prompt_token_ids), self.max_model_len)
            req.prompt_token_ids = ids
            if len(ids) + 1 > self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                                 f"for output (prompt must be at most {self.max_model_len - 1} tokens)")
            params = req.params = params.for_model(self.tokenizer, self.model.vocab_size, self.config.max_logprobs)
            if params.structured_outputs is not None and not self._admit_hooks:
                raise ValueError("structured_outputs needs a constrain stage that compiles grammars (the built-in "
                                 "'grammar' stage); this pipeline has none")
            for stage in self._admit_hooks:
                stage.admit_request(request_id, params)  # raises to fail the request alone (bad schema, ...)
        except Exception as exc:  # the request fails alone
            req.error = f"{type(exc).__name__}: {exc}"
            log.warning("deepinfer: request %s failed at admission: %s", request_id, req.error)
            self._to_report.append(req)
            return req
        if params.logprobs is not None and self.pipeline.writer("logprobs") is None and "logprobs" not in self.warned:
            self.warned.add("logprobs")  # once per engine
            log.warning("deepinfer: request %s asks for logprobs, but no stage of the pipeline writes 'logprobs' (the "
                        "sampler was replaced by %r, which does not), so outputs carry none", request_id,
                        self.pipeline.writer("next_tokens"))
        cache_root = st.cache_root if self.prefix_cache is not None else None
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(completion_seed(params.seed, i))
            # The replay start (swa_replay stage) is fixed for the request's life.
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=list(ids),
                           num_prompt_tokens=len(ids), params=params, arrival=next(self._arrivals), priority=priority,
                           generator=gen, replay_start=st.replay_start, cache_root=cache_root)
            if i and cache_root is not None and len(ids) > self.config.block_size:
                seq.wait_for = req.seqs[0]  # computes the prompt once; the siblings hit its blocks
            req.seqs.append(seq)
            self.scheduler.add(seq)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s)
                s.finish_reason = "abort"
        self._to_report.append(req)

    def has_unfinished(self) -> bool:
        return self._inflight is not None or bool(self.requests)  # reported requests leave self.requests

    # One step.
    # No autograd records (they kept every step's temporaries alive). Not inference_mode: state a step creates,
    # such as expert-load counts, is updated in place outside steps too.
    @torch.no_grad()
    def step(self) -> list:
        """Run one engine step; returns a RequestOutput for every request that finished, and for every
        streamed request that changed.

        A step is launched (schedule, device stages: forward and sampling, no host sync) and then collected
        (wait for its tokens, host stages: detokenize and stop checks, fold into the sequences). With
        overlap scheduling the next step is launched before this one is collected, its decode inputs read
        the pending tokens on the device, and the results reported by a call are those of the step before.
        """
        # Admission errors and aborts are reported on the next step (no scan over every request: per-step
        # work does not grow with the number of idle requests).
        touched: dict = {r.request_id: r for r in self._to_report if not r.reported_done}
        self._to_report = []
        t_call = time.perf_counter()
        prev, self._inflight = self._inflight, None
        plain_rows = len(prev.state.batch.seqs) if prev is not None and prev.gate_plain else 0  # (gate timing)
        steady = plain_rows and prev.gate_steady
        gate_record = None  # (drafted, rows, start): this call's step for the gate, timed to the call's end
        switch, kind = None, None  # a switch between kinds for the gate (record_switch's arguments); this call's kind
        if prev is not None and any(s.pending and s.params.needs_output_tokens for s in prev.sample_seqs):
            self._collect_step(prev, touched)  # bad words / logits processors read the output tokens on the host
            prev = None
        drafting = self._drafting() if self.drafter is not None else False
        if prev is not None and drafting:
            self._collect_step(prev, touched)  # the drafter reads the last tokens (a gate-closed step was in flight)
            prev = None
        t0 = time.perf_counter()
        replays = self.decode_graphs.num_verify_replays if self.decode_graphs is not None else 0
        launched = self._launch(touched, prev)  # may collect prev itself, once the forward is queued
        if prev is not None and not prev.collected:
            self._collect_step(prev, touched)
        if launched is not None:
            if self.overlap or (self._overlap_plain and not drafting):
                self._inflight = launched
                if self.draft_gate is not None and _decodes_only(launched.state.batch):
                    launched.gate_plain, launched.gate_steady = True, bool(plain_rows)
                    kind = "plain"
                    if not plain_rows and self._gate_kind == "draft":  # the first plain step after drafting
                        switch = (True, 0, 0)
                    if steady:
                        # A plain step in a stream of plain steps: this call (its collection, its wait included,
                        # the next one's launch, the outputs) is what one costs there, max(host, device). Only
                        # such a step: the first of a run, launched on an idle device, timed by the call that
                        # collected it came out 13-16% below the plain engine's step on the H200 (memory-bound
                        # demo: 3.07 ms against 3.64 at one request, 3.65 against 4.18 at 16), and the gate shut
                        # where drafting ran 1.19x plain; the last one, collected by a drafting step, overlapped
                        # no launch. So the gate explores plain steps in runs of draft_gate.PLAIN_RUN = 3.
                        gate_record = (False, plain_rows, t_call)
            else:
                self._collect_step(launched, touched)
                if self.spec is not None and self.spec.dynamic and _decodes_only(launched.state.batch):
                    # the step-time curve dynamic drafts use, over the steps they are chosen for
                    b, dt = launched.state.batch, time.perf_counter() - t0
                    if self._drafter_ran:  # (a step the gate kept plain paid no drafter: not a length choice's)
                        self._gate_todo.append((self.step_time.record,
                                                (self._step_tokens(launched, replays), dt, len(b.seqs))))
                    if self.draft_gate is not None:
                        gate_record = (self._drafter_ran, len(b.seqs), t0)  # (after a plain one's collection)
                        if self._drafter_ran:
                            kind = "draft"
                            if plain_rows:  # it collected the last plain step of a run
                                switch = (False, plain_rows, len(b.seqs))
        outputs = self._collect(touched)
        if gate_record is not None:  # the outputs are part of a step's cost, of either kind
            drafted, rows, start = gate_record
            self._gate_todo.append((self.draft_gate.record_step, (drafted, rows, time.perf_counter() - start)))
        if switch is not None:  # the whole call: what the switch cost beyond its steps (DraftGate.switch_cost)
            self._gate_todo.append((self.draft_gate.record_switch,
                                    (switch[0], time.perf_counter() - t_call, *switch[1:])))
        if self.draft_gate is not None:
            self._gate_kind = kind
            if self._gate_todo and not self.scheduler.has_unfinished():
                self._gate_chores()  # idle: nothing left to overlap them with
        return outputs

    def _gate_chores(self) -> None:
        """A dynamic engine's bookkeeping of its past steps (the gate's step times, switches and accepted drafts;
        the step-time curve; the survival calibration), then the gate's estimate at the rows running now
        (DraftGate.prepare). Done while the device runs a step, before the collection waits for it: between steps,
        with the device idle, this host work made a dynamic engine's drafting steps 1.1% longer than a fixed one's
        (H200, padded demo, one request; a second fixed engine within 0.2%). The next choice then sees the steps
        before the one in flight."""
        todo, self._gate_todo = self._gate_todo, []
        for record, args in todo:
            record(*args)
        if self.draft_gate is not None and self.scheduler.running:
            self.draft_gate.prepare(len(self.scheduler.running))

    @torch.no_grad()
    def sync(self) -> list:
        """Collect the step in flight (overlap scheduling) without launching another; returns its outputs."""
        touched: dict = {}
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._collect_step(prev, touched)
        return self._collect(touched)

    def _launch(self, touched: dict, prev=None):
        if self.drafter is not None:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        t0 = time.perf_counter()
        batch.future = self.future
        self.block_tables.sync(batch.seqs)  # only the blocks appended since the last step
        if self.swa_pool is not None:
            for seq in batch.seqs:
                if seq.swa_restore is not None:
                    self.swa_pool.restore(seq)  # in stream order before the forward that reads it
        sample_seqs = [s for s, smp in zip(batch.seqs, batch.samples) if smp]
        stages, k = self.stages["step"][:self._n_device_stages], self._n_before_known
        try:
            sampling = self.sampling_state.batch(sample_seqs)  # gathered from the slots on the device
            state = StepState(batch, sampling, self.kv_cache)
            failed = self._run_stages(stages[:k], state)
            if prev is not None and k < len(stages) and any(s.pending and s.params.structured_outputs is not None
                                                            for s in sample_seqs):
                # A constrain stage needs the tokens of the step in flight: collect it now that this step's
                # forward is queued, so its grammar masks are filled while the device runs the forward.
                t1 = time.perf_counter()
                self._collect_step(prev, touched)
                t0 += time.perf_counter() - t1
            for i, msg in self._run_stages(stages[k:], state).items():
                failed.setdefault(i, msg)
            spec = None
            if batch.drafts is not None:  # accepted on the device now, read at the step's one collection
                want = max((s.params.logprobs for s, d in zip(batch.seqs, batch.drafts) if d
                            and s.params.logprobs is not None), default=-1)
                with self.kernel_mode():
                    spec = launch_acceptance(state, self.sampling_state, self.ops, self.generator, want)
        except Exception as exc:  # untraceable: a failing step fails its batch, not the engine
            self._fail_batch(batch, exc, touched)
            return None
        self._fail_rows(batch, failed, touched)  # traced to rows: those requests fail alone, the step goes on
        self.sampling_state.record(state.next_tokens)  # penalty counts grow on the device
        self.scheduler.update(batch)
        if self.prefix_cache is not None:  # the blocks this step filled are findable once it is queued
            for seq in batch.seqs:
                if seq.cache_root is not None and not seq.finished:
                    self.prefix_cache.commit(seq, seq.num_computed_tokens)
            if self.swa_pool is not None:
                for seq, n in zip(batch.seqs, batch.num_tokens):
                    if seq.swa_restore is not None:
                        seq.swa_restore = None
                    elif seq.cache_root is not None and not seq.finished:
                        self.swa_pool.after_step(seq, n)
        end_step = getattr(self.model, "end_step", None)
        if end_step is not None:
            end_step()  # e.g. close the step's expert-load record (no host sync)
        launched = _Launched(state, sample_seqs)
        launched.spec = spec
        if self.drafter is not None:  # this step's kept hidden states: a later launch replaces the model's
            launched.captured_hidden = getattr(self.model, "captured_hidden", None)
        S = len(sample_seqs)
        if S:
            # Publish the tokens: on the device for the next step's inputs, and copied to the host without
            # blocking (collected later).
            half = self._parity * self.max_rows
            self.future[half:half + S].copy_(state.next_tokens)
            launched.host_tokens = to_host(state.next_tokens.long())  # (.long(): itself when int64 already)
            if state.bad_rows is not None:  # rows whose logits were not finite, read at collection
                launched.host_bad = to_host(state.bad_rows.bool())
            if self.device.type == "cuda":
                launched.event = torch.cuda.Event()
                launched.event.record()
            for r, seq in enumerate(sample_seqs):
                seq.pending.append(-1 - (half + r))
                p = seq.params
                if (p.max_tokens is not None and seq.num_output_tokens + len(seq.pending) >= p.max_tokens) \
                        or seq.num_tokens >= self.max_model_len:
                    seq.draining = True  # its last token is in flight: never schedule it again
            self._parity ^= 1
        self.stats["steps"] += 1
        self.stats["forward_tokens"] += batch.total_tokens
        self.stats["step_time"] += time.perf_counter() - t0
        return launched

    def _collect_step(self, launched, touched: dict) -> None:
        """Wait for a launched step's tokens, run the host stages, fold the results into the sequences."""
        state, sample_seqs = launched.state, launched.sample_seqs
        launched.collected = True
        t0 = time.perf_counter()
        try:
            if self._gate_todo:
                self._gate_chores()  # while the device runs the step (dynamic speculation)
            if launched.event is not None:
                launched.event.synchronize()  # this step only; the one launched after it keeps running
            if launched.host_tokens is not None:
                state.next_tokens = launched.host_tokens
            if launched.spec is not None:
                self._accept_drafts(state, launched.spec)
            if getattr(self.model, "capture_last", 0) and self.drafter is not None:
                self._keep_draft_context(state, sample_seqs, launched.captured_hidden)
            if hasattr(self.drafter, "observe"):
                self._show_hidden(state)
            failed = self._run_stages(self.stages["step"][self._n_device_stages:], state)
        except Exception as exc:
            for seq in sample_seqs:
                if seq.pending:
                    seq.pending.pop(0)
            self._fail_batch(state.batch, exc, touched)
            return
        if launched.host_bad is not None:
            rows = state.sample_rows
            for r in launched.host_bad.nonzero().flatten().tolist():
                failed.setdefault(rows[r], "the model produced non-finite logits (NaN or inf) for this request")
        self._fail_rows(state.batch, failed, touched)
        self._fold(state, sample_seqs, touched)
        extra = getattr(state, "spec_extra", None)
        if extra:
            self._fold_extra(extra, getattr(state, "spec_logprobs", {}), sample_seqs, touched)
        if self.prefix_cache is not None and self.prefix_cache.mover is not None:
            # The disk tier's copies of the blocks committed since the last collection: at the launches (this
            # step's, and the next one's under overlap scheduling) and by sequences that just finished.
            self.prefix_cache.write_through()
            # Blocks evicted to the host/disk tiers whose copies have run, and those written through to the disk;
            # everything once the engine is idle (a finished generate leaves its blocks on disk).
            self.prefix_cache.flush(wait=not self.scheduler.has_unfinished())
        self.stats["step_time"] += time.perf_counter() - t0

    def _run_stages(self, stages: list, state: StepState) -> dict:
        """Run stages in order; returns {batch row: message} of the rows a stage traced a fault to (RowError),
        and of rows whose logits are not finite (checked on the device after each stage that writes them)."""
        failed: dict = {}
        device = not all(getattr(st, "host", False) for st in stages)  # host stages (detokenize) need no kernels
        with self.kernel_mode() if device else contextlib.nullcontext():
            for stage in stages:
                state.logits_kept = False
                try:
                    stage(state)
                except RowError as exc:
                    for i in exc.rows:
                        failed.setdefault(i, f"stage {stage.name!r} failed for this request: {exc.messages.get(i, exc)}")
                # (a writer that left the logits as they were this step says so: they were guarded after their
                # producer, and even the guard's one launch counts at batch 1)
                if "logits" in stage.writes and not state.logits_kept:
                    _guard_logits(state, self.ops)
        return failed

    def _fail_batch(self, batch, exc: Exception, touched: dict) -> None:
        log.exception("deepinfer: a step failed; failing its %d request(s)", len(batch.seqs))
        msg = f"step failed: {type(exc).__name__}: {exc}"
        self._fail_rows(batch, dict.fromkeys(range(len(batch.seqs)), msg), touched, quiet=True)

    def _fail_rows(self, batch, failed: dict, touched: dict, quiet: bool = False) -> None:
        for i, msg in failed.items():
            req = self.requests.get(batch.seqs[i].request_id)
            if req is not None and not req.reported_done:  # not already failed and reported by an earlier step
                self._fail_request(req, msg, touched, quiet)

    def _fail_request(self, req: Request, message: str, touched: dict, quiet: bool = False) -> None:
        """End every sequence of a request with an error; its blocks go back now."""
        if req.error is None:
            req.error = message
            if not quiet:
                log.warning("deepinfer: request %s failed: %s", req.request_id, message)
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s)
                s.finish_reason = "error"
        touched[req.request_id] = req

    def _collect(self, touched: dict) -> list:
        outs = []
        for req in touched.values():
            if not (req.finished or req.stream):
                continue  # building outputs costs per-sequence Python; only streams need partial ones
            outs.append(request_output(req))
            if req.finished:
                req.reported_done = True
            if req.reported_done:
                self.requests.pop(req.request_id, None)
                for stage in self._admit_hooks:
                    stage.release_request(req.request_id)
        return outs

    def _fold(self, state: StepState, sample_seqs: list, touched: dict) -> None:
        for seq_id, (start, entries) in (state.prompt_logprobs or {}).items():
            seq = next(s for s in state.batch.seqs if s.seq_id == seq_id)
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            if start > len(seq.prompt_logprobs):
                raise RuntimeError(f"prompt logprobs of sequence {seq_id} would skip positions "
                                   f"{len(seq.prompt_logprobs)}..{start - 1}")
            seq.prompt_logprobs[start:] = entries
        lp_rows, spec_logprobs = None, getattr(state, "spec_logprobs", {})
        if state.logprobs is not None:
            want = [s.params.logprobs or 0 for s in sample_seqs]
            lp_rows = entries_from(state.logprobs, range(len(sample_seqs)), want, None)
        now = time.perf_counter()
        for r, (seq, upd) in enumerate(zip(sample_seqs, state.outputs)):
            seq.pending.pop(0)  # this step's reference: the oldest pending one
            if seq.finished:
                continue  # finished (stop, abort, error) while this step was in flight: its token is dropped
            req = self.requests[seq.request_id]
            req.first_token_time = req.first_token_time or now
            spec_lp = spec_logprobs.get(r)
            if spec_lp is not None:  # a verified row: its first token's logprobs are at its first position
                self._append_logprobs(seq, upd.token_id, *spec_lp[0])
            elif seq.params.logprobs is not None and lp_rows is not None:
                dicts, tok_lp, ranks = lp_rows
                self._append_logprobs(seq, upd.token_id, dicts[r], tok_lp[r], ranks[r])
            self._fold_token(seq, upd)
            touched[seq.request_id] = req
            if seq.params.jump_forward and not seq.finished and not seq.pending:
                self._jump_forward(seq, touched)

    def _append_logprobs(self, seq, token_id: int, top: dict, token_logprob: float, rank: int) -> None:
        """One generated position's logprobs entry: the top-n dict plus the chosen token, with their texts."""
        d = dict(top)
        d[token_id] = Logprob(token_logprob, rank, None)
        if self.tokenizer is not None:
            from ..detokenizer import decode_token

            d = {t: Logprob(l.logprob, l.rank, decode_token(self.tokenizer, t)) for t, l in d.items()}
        seq.logprobs = (seq.logprobs or []) + [d]

    def _fold_token(self, seq, upd) -> None:
        """Append one token (sampled, or forced by a grammar) with its text and finish reason."""
        seq.token_ids.append(upd.token_id)
        seq.text = upd.text
        reason, stop_reason = upd.finish_reason, upd.stop_reason
        if reason is None and len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            if self.prefix_cache is not None and seq.cache_root is not None:
                # The blocks its last steps filled: launch-time commits miss those whose tokens were still
                # pending then (overlap scheduling), and no later launch comes for a finished sequence.
                self.prefix_cache.commit(seq, seq.num_computed_tokens)
            self.scheduler.finish(seq)

    def _jump_forward(self, seq, touched: dict) -> None:
        """Structured outputs' jump-forward: append the tokens the grammar forces without a model step. Each goes
        through the host stages (text, stop checks) as a sampled token does; the next step computes their KV."""
        for stage in self._jumpers:
            for tok in stage.jump_forward(seq):
                if not self._fold_forced(seq, tok, touched) or seq.finished:
                    return

    def _fold_forced(self, seq, tok: int, touched: dict) -> bool:
        """Append a token that no sampler drew this step (jump-forward, an accepted draft) through the host
        stages; False when they failed the request."""
        batch = ScheduledBatch([seq], [0], [seq.num_computed_tokens], [True])
        state = StepState(batch, None, self.kv_cache)
        state.next_tokens = torch.tensor([tok])
        failed = self._run_stages(self.stages["step"][self._n_device_stages:], state)
        if failed:
            self._fail_rows(batch, failed, touched)
            return False
        self._fold_token(seq, state.outputs[0])
        return True

    # Speculative decoding (core/speculative.py).
    def _fold_extra(self, extra: dict, spec_logprobs: dict, sample_seqs: list, touched: dict) -> None:
        """Fold the verified rows' further tokens (extra: sampling row -> its accepted tokens after the first)
        through the host stages, one call for the j-th further token of every row still going (a row's tokens in
        order; a row stops at its first that finishes it or that a host stage fails). ``_fold_forced`` per token
        is the oracle; the host stages work row by row, so one call over many rows gives each the same."""
        live = [(sample_seqs[r], tokens, spec_logprobs.get(r)) for r, tokens in extra.items() if tokens]
        j = 1
        while live:
            live = [x for x in live if not x[0].finished]
            if not live:
                return
            seqs = [seq for seq, _, _ in live]
            toks = [tokens[j - 1] for _, tokens, _ in live]
            for (seq, _, lps), tok in zip(live, toks):
                if lps is not None:
                    self._append_logprobs(seq, tok, *lps[j])
            batch = ScheduledBatch(seqs, [0] * len(seqs), [s.num_computed_tokens for s in seqs], [True] * len(seqs))
            state = StepState(batch, None, self.kv_cache)
            state.next_tokens = torch.tensor(toks)
            failed = self._run_stages(self.stages["step"][self._n_device_stages:], state)
            if failed:
                self._fail_rows(batch, failed, touched)
            for n, (seq, upd) in enumerate(zip(seqs, state.outputs)):
                if n not in failed:
                    self._fold_token(seq, upd)
            live = [x for n, x in enumerate(live) if n not in failed and len(x[1]) > j]
            j += 1

    def _drafting(self) -> bool:
        """Whether this step runs the drafter: the gate's choice (core/draft_gate.py; always, without one), and
        whatever it says when a seeded request runs (it drafts every step: its output never depends on timing).
        Sets ``_drafter_ran`` to the gate's choice."""
        gate, running = self.draft_gate, self.scheduler.running
        self._drafter_ran = gate.open(len(running)) if gate is not None and running else True
        self._drafts_asked = self._drafter_ran or any(s.generator is not None for s in running)
        return self._drafts_asked

    def _propose_drafts(self) -> None:
        """Ask the drafter for the next step's drafts of every decoding sequence that may speculate (of the
        seeded ones only where the gate chose plain decoding: ``_drafting``)."""
        if not self._drafts_asked:  # a plain step: no per-sequence checks (a dynamic engine's common step at
            for seq in self.scheduler.running:  # high concurrency, as cheap as a plain engine's)
                if seq.draft:
                    seq.draft = []
            return
        k, vocab = self.spec.num_speculative_tokens, self.model.vocab_size
        drafting = self._drafter_ran
        asked = []  # (sequence, drafts it may take)
        for seq in self.scheduler.running:
            seq.draft = []
            # (Not on a prompt's last chunk: that it is one token depends on the step's budget and the batch, and a
            # seeded request's first token must not: drafting draws its randomness differently.)
            if seq.status is not SeqStatus.RUNNING or seq.draining or seq.pending \
                    or seq.num_tokens - seq.num_computed_tokens != 1 \
                    or seq.num_computed_tokens < seq.num_prompt_tokens or not can_speculate(seq.params):
                continue
            if not drafting and seq.generator is None:  # (a seeded request drafts whatever the gate says)
                continue
            room = min(k, self.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                asked.append((seq, room))
        batch = getattr(self.drafter, "propose_batch", None)  # one call for the step (stages/mtp_draft.py)
        try:
            drafts = batch([s for s, _ in asked], [r for _, r in asked]) if batch is not None and asked \
                else [self.drafter.propose(s, r) for s, r in asked]
        except Exception:  # drafts only save steps: a failing drafter costs this step its drafts, not its requests
            if "draft failed" not in self.warned:
                self.warned.add("draft failed")
                log.exception("deepinfer: draft stage %r failed; steps it fails in decode without drafts",
                              self.spec.method)
            drafts = []
        for (seq, room), draft in zip(asked, drafts):
            try:
                draft = list(draft)[:room]
            except TypeError:  # not a list of tokens (None, ...)
                draft = [draft]
            if not all(isinstance(t, int) and 0 <= t < vocab for t in draft):
                if "bad draft" not in self.warned:
                    self.warned.add("bad draft")
                    log.warning("deepinfer: draft stage %r proposed something other than token ids in 0..%d "
                                "(e.g. %r); ignored", self.spec.method, vocab - 1, draft[:8])
                continue
            seq.draft = draft
        # Dynamic: one drafting step in CALIBRATE_EVERY verifies every draft and feeds the survival calibration
        # (an unbiased sample: the rows a length choice keeps are the drafter's best); not every step: the
        # per-row bookkeeping took ~0.1 ms a step at 16 rows (CPU profile), of the order of 1% of a synchronous
        # speculative step on the H200.
        self._calibrate = False
        if self.spec.dynamic:
            self._length_steps += 1
            self._calibrate = self._length_steps % CALIBRATE_EVERY == 0
        # Dynamic, the other steps: per request, the drafts worth verifying this step (core/speculative.py). Not
        # where the step verifies in a padded CUDA graph: every row's drafts cost nothing more there, and the gate
        # (core/draft_gate.py) already chose drafting over a plain step from measured step times.
        if self.spec.dynamic and not self._calibrate and not self._padded_verify_width():
            # A seeded request verifies every draft it has: lengths chosen by measured step times would make what
            # its generator draws, and so its output, change from run to run.
            rows = [s for s in self.scheduler.running if s.draft and s.generator is None]
            survival = [list(getattr(s, "draft_survival", None) or [])[:len(s.draft)] for s in rows]
            if self.survival_cal is not None:
                survival = [self.survival_cal.apply(sv) for sv in survival]
            fixed = [s for s in self.scheduler.running if s.draft and s.generator is not None]
            others = sum(1 for s in self.scheduler.running if not s.draft) + len(fixed)
            R = len(self.scheduler.running)  # T's rows term: the step's rows whatever their drafts
            fixed_tokens = others + sum(len(s.draft) for s in fixed)
            ks = choose_lengths(survival, lambda n: self.step_time(n + fixed_tokens, R))
            for s, k in zip(rows, ks):
                del s.draft[k:]

    def _padded_verify_width(self) -> int:
        """Q when this step's verification would run in a CUDA graph padding every row to Q tokens (its cost then
        does not depend on the rows' draft lengths), else 0 (eager, ragged)."""
        g, running = self.decode_graphs, self.scheduler.running
        if g is None or not g.verify_width or not running \
                or any(s.num_tokens - s.num_computed_tokens != 1 for s in running):  # a prefill chunk: eager
            return 0
        Q = g.verify_width
        return Q if g.covers_verify([Q] * len(running), [s.num_computed_tokens for s in running]) else 0

    def _step_tokens(self, launched, verify_replays: int) -> int:
        """The tokens a step computed for T(n): a verify graph's padded rows x width, else the batch's tokens."""
        g = self.decode_graphs
        if g is not None and g.num_verify_replays > verify_replays:
            return len(launched.sample_seqs) * g.verify_width
        return launched.state.batch.total_tokens

    def _keep_draft_context(self, state: StepState, sample_seqs: list, captured) -> None:
        """Each sampling row's target hidden states at the position that produced its last token (the last
        accepted one for a verified row), for a drafter that conditions on them."""
        index = state.inputs.sample_index
        if captured is None:
            return
        back = getattr(state, "spec_rollback", {})
        for r, seq in enumerate(sample_seqs):
            seq.draft_context = HiddenRow(captured, index[r] - back.get(r, 0))

    def _show_hidden(self, state: StepState) -> None:
        """Every row's target hidden states at the positions this step computed and kept (a verified row's
        accepted ones), for a drafter that reads them all (stages/mtp_draft.py)."""
        batch, back = state.batch, getattr(state, "spec_rollback", {})
        rolled = {i: back.get(r, 0) for r, i in enumerate(state.sample_rows)}
        for i, seq in enumerate(batch.seqs):
            a, b = state.inputs.row_span(i)
            self.drafter.observe(seq, batch.start[i], state.hidden[a:b - rolled.get(i, 0)])

    def _accept_drafts(self, state: StepState, spec) -> None:
        """Fold what the device decided per drafting row (core/spec_step.py): how many drafts stood, the tokens
        after the first (the first is already the row's next token), logprobs, and the rollback of the rest."""
        batch = state.batch
        state.spec_extra, state.spec_logprobs, state.spec_rollback = {}, {}, {}
        lp = None
        if spec.logprobs is not None:
            from ..backends.reference.sampling import LogprobsTensors

            lp = LogprobsTensors(*spec.logprobs)
        drafted, accepts = [], []
        for n, ((r, i), (accepted, emitted)) in enumerate(zip(spec.rows, spec.all_rows())):
            k, seq = len(batch.drafts[i]), batch.seqs[i]
            state.spec_rollback[r] = k - accepted
            want = seq.params.logprobs
            if want is not None and lp is not None:  # each emitted token's logprobs at its own position
                at = [n * (spec.K + 1) + j for j in range(len(emitted))]
                tops, tok_lp, ranks = entries_from(lp, at, [want] * len(at), None)
                state.spec_logprobs[r] = list(zip(tops, [tok_lp[x] for x in at], [ranks[x] for x in at]))
            drafted.append(k)
            accepts.append(accepted)
            if k and self._calibrate and self.survival_cal is not None and getattr(seq, "draft_survival", None):
                self._gate_todo.append((self.survival_cal.record, (list(seq.draft_survival)[:k], accepted)))
            if k:
                if seq.spec_stats is None:
                    seq.spec_stats = SpecStats()
                seq.spec_stats.record(k, accepted)
            seq.num_computed_tokens -= k - accepted  # the rejected drafts' KV is overwritten later
            if accepted:
                state.spec_extra[r] = emitted[1:]
        self.spec_stats.record_many(drafted, accepts)
        if self.draft_gate is not None:  # accepted drafts per row of the step, verified or not (the gate's g)
            self._gate_todo.append((self.draft_gate.record_accepted, (len(state.sample_rows), sum(accepts))))
