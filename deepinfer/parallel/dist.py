"""torch.distributed for parallel serving: the layout, the process groups, and the collectives the sharded layers
call (``Comm``).

Two groups per process. The compute group (the default one: NCCL on GPUs, gloo on the CPU) carries the
model's collectives (all-reduce after a row-parallel projection, expert dispatch and combine, the logits'
gather); its timeout is ``EngineConfig.distributed_timeout_s``, so a peer that stops answering fails the step
instead of hanging it. The control group (gloo, CPU tensors) carries the driver's step messages to the workers
(workers.py); its timeout is long, since a worker waits there for the next step however long the engine idles.

A peer that dies closes its sockets: gloo raises at once ("Connection closed by peer"), NCCL after the timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Optional

import attrs
import torch
import torch.distributed as dist

IDLE_TIMEOUT_S = 7 * 24 * 3600  # the control group: a worker waits this long for the next step
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """A rank died or a collective failed; the engine's parallel workers are shut down."""


@attrs.frozen
class ParallelConfig:
    """The parallel layout of EngineConfig (vLLM's names): world size = tensor_parallel_size x data_parallel_size."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    timeout_s: float = 300.0

    @classmethod
    def from_engine(cls, config) -> "ParallelConfig":
        return cls(config.tensor_parallel_size, config.data_parallel_size, config.enable_expert_parallel,
                   config.distributed_timeout_s)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def torchrun_env() -> Optional[dict]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT when this process was started by torchrun (or any
    launcher that sets them), else None. A partial set is an error naming what is missing."""
    present = {k: os.environ[k] for k in TORCHRUN_ENV if k in os.environ}
    if not present or set(present) == {"LOCAL_RANK"}:
        return None
    missing = [k for k in TORCHRUN_ENV if k not in present]
    if missing:
        raise ValueError(f"distributed launch: {', '.join(sorted(present))} set but {', '.join(missing)} missing; "
                         "torchrun sets all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    try:
        return {"rank": int(present["RANK"]), "world_size": int(present["WORLD_SIZE"]),
                "local_rank": int(present["LOCAL_RANK"]), "master_addr": present["MASTER_ADDR"],
                "master_port": int(present["MASTER_PORT"])}
    except ValueError as exc:
        raise ValueError(f"distributed launch: a torchrun variable is not a number ({exc})") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, local_rank: int, world_size: int) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK on GPUs (refused, with the numbers, when there are too few), else
    the CPU."""
    if device_type == "cuda":
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"rank with LOCAL_RANK={local_rank} needs cuda:{local_rank}, but this machine has {n} "
                             f"GPU(s) visible; world size {world_size} needs one GPU per rank")
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


@attrs.define(eq=False)
class Comm:
    """This rank's view of the compute group: the collectives the sharded layers and the EP MoE call."""

    rank: int
    world_size: int
    device: torch.device
    control: object = None  # the gloo control group (workers.py's step messages)
    # Time in collectives (wall seconds: on the CPU they are synchronous; on GPUs only the launch) and calls.
    stats: dict = attrs.field(factory=lambda: {"calls": 0, "seconds": 0.0})

    def _timed(self, fn, *args, **kw):
        t0 = time.perf_counter()
        fn(*args, **kw)
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - t0

    send_timeout_s: float = 300.0  # rank 0's sends on the control group (whose own timeout is IDLE_TIMEOUT_S)

    def broadcast(self, t: torch.Tensor, control: bool = False) -> torch.Tensor:
        """``t`` from rank 0, on the compute group (``control``: the control group). Rank 0's control sends wait at
        most ``send_timeout_s`` (gloo completes a send only once the peer takes it: a stopped peer would hold it
        for the control group's idle timeout); the workers' receives wait as long as the engine idles."""
        if control and self.rank == 0:
            def send():
                work = dist.broadcast(t, src=0, group=self.control, async_op=True)
                work.wait(timeout=datetime.timedelta(seconds=self.send_timeout_s))

            self._timed(send)
        else:
            self._timed(dist.broadcast, t, src=0, group=self.control if control else None)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._timed(dist.all_reduce, t)
        return t

    def gather_cat(self, t: torch.Tensor, dim: int = -1) -> Optional[torch.Tensor]:
        """Every rank's ``t`` (same shape) concatenated along ``dim`` on rank 0 (None elsewhere)."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        self._timed(dist.gather, t.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def all_to_all(self, inp: torch.Tensor, send: list, recv: list) -> torch.Tensor:
        """Rows of ``inp`` (grouped by destination rank, ``send[r]`` rows for rank r) -> the rows every rank sent
        here (``recv[r]`` from rank r, in rank order)."""
        out = inp.new_empty((sum(recv), *inp.shape[1:]))
        self._timed(dist.all_to_all_single, out, inp.contiguous(), recv, send)
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape) stacked in rank order on every rank: [W, *t.shape]."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._timed(dist.all_gather, parts, t.contiguous())
        return torch.stack(parts)

    def gather_rows(self, t: torch.Tensor, counts: list) -> Optional[torch.Tensor]:
        """Each rank's ``t`` ([counts[rank], ...]) stacked in rank order on rank 0 (None elsewhere)."""
        pad = t.new_zeros((max(counts), *t.shape[1:]))
        pad[:t.shape[0]] = t
        parts = [torch.empty_like(pad) for _ in range(self.world_size)] if self.rank == 0 else None
        self._timed(dist.gather, pad, parts, dst=0)
        return torch.cat([p[:n] for p, n in zip(parts, counts)]) if self.rank == 0 else None

    def all_gather_rows(self, t: torch.Tensor, counts: list) -> torch.Tensor:
        """Each rank's ``t`` ([counts[rank], ...]) stacked in rank order on every rank (padded on the wire)."""
        most = max(counts)
        pad = t.new_zeros((most, *t.shape[1:]))
        pad[:t.shape[0]] = t
        parts = [torch.empty_like(pad) for _ in range(self.world_size)]
        self._timed(dist.all_gather, parts, pad)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])


def init_world(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> Comm:
    """Join the process group (every rank calls this with the same init_method) and make the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():  # a launcher (or the user's script) made the group already
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"torch.distributed is already initialized with world size {dist.get_world_size()} "
                             f"(rank {dist.get_rank()}), but the engine needs world size {world_size} (rank {rank})")
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    return Comm(rank, world_size, device, control)


def leave_world() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers died: nothing left to tear down cleanly
            pass
