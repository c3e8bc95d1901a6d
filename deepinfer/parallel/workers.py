"""Parallel serving's processes: the driver (rank 0, the user's process) and the workers (ranks 1..W-1).

The design: rank 0 runs the whole engine unchanged (scheduler, every stage, sampling, detokenization). Its
model is a ``DriverModel``: each call the engine makes on the model (allocate the KV cache, the forward, the
logits) first sends the workers a step message over the control group (a fixed-size int64 header, then one
int64 payload of the step's token ids and attention metadata on the compute group), then runs rank 0's own
shard. Every worker runs the same call on its shard, so their collectives pair up. Logits are gathered on rank
0 (vocabulary-parallel LM head) or computed there alone (a replicated head). The scheduler, sampler and
stages never see a rank: no stage changes, one place that knows about workers. With data-parallel attention
(``data_parallel_size`` > 1) every rank takes the batch rows it owns from the same message (``dp_rows``: a
sequence's rank is its state slot mod D), and rank 0 gathers the hidden states back (``dp_forward``).

Start-up (``start_parallel``): rank 0 builds its shard on the meta device first (a layout that does not divide
fails there, before any process starts), spawns W-1 workers (torch.multiprocessing, spawn) or, under torchrun,
finds the other ranks already running the same script; every rank meets at a TCPStore, joins the process
group, loads only its slices of the safetensors, and reports its status in the store; rank 0 waits for them
while watching the worker processes, so a worker that fails at start-up is reported with its error, not a hang.

Faults: a collective that fails (a peer died: gloo raises at once; NCCL after ``distributed_timeout_s``) or a
worker process found dead before a step marks the group broken: the step's requests fail with a
``DistributedError`` naming the rank and its exit code, the remaining workers are stopped, and every later
step fails at once with the same message.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..layout import _HOST_ROWS as HOST_ROWS  # AttnMetadata's per-row host lists, which CED reads
from .dist import Comm, DistributedError, ParallelConfig, init_world, leave_world, rank_device, torchrun_env
from .expert_moves import apply_on_rank, attach_rank_slots, gather_slots

log = logging.getLogger(__name__)

HEADER = 80  # int64 words of a step message's header
STARTUP_TIMEOUT_S = 600.0  # start-up (imports, loading) may take longer than a collective may wait
FORWARD, LOGITS, ALLOC, RESERVE, STOP = 1, 2, 3, 4, 5
EPLB, SLOTS, SETPARAM = 6, 7, 8  # adopt a placement (move experts); gather a block's slots; set a parameter
# The attention metadata fields a forward needs (layout.AttnMetadata), then the token ids.
META_TENSORS = ("positions", "slot_mapping", "seq_lens", "q_index", "q_valid", "kv_slots", "q_pos", "block_table",
                "cu_q", "state_rows", "replay_rows", "swa_cut_rows")
INT_DTYPES = (torch.int64, torch.int32, torch.bool)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@attrs.frozen
class WorkerSpec:
    """What a worker needs to build its shard (plain values: spawn pickles it)."""

    model_path: str
    hf_config: dict
    dtype: str  # torch dtype name
    load_format: str
    backend: str
    device_type: str
    parallel: ParallelConfig
    ep_comm: str
    store_host: str
    store_port: int
    agent_store: bool  # torchrun's agent hosts the store
    threads: Optional[int]
    eplb_slots: int = 0  # EPLB: physical expert slots per MoE layer over all ranks (0: off)


# ------------------------------------------------------------------------------------------ building a shard


def build_shard(spec: WorkerSpec, comm: Comm, ops, registry):
    """This rank's shard of the model on the meta device: the Llama family tensor-parallel (MoE members: attention
    tensor-parallel, experts expert-parallel), DeepSeek-V2/V3 with replicated MLA and CED with replicated
    attention, both with expert-parallel experts. Returns (model, keep, plan, vocab_parallel)."""
    from ..models import loader
    from ..models.ced.model import CEDForCausalLM
    from ..models.llama import LlamaForCausalLM
    from .ced_parallel import shard_ced
    from .expert_parallel import expert_plan, shard_experts
    from .tp_layers import llama_plan, shard_llama

    pc = spec.parallel
    W = pc.world_size
    path = loader.Path(spec.model_path)
    arch = loader.architecture(path, spec.hf_config, registry.names("model"))
    with torch.device("meta"):
        model = registry.get("model", arch).obj(spec.hf_config, ops)
    model = model.to(getattr(torch, spec.dtype))
    dp = pc.data_parallel_size > 1
    if isinstance(model, CEDForCausalLM):  # every layer MoE: experts expert-parallel, the rest replicated
        if not pc.enable_expert_parallel:
            raise ValueError(f"{arch} is a mixture-of-experts model in every layer: {W} ranks need "
                             "enable_expert_parallel=True (attention replicated, experts sharded over the ranks)")
        keep, plan = shard_ced(model, comm, ops, spec.ep_comm, tokens_local=dp)
        return model, keep, plan, False
    moe = [m for m in model.modules() if type(m).__name__ == "MoEBlock"]
    if moe and not pc.enable_expert_parallel:
        raise ValueError(f"{arch} is a mixture-of-experts model: tensor_parallel_size={pc.tensor_parallel_size} "
                         "needs enable_expert_parallel=True (experts sharded over the ranks; tensor-parallel "
                         "experts are not implemented)")
    keep_e, plan_e, moe_prefixes = (lambda n: True), (lambda n: None), ()
    if moe:
        blocks, _ = shard_experts(model, comm, spec.ep_comm, tokens_local=dp)
        keep_e, plan_e, moe_prefixes = expert_plan(blocks)
    if dp:  # data-parallel attention: everything but the experts replicated, each rank on its own rows
        plan_t, vocab_parallel = (lambda n: None), False
    elif isinstance(model, LlamaForCausalLM):
        plan_t = llama_plan(shard_llama(model, comm, W, comm.rank), moe_prefixes)
        vocab_parallel = True
    elif moe:  # DeepSeek: MLA, dense MLPs, embedding and head replicated
        plan_t, vocab_parallel = (lambda n: None), False
    else:
        raise ValueError(f"{arch} has no tensor-parallel implementation: parallel serving covers the Llama family "
                         "(Llama, Mistral, Qwen2, Qwen3 and their MoE members), and DeepSeek-V2/V3 and CED with "
                         "enable_expert_parallel=True")
    model.supports_cuda_graphs = False

    def plan(name):
        return plan_e(name) or plan_t(name)

    return model, keep_e, plan, vocab_parallel


def load_shard(model, spec: WorkerSpec, device, keep, plan) -> None:
    from ..models import loader
    from .tp_layers import iter_shard

    model.to_empty(device=device)
    if spec.load_format == "dummy":
        loader.dummy_init_(model)
    else:
        model.load_weights(iter_shard(loader.Path(spec.model_path), keep, plan))
    if hasattr(model, "after_load"):
        model.after_load()
    model.requires_grad_(False)
    model.eval()


# ------------------------------------------------------------------------------------------ step messages


def _header(*words) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.long)
    h[:len(words)] = torch.tensor(words, dtype=torch.long)
    return h


def pack_forward(ids, meta, host_rows: bool = False) -> tuple:
    """(header, payload): the token ids and the metadata tensors as one int64 payload, their shapes in the header;
    ``host_rows``: the per-row host lists too (a model that reads them: CED), their length in the header's last
    word."""
    words = [FORWARD, meta.block_size, meta.max_q, meta.num_decodes]
    parts = []
    for t in (ids, *(getattr(meta, f) for f in META_TENSORS)):
        if t is None:
            words += [0, 0, 0, 0, 0]
            continue
        if t.dim() > 2:
            raise ValueError(f"parallel forward: metadata tensor of {t.dim()} dims")
        shape = list(t.shape) + [1] * (2 - t.dim())
        words += [1, INT_DTYPES.index(t.dtype), t.dim(), *shape]
        parts.append(t.reshape(-1).long())
    rows = pack_host_rows(meta) if host_rows else []
    parts.append(torch.tensor(rows, dtype=torch.long, device=ids.device))
    return _header(*words, *[0] * (HEADER - 1 - len(words)), len(rows)), torch.cat(parts)


def pack_host_rows(meta) -> list:
    """The metadata's per-row host lists (layout._HOST_ROWS) as ints: per list its length and values; a block
    table list also each table's length; replay starts also each one's score_end (-1: a plain int)."""
    out = []
    for name in HOST_ROWS:
        lst = list(getattr(meta, name) or [])
        out.append(len(lst))
        if name == "block_tables":
            out += [len(t) for t in lst]
            out += [int(b) for t in lst for b in t]
        else:
            out += [int(v) for v in lst]
        if name == "replay_starts":
            out += [getattr(v, "score_end", -1) for v in lst]
    return out


def unpack_host_rows(words: list) -> dict:
    from ..models.ced.model import ReplayStart

    out, i = {}, 0

    def take(n):
        nonlocal i
        i += n
        return words[i - n:i]

    for name in HOST_ROWS:
        (n,) = take(1)
        if name == "block_tables":
            lens = take(n)
            out[name] = [take(k) for k in lens]
        else:
            out[name] = take(n)
        if name == "replay_starts":
            out[name] = [v if e < 0 else ReplayStart(v, e) for v, e in zip(out[name], take(n))]
        elif name == "enc_restored":
            out[name] = [bool(v) for v in out[name]]
    return out


def unpack_forward(header: list, payload: torch.Tensor) -> tuple:
    from ..layout import AttnMetadata

    block_size, max_q, num_decodes = header[1:4]
    tensors, off, w = [], 0, 4
    for _ in range(1 + len(META_TENSORS)):
        present, code, ndim, d0, d1 = header[w:w + 5]
        w += 5
        if not present:
            tensors.append(None)
            continue
        n = d0 * d1
        t = payload[off:off + n].to(INT_DTYPES[code]).view([d0, d1][:ndim])
        off += n
        tensors.append(t)
    ids, rest = tensors[0], tensors[1:]
    rows = unpack_host_rows(payload[off:].tolist()) if header[-1] else {}
    meta = AttnMetadata(**dict(zip(META_TENSORS, rest)), block_size=block_size, max_q=max_q, num_decodes=num_decodes,
                        **rows)
    return ids, meta


def payload_size(header: list) -> int:
    n, w = header[-1], 4  # the host rows' length, then the tensors'
    for _ in range(1 + len(META_TENSORS)):
        present, _, _, d0, d1 = header[w:w + 5]
        n += present * d0 * d1
        w += 5
    return n


def dp_rows(meta, rank: int, D: int, blocks_per_rank: int = 0) -> tuple:
    """Data-parallel attention: (token ids' rows, AttnMetadata) of the batch rows this rank owns (each sequence
    stays on rank ``state slot mod D`` for its life, so its KV is only ever written there), and every rank's token
    rows (so rank 0 can put the hidden states back in batch order). Rows keep their order. ``blocks_per_rank``:
    the rank's cache holds only its partition of the block ids (core/rank_pools.py), so its rows' block ids and
    slots are made local (minus ``rank x blocks_per_rank`` blocks; padding stays 0)."""
    from ..layout import AttnMetadata

    owner = (meta.state_rows % D).tolist()  # [B]
    cu = meta.cu_q.tolist()  # [B + 1]
    toks = [[t for b, o in enumerate(owner) if o == r for t in range(cu[b], cu[b + 1])] for r in range(D)]
    rows = [b for b, o in enumerate(owner) if o == rank]
    dev = meta.positions.device
    tok = torch.tensor(toks[rank], dtype=torch.long, device=dev)
    r_t = torch.tensor(rows, dtype=torch.long, device=dev)
    counts = torch.tensor([cu[b + 1] - cu[b] for b in rows], dtype=torch.long, device=dev)
    new_cu = torch.zeros(len(rows) + 1, dtype=torch.long, device=dev)
    new_cu[1:] = counts.cumsum(0)
    q_valid = meta.q_valid[r_t]
    q_index = (meta.q_index[r_t] - meta.cu_q[r_t].long()[:, None] + new_cu[:-1, None]).masked_fill(~q_valid, 0)
    pick = (lambda t: None if t is None else t[r_t])
    base = rank * blocks_per_rank  # the first block id of this rank's partition

    def local(t, unit: int):
        return t if t is None or not base else torch.where(t >= base * unit, t - base * unit, torch.where(t < 0, t, 0))

    state_rows = pick(meta.state_rows)
    sub = AttnMetadata(positions=meta.positions[tok], slot_mapping=local(meta.slot_mapping[tok], meta.block_size),
                       seq_lens=meta.seq_lens[r_t], q_index=q_index, q_valid=q_valid,
                       kv_slots=local(meta.kv_slots[r_t], meta.block_size), q_pos=meta.q_pos[r_t],
                       block_table=local(pick(meta.block_table), 1), block_size=meta.block_size,
                       cu_q=new_cu.to(torch.int32),
                       max_q=meta.max_q, num_decodes=sum(1 for b in rows if b < meta.num_decodes),
                       state_rows=None if state_rows is None else state_rows // D, replay_rows=pick(meta.replay_rows),
                       swa_cut_rows=pick(meta.swa_cut_rows), **_own_host_rows(meta, rows, D, base))
    if any(getattr(s, "score_end", 0) > a for s, a in zip(meta.replay_starts, meta.starts)):
        sub.cache["score_pass"] = True  # some rank's row scores its prompt: every rank runs that pass (CED)
    return tok, sub, toks


def _own_host_rows(meta, rows: list, D: int, base: int) -> dict:
    """The host lists of this rank's rows, in its own numbering: state slot // D (each rank's per-sequence
    state holds only its sequences), block ids minus its partition's first."""
    out = {}
    for name in HOST_ROWS:
        lst = getattr(meta, name)
        if not lst:
            continue
        mine = [lst[b] for b in rows]
        if name == "state_slots":
            mine = [s // D for s in mine]
        elif name == "block_tables":
            mine = [[b - base for b in t] for t in mine]
        out[name] = mine
    return out


def dp_forward(model, comm: Comm, ids, meta, kv, D: int, blocks_per_rank: int = 0):
    """Every rank's forward over its own rows (its own KV partition); rank 0 gets every token's hidden state back
    in batch order."""
    tok, sub, toks = dp_rows(meta, comm.rank, D, blocks_per_rank)
    h = model(ids[tok], sub, kv)  # [T_r, d]
    parts = comm.gather_rows(h, [len(t) for t in toks])
    if comm.rank != 0:
        return None
    out = h.new_empty(ids.shape[0], h.shape[1])
    order = torch.tensor([t for r in toks for t in r], dtype=torch.long, device=h.device)
    out[order] = parts
    return out


# ------------------------------------------------------------------------------------------ the worker


def _rendezvous(spec: WorkerSpec, rank: int):
    """The TCPStore every rank meets at (rank 0 hosts it unless torchrun's agent does)."""
    is_master = rank == 0 and not spec.agent_store
    return dist.TCPStore(spec.store_host, spec.store_port, spec.parallel.world_size, is_master=is_master,
                         timeout=timedelta(seconds=max(spec.parallel.timeout_s, STARTUP_TIMEOUT_S)),
                         wait_for_workers=False)


def _join(spec: WorkerSpec, rank: int, store, device) -> Comm:
    pc = spec.parallel
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("deepinfer/pg", store), rank=rank,
                            world_size=pc.world_size, timeout=timedelta(seconds=pc.timeout_s))
    return init_world(rank, pc.world_size, "", device, pc.timeout_s)


def worker_main(spec: WorkerSpec, rank: int, local_rank: Optional[int] = None) -> None:
    """A worker's life: meet, build and load its shard, report, then run the driver's step messages until STOP."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads or 1)
    store = _rendezvous(spec, rank)
    try:
        from ..core.llm import choose_backend
        from ..core.plugins import get_registry

        device = rank_device(spec.device_type, rank if local_rank is None else local_rank, spec.parallel.world_size)
        registry = get_registry()
        ops, _ = choose_backend(registry, spec.backend, str(device))
        store.set(f"joined/{rank}", "")
        comm = _join(spec, rank, store, device)
        model, keep, plan, vocab_parallel = build_shard(spec, comm, ops, registry)
        load_shard(model, spec, device, keep, plan)
        if spec.eplb_slots:
            attach_rank_slots(model, spec.eplb_slots, comm)
    except BaseException as exc:  # reported to rank 0, which names it
        store.set(f"status/{rank}", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    store.set(f"status/{rank}", "")
    store.wait(["go"])
    if store.get("go") != b"ok":
        os._exit(0)
    try:
        _serve(model, comm, ops, vocab_parallel, spec.parallel.data_parallel_size)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    leave_world()
    os._exit(0)


def _serve(model, comm: Comm, ops, vocab_parallel: bool, dp: int = 1) -> None:
    kv, kv_blocks = None, 0
    with torch.no_grad():
        while True:
            h = torch.empty(HEADER, dtype=torch.long)
            comm.broadcast(h, control=True)
            words = h.tolist()
            op = words[0]
            if op == STOP:
                return
            if op == FORWARD:
                payload = torch.empty(payload_size(words), dtype=torch.long, device=comm.device)
                comm.broadcast(payload)
                ids, meta = unpack_forward(words, payload)
                if dp > 1:
                    dp_forward(model, comm, ids, meta, kv, dp, kv_blocks)
                else:
                    model(ids, meta, kv)
            elif op == LOGITS:
                n, d, code = words[1:4]
                rows = torch.empty(n, d, dtype=FLOAT_DTYPES[code], device=comm.device)
                comm.broadcast(rows)
                comm.gather_cat(model.compute_logits(rows))
            elif op == ALLOC:
                num_slots, code, block_size, max_seqs = words[1:5]
                kv = None  # free the old cache first
                kv = model.allocate_kv_cache(num_slots, FLOAT_DTYPES[code], comm.device, block_size=block_size,
                                             max_seqs=max_seqs)
                kv_blocks = num_slots // block_size
            elif op == RESERVE:
                model.reserve_positions(words[1])
            elif op == EPLB:
                L, P = words[1:3]
                phy2log = torch.empty(L * P, dtype=torch.long, device=comm.device)
                comm.broadcast(phy2log)
                apply_on_rank(model, phy2log.view(L, P).cpu())
            elif op == SLOTS:
                gather_slots(model.moe_blocks()[words[1]], comm)
            elif op == SETPARAM:
                n, code, ndim = words[1:4]
                name = torch.empty(n, dtype=torch.uint8)
                comm.broadcast(name, control=True)
                value = torch.empty(words[4:4 + ndim], dtype=FLOAT_DTYPES[code], device=comm.device)
                comm.broadcast(value)
                set_parameter(model, bytes(name.tolist()).decode(), value)
            else:
                raise RuntimeError(f"worker rank {comm.rank}: unknown step message {op}")


# ------------------------------------------------------------------------------------------ the driver


class DriverRuntime:
    """Rank 0's side: the worker processes, the step messages, the broken state."""

    def __init__(self, comm: Comm, procs: list, store):
        self.comm, self.procs, self.store = comm, procs, store
        self.failed: Optional[str] = None
        self.closed = False

    def dead(self) -> list:
        return [(r, p.pid, p.exitcode) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]

    def check(self) -> None:
        if self.failed is not None:
            raise DistributedError(self.failed)
        if self.closed:
            raise DistributedError("the parallel engine was shut down (LLM.shutdown()); start a new LLM to serve again")
        dead = self.dead()
        if dead:
            self.fail(None)
            raise DistributedError(self.failed)

    def fail(self, exc: Optional[BaseException]) -> None:
        """Mark the group broken (naming dead workers, else the error) and stop what is left of it."""
        if self.failed is not None:
            return
        time.sleep(0.2)  # a worker whose socket just closed is about to be reaped: name it
        dead = self.dead()
        if dead:
            who = "; ".join(f"worker rank {r} (pid {pid}) exited with code {c}" for r, pid, c in dead)
            msg = f"distributed serving failed: {who}"
        else:
            msg = f"distributed serving failed: a collective failed ({type(exc).__name__}: {exc})"
        self.failed = msg + ". The engine's workers are shut down; start a new LLM to serve again"
        log.error("%s", self.failed)
        self._stop(graceful=False)

    def send(self, header: torch.Tensor) -> None:
        self.comm.broadcast(header, control=True)

    def shutdown(self) -> None:
        if self.closed:
            return
        self._stop(graceful=self.failed is None)

    def _stop(self, graceful: bool) -> None:
        self.closed = True
        if graceful:
            try:
                self.send(_header(STOP))
            except Exception:
                graceful = False
        for p in self.procs:  # a broken group's workers have nothing to finish: killed at once
            if graceful:
                p.join(5)
            if p.exitcode is None:
                p.kill()  # SIGKILL: also ends a stopped process, which a SIGTERM would not
                p.join(5)
        leave_world()


class DriverModel(nn.Module):
    """Rank 0's model: the local shard, behind calls that first tell the workers to make the same call."""

    def __init__(self, inner: nn.Module, runtime: DriverRuntime, vocab_parallel: bool, data_parallel: int = 1):
        super().__init__()
        self.inner = inner
        self.runtime, self.vocab_parallel, self.data_parallel = runtime, vocab_parallel, data_parallel
        self.supports_cuda_graphs = False
        self.eplb = None  # EPLB over the ranks (placement.Eplb with move_experts as its mover), when enabled
        self.kv_blocks = 0  # blocks each rank's cache holds (data-parallel attention: one partition of the pool)
        from ..models.ced.model import CEDEngineMixin

        self.host_rows = isinstance(inner, CEDEngineMixin)  # CED reads the metadata's per-row host lists too

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def _guarded(self, fn, *args):
        self.runtime.check()
        try:
            return fn(*args)
        except DistributedError:
            raise
        except Exception as exc:  # the ranks' collectives are out of step now: nothing can continue
            self.runtime.fail(exc)
            raise DistributedError(self.runtime.failed) from exc

    def forward(self, input_ids, meta, kv_cache):
        def run():
            header, payload = pack_forward(input_ids, meta, self.host_rows)
            self.runtime.send(header)
            self.runtime.comm.broadcast(payload.to(self.runtime.comm.device))
            if self.data_parallel > 1:
                return dp_forward(self.inner, self.runtime.comm, input_ids, meta, kv_cache, self.data_parallel,
                                  self.kv_blocks)
            return self.inner(input_ids, meta, kv_cache)

        return self._guarded(run)

    def compute_logits(self, hidden):
        if not self.vocab_parallel:
            return self.inner.compute_logits(hidden)

        def run():
            rows = hidden.contiguous()
            self.runtime.send(_header(LOGITS, rows.shape[0], rows.shape[1], FLOAT_DTYPES.index(rows.dtype)))
            self.runtime.comm.broadcast(rows)
            logits = self.runtime.comm.gather_cat(self.inner.compute_logits(rows))  # [N, W V']
            return logits[:, :self.inner.vocab_size]

        return self._guarded(run)

    def allocate_kv_cache(self, num_slots, dtype, device, block_size: int = 16, max_seqs: int = 1):
        max_seqs = -(-max_seqs // self.data_parallel)  # data-parallel attention: a rank's state slots (dp_rows)
        if torch.device(device).type != "meta":  # kv sizing measures the layout on meta: rank 0's alone
            self._guarded(self.runtime.send, _header(ALLOC, num_slots, FLOAT_DTYPES.index(dtype), block_size,
                                                     max_seqs))
            self.kv_blocks = num_slots // block_size
        return self.inner.allocate_kv_cache(num_slots, dtype, device, block_size=block_size, max_seqs=max_seqs)

    def block_pool(self, num_blocks: int):
        """The engine's block pool for ``num_blocks`` per rank: with data-parallel attention one partition per
        rank (core/rank_pools.py; each rank's cache holds only its own sequences' blocks), else one pool."""
        from ..core.kv_cache import BlockPool
        from ..core.rank_pools import RankPools

        return RankPools(num_blocks, self.data_parallel) if self.data_parallel > 1 else BlockPool(num_blocks)

    def reserve_positions(self, n: int) -> None:
        if not hasattr(self.inner, "reserve_positions"):  # a model with no position tables (CED)
            return
        self._guarded(self.runtime.send, _header(RESERVE, n))
        self.inner.reserve_positions(n)

    def shutdown(self) -> None:
        self.runtime.shutdown()

    def end_step(self) -> None:
        """Close the step's expert-load record; EPLB rebalances here every step_interval steps (all ranks are
        between steps). A rebalance that fails marks the group broken: the next step fails its requests."""
        end = getattr(self.inner, "end_step", None)
        if end is not None:
            end()
        if self.eplb is not None and self.runtime.failed is None:
            try:
                self.eplb.end_step()
            except DistributedError as exc:
                log.error("EPLB rebalance failed: %s", exc)

    def move_experts(self, phy2log: torch.Tensor) -> int:
        """EPLB's mover: every rank adopts phy2log [L, P] (rows in expert-load order), moving expert weights
        between ranks (expert_moves.py). Returns how many slots changed."""
        def run():
            L, P = phy2log.shape
            self.runtime.send(_header(EPLB, L, P))
            self.runtime.comm.broadcast(phy2log.reshape(-1).to(self.runtime.comm.device))
            return apply_on_rank(self.inner, phy2log)

        return self._guarded(run)

    def expert_slots(self, block: int) -> dict:
        """MoE block ``block``'s expert tensors of all P slots, gathered from every rank (rank order): {name:
        [P, ...]}. For checking a move; it copies every expert of the layer to rank 0."""
        def run():
            self.runtime.send(_header(SLOTS, block))
            return gather_slots(self.inner.moe_blocks()[block], self.runtime.comm)

        return self._guarded(run)

    def set_parameters(self, values: dict) -> None:
        """Set replicated parameters (dotted names, e.g. a router's ``...mlp.e_score_correction_bias``) to the
        same value on every rank; a parameter a module declares as optional (None) is created. Sharded
        parameters (expert weights, tensor-parallel projections) differ per rank and are refused on rank 0
        where their shapes differ."""
        for name, value in values.items():
            value = torch.as_tensor(value)
            if value.dtype not in FLOAT_DTYPES or value.dim() > 8:
                raise ValueError(f"set_parameters: {name!r} must be a float32/bfloat16/float16 tensor of at most "
                                 f"8 dims, got {value.dtype} of {value.dim()}")
            set_parameter(self.inner, name, value)  # rank 0 first: a bad name or shape fails here, not on a worker

            def run():
                code = name.encode()
                self.runtime.send(_header(SETPARAM, len(code), FLOAT_DTYPES.index(value.dtype), value.dim(),
                                          *value.shape))
                self.runtime.comm.broadcast(torch.tensor(list(code), dtype=torch.uint8), control=True)
                self.runtime.comm.broadcast(value.to(self.runtime.comm.device).contiguous())

            self._guarded(run)


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """``model``'s parameter ``name`` := value (shape checked); a None attribute becomes a Parameter."""
    path, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"set_parameters: no module {path!r} in {type(model).__name__}") from None
    old = getattr(mod, leaf, "missing")
    if old is None:
        setattr(mod, leaf, nn.Parameter(value.to(next(model.parameters()).device), requires_grad=False))
    elif isinstance(old, nn.Parameter):
        if tuple(old.shape) != tuple(value.shape):
            raise ValueError(f"set_parameters: {name!r} has shape {tuple(old.shape)}, got {tuple(value.shape)}")
        old.data.copy_(value.to(old.device, old.dtype))
    else:
        raise ValueError(f"set_parameters: {name!r} is not a parameter of {type(mod).__name__}")


def check_supported(config) -> None:
    """Engine settings parallel serving does not cover yet, refused before any process starts."""
    pc = ParallelConfig.from_engine(config)
    if pc.data_parallel_size > 1 and pc.tensor_parallel_size > 1:
        raise ValueError(f"data_parallel_size={pc.data_parallel_size} with tensor_parallel_size="
                         f"{pc.tensor_parallel_size} is not supported yet: data-parallel attention runs with "
                         "tensor_parallel_size=1 (attention and dense layers replicated, experts expert-parallel)")
    if pc.data_parallel_size > 1 and config.expert_parallel_comm != "alltoall":
        raise ValueError(f"expert_parallel_comm={config.expert_parallel_comm!r} with data_parallel_size="
                         f"{pc.data_parallel_size}: data-parallel attention needs 'alltoall' (each rank holds "
                         "different tokens)")
    if config.enable_eplb and not pc.enable_expert_parallel:
        raise ValueError(f"enable_eplb with {pc.world_size} ranks needs enable_expert_parallel=True (EPLB places "
                         "the experts of expert-parallel MoE layers)")
    if config.batch_invariant:
        raise ValueError("batch_invariant with tensor_parallel_size > 1 is not supported: the all-reduce's order "
                         "of summation is the collective library's")
    if config.host_cache_gb > 0 or config.cache_dir or os.environ.get("DEEPINFER_CACHE_DIR"):
        raise ValueError("the prefix cache's host and disk tiers (host_cache_gb, cache_dir, DEEPINFER_CACHE_DIR) "
                         "are not supported with tensor_parallel_size > 1 yet: each rank's KV shard would have to "
                         "move with its blocks")
    if config.speculative_config is not None:
        raise ValueError("speculative_config with tensor_parallel_size > 1 is not supported yet")


def start_parallel(config, model_path, hf_config: dict, ops, backend: str, dtype: torch.dtype, load_format: str,
                   registry, threads: Optional[int] = None) -> DriverModel:
    """Rank 0's model for a parallel engine (the module docstring's start-up). Under torchrun, a rank other than 0
    serves as a worker here and exits the process when rank 0 shuts down (the same script runs on every rank)."""
    from .expert_parallel import EP_COMMS

    check_supported(config)
    pc = ParallelConfig.from_engine(config)
    W = pc.world_size
    env = torchrun_env()
    if env is not None and env["world_size"] != W:
        raise ValueError(f"WORLD_SIZE={env['world_size']} (the launcher's) does not match tensor_parallel_size x "
                         f"data_parallel_size = {pc.tensor_parallel_size} x {pc.data_parallel_size} = {W}")
    if config.expert_parallel_comm not in EP_COMMS:
        raise ValueError(f"expert_parallel_comm={config.expert_parallel_comm!r} is invalid: expected one of {EP_COMMS}")
    device_type = ops.device.type
    if device_type == "cuda" and env is None and torch.cuda.device_count() < W:
        raise ValueError(f"tensor_parallel_size x data_parallel_size = {W} ranks need {W} GPUs on this machine "
                         f"(one per rank), but {torch.cuda.device_count()} are visible")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"parallel serving runs on the CPU (gloo) or NVIDIA GPUs (NCCL), not {device_type!r}")
    if env is None and dist.is_initialized():
        raise ValueError("one parallel engine per process: torch.distributed's process group is in use (another LLM "
                         "with tensor_parallel_size > 1 in this process? call its shutdown() first)")
    rank = 0 if env is None else env["rank"]
    spec = WorkerSpec(
        model_path=str(model_path), hf_config=dict(hf_config), dtype=str(dtype).removeprefix("torch."),
        load_format=load_format, backend=backend, device_type=device_type, parallel=pc,
        ep_comm=config.expert_parallel_comm,
        store_host="127.0.0.1" if env is None else env["master_addr"],
        store_port=_free_port() if env is None else env["master_port"],
        agent_store=env is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        threads=threads or (int(os.environ["DEEPINFER_NUM_THREADS"]) if os.environ.get("DEEPINFER_NUM_THREADS",
                                                                                           "").isdigit() else None))
    if rank != 0:
        worker_main(spec, rank, env["local_rank"])  # never returns
    device = rank_device(device_type, 0 if env is None else env["local_rank"], W)
    if device_type == "cuda" and ops.device.index not in (None, device.index):
        raise ValueError(f"rank 0 runs on {device}, but the backend chose {ops.device}")
    # Rank 0's shard on meta first: a layout that does not divide fails here, before any process starts.
    comm = Comm(0, W, device)
    model, keep, plan, vocab_parallel = build_shard(spec, comm, ops, registry)
    eplb_config = None
    if config.enable_eplb:  # the layout checked on the meta shard too, before any process starts
        spec, eplb_config = _eplb_spec(spec, model, config.eplb_config)
    procs = []
    if env is None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(spec, r), daemon=True, name=f"deepinfer-rank{r}")
                 for r in range(1, W)]
        for p in procs:
            p.start()
    try:
        store = _rendezvous(spec, 0)
        runtime = DriverRuntime(comm, procs, store)
        wait_s = max(pc.timeout_s, STARTUP_TIMEOUT_S)
        _wait_started(store, procs, W, wait_s, "joined")
        joined = _join(spec, 0, store, device)
        comm.control, comm.send_timeout_s = joined.control, pc.timeout_s
        load_shard(model, spec, device, keep, plan)
        if spec.eplb_slots:
            attach_rank_slots(model, spec.eplb_slots, comm)
        store.set("status/0", "")
        _wait_started(store, procs, W, wait_s, "status")
        store.set("go", "ok")
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        leave_world()
        raise
    log.info("parallel serving: %d ranks (%s), tensor_parallel_size=%d, expert parallel %s", W,
             "NCCL" if device_type == "cuda" else "gloo", pc.tensor_parallel_size,
             config.expert_parallel_comm if pc.enable_expert_parallel else "off")
    driver = DriverModel(model, runtime, vocab_parallel, pc.data_parallel_size)
    if eplb_config is not None:
        from .placement import Eplb

        driver.eplb = Eplb(driver, eplb_config, num_ranks=W, mover=driver.move_experts)
    return driver


def _eplb_spec(spec: WorkerSpec, model, eplb_config) -> tuple:
    """(spec with the physical slots, EplbConfig): refused here, naming the numbers, when the slots do not
    divide over the ranks or the layout does not fit the policy."""
    from . import eplb
    from .expert_moves import rank_initial_placement
    from .placement import EplbConfig

    cfg = EplbConfig.from_dict(eplb_config)
    W = spec.parallel.world_size
    if cfg.num_ranks not in (None, W):
        raise ValueError(f"eplb_config['num_ranks']={cfg.num_ranks} does not match the {W} expert-parallel ranks "
                         "(tensor_parallel_size x data_parallel_size); leave it out")
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
    if not blocks:
        raise ValueError(f"enable_eplb needs a mixture-of-experts model with MoE blocks (Mixtral, Qwen-MoE, "
                         f"DeepSeek-V2/V3); {type(model).__name__} has none")
    block = blocks[0]
    P = block.num_experts + cfg.num_redundant_experts
    rank_initial_placement(block.num_experts, P, W)
    eplb.check_layout(block.num_experts, P, block.n_group or 1, cfg.num_nodes, W)
    return attrs.evolve(spec, eplb_slots=P), cfg


def _free_port() -> int:
    from .dist import free_port

    return free_port()


def _wait_started(store, procs: list, W: int, timeout_s: float, what: str) -> None:
    """Wait for every worker's ``what`` key; a worker that died or reported an error is named."""
    t0 = time.monotonic()
    while True:
        reports = {r: store.get(f"status/{r}").decode() for r in range(1, W) if store.check([f"status/{r}"])}
        errors = {r: m for r, m in reports.items() if m}
        if errors:
            raise RuntimeError("parallel start-up failed: " + "; ".join(f"rank {r}: {m}" for r, m in
                                                                        sorted(errors.items())))
        dead = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode is not None]
        if dead:
            raise RuntimeError("parallel start-up failed: " + "; ".join(
                f"worker rank {r} exited with code {c} before it was ready" for r, c in dead) + " (its traceback is "
                "on stderr; a script that starts parallel serving needs the `if __name__ == \"__main__\":` guard, "
                "since workers are spawned and import the main module)")
        if all(store.check([f"{what}/{r}"]) for r in range(1, W)):
            return
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"parallel start-up failed: worker(s) not {what} after {timeout_s:.0f} s")
        time.sleep(0.02)
