"""DSpark, CED's parallel drafter (CED.md), at toy size: one forward gives up to P draft positions.

Inputs: the target's hidden states after its last ``target_layers`` layers at the position whose logits
produced the anchor token (concatenated and projected: the context), the anchor token's embedding (the
target's, frozen) at position 0 and learned placeholders at positions 1..P-1. Blocks of non-causal attention
over the P positions and a SwiGLU MLP; the output goes through a projection to the target's width, the
target's final norm and the target's LM head (frozen), giving base logits for every position at once.

- Markov head: a low-rank embedding of the previous draft token (the anchor for position 0), added to the
  next position's base logits as a bias, so P tokens are drawn in sequence at the cost of P small matmuls.
- Confidence head: per position a logit whose sigmoid c_k predicts that draft k is accepted given the ones
  before it; S_k = c_1 ... c_k is the prefix survival, tau = 1 + sum S_k the expected tokens per cycle.

The draft distribution q_k = softmax(base_k + markov(prev)) is what a sampled draft is drawn from, and what
rejection sampling verifies against (core/speculative.py), so the target's distribution is kept exactly.

Left out at toy size (README, "Speculative decoding"): the real drafter's own sliding-window attention over
earlier positions (here the context vector carries the past) and its MoE (here a dense MLP).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ...layout import stack_rows, to_device


@attrs.frozen
class DSparkConfig:
    target_hidden: int
    vocab_size: int
    hidden: int = 256
    num_blocks: int = 2
    num_heads: int = 4
    ffn: int = 512
    positions: int = 5
    markov_rank: int = 32
    target_layers: int = 3
    rms_eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        for name in ("target_hidden", "vocab_size", "hidden", "num_blocks", "num_heads", "ffn", "positions",
                     "markov_rank", "target_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DSparkConfig.{name}={v!r} is invalid: must be an int >= 1")
        if self.hidden % self.num_heads:
            raise ValueError(f"DSparkConfig.hidden={self.hidden} is not a multiple of num_heads={self.num_heads}")

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        known = {f.name for f in attrs.fields(cls)}
        unknown = set(d) - known - {"architecture"}
        if unknown:
            raise ValueError(f"DSpark config.json: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return {"architecture": "DSpark", **attrs.asdict(self)}


class _Block(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.c = c
        self.norm1 = nn.Parameter(torch.ones(c.hidden))
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden, bias=False)
        self.o = nn.Linear(c.hidden, c.hidden, bias=False)
        self.norm2 = nn.Parameter(torch.ones(c.hidden))
        self.w13 = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x):  # [B, P, h]
        c = self.c
        B, P, h = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (h,), self.norm1, c.rms_eps)).view(B, P, 3, c.num_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # non-causal
        x = x + self.o(a.transpose(1, 2).reshape(B, P, h))
        g, u = self.w13(F.rms_norm(x, (h,), self.norm2, c.rms_eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


class DSpark(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.config = c
        self.context = nn.Linear(c.target_layers * c.target_hidden, c.hidden, bias=False)
        self.anchor = nn.Linear(c.target_hidden, c.hidden, bias=False)
        self.placeholders = nn.Parameter(torch.zeros(c.positions - 1, c.hidden))
        self.pos = nn.Parameter(torch.zeros(c.positions, c.hidden))
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_blocks))
        self.norm = nn.Parameter(torch.ones(c.hidden))
        self.out = nn.Linear(c.hidden, c.target_hidden, bias=False)
        self.markov_in = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_out = nn.Linear(c.markov_rank, c.vocab_size, bias=False)
        self.confidence = nn.Linear(c.hidden, 1)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("norm", "norm1", "norm2")):
                    p.fill_(1.0)
                elif name.endswith("bias") or name == "markov_out.weight":
                    p.zero_()  # the Markov bias starts at nothing
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, context: torch.Tensor, anchor: torch.Tensor, target) -> tuple:
        """context [B, target_layers * target_hidden], anchor [B] token ids, target: the CED model (its
        embedding, final norm and LM head, frozen) -> (base logits [B, P, V] float32, confidence logits [B, P])."""
        c = self.config
        B = anchor.shape[0]
        ctx = self.context(context.to(self.context.weight.dtype))[:, None, :]  # [B, 1, h]
        first = self.anchor(target.embed(anchor).to(self.anchor.weight.dtype))[:, None, :]
        rest = self.placeholders[None].expand(B, -1, -1)
        x = torch.cat([first, rest], dim=1) + ctx + self.pos[None]
        for blk in self.blocks:
            x = blk(x)
        x = F.rms_norm(x, (c.hidden,), self.norm, c.rms_eps)
        base = target.logits(self.out(x).to(target.embed.weight.dtype))  # [B, P, V] float32 (norm + LM head)
        return base, self.confidence(x)[..., 0].float()

    def markov(self, prev: torch.Tensor) -> torch.Tensor:
        """Logit bias [..., V] from the previous token ids [...]."""
        return self.markov_out(self.markov_in(prev)).float()

    @torch.no_grad()
    def draft(self, context, anchor: int, k: int, target, greedy: bool, gen: Optional[torch.Generator]) -> tuple:
        """Up to k draft tokens after ``anchor`` and their distributions q [k, V] (what they were drawn from)."""
        k = min(k, self.config.positions)
        dev = self.anchor.weight.device
        base, conf = self(context[None].to(dev), torch.tensor([anchor], device=dev), target)
        tokens, qs, prev = [], [], torch.tensor(anchor, device=dev)
        for j in range(k):
            q = (base[0, j] + self.markov(prev)).softmax(dim=-1)
            if greedy:
                t = int(q.argmax())
            else:
                gdev = gen.device if gen is not None else torch.device("cpu")
                t = int(torch.multinomial(q.to(gdev).double(), 1, generator=gen))
            tokens.append(t)
            qs.append(q)
            prev = torch.tensor(t, device=dev)
        return tokens, torch.stack(qs) if qs else base.new_zeros(0, base.shape[-1]), torch.sigmoid(conf[0, :k])

    @torch.no_grad()
    def draft_batch(self, contexts: list, anchors: list, ks: list, target, greedy: list, gens: list) -> tuple:
        """``draft`` for B sequences in one forward: contexts [B] each [target_layers * target_hidden], anchors [B]
        token ids, ks [B] drafts wanted, greedy [B], gens [B] (a sampled row's generator). Returns (tokens [B]
        host lists, q [B, K, V] on the device (None when every row is greedy: verification ignores a greedy
        row's q), survival [B] host lists S_1..S_k); row b's first min(ks[b], P) entries are what ``draft`` gives
        it. The host waits once, for one copy of every row's tokens and survival;
        the Markov chain runs K = max k positions for every row (a row's own draws stop at its own k, so a
        seeded generator advances as in ``draft``)."""
        P = self.config.positions
        ks = [min(k, P) for k in ks]
        B, K = len(ks), max(ks, default=0)
        dev = self.anchor.weight.device
        prev = to_device(anchors, torch.long, dev)  # [B]
        base, conf = self(stack_rows(contexts).to(dev), prev, target)  # [B, P, V], [B, P]
        if K == 0:
            return [[] for _ in ks], None if all(greedy) else base.new_zeros(B, 0, base.shape[-1]), [[] for _ in ks]
        sampled = [(b, gens[b], ks[b]) for b in range(B) if not greedy[b]]
        tokens, survival, qs = self.chain(base, conf, prev, K, sampled)
        host = torch.cat([tokens.double(), survival.double()], 1).tolist()  # the one copy
        return ([[int(t) for t in row[:k]] for row, k in zip(host, ks)], None if all(greedy) else qs,
                [row[K:K + k] for row, k in zip(host, ks)])

    def chain(self, base, conf, prev, K: int, sampled=(), keep_q: bool = True) -> tuple:
        """The Markov chain over K positions from base logits [B, P, V] and the anchors prev [B]: (tokens [B, K],
        survival [B, K], q [B, K, V] or None without keep_q); greedy rows take the argmax, each (row, generator,
        k) of ``sampled`` draws its first k positions from its own generator (the call ``draft`` makes). No host
        sync for greedy rows (dspark_graphs.py captures it)."""
        dev = prev.device
        qs, tokens = [], []
        for j in range(K):
            q = (base[:, j] + self.markov(prev)).softmax(dim=-1)  # [B, V]
            t = q.argmax(dim=-1)
            for b, g, k in sampled:
                if j < k:
                    t[b] = torch.multinomial(q[b].to(g.device if g is not None else "cpu").double(), 1,
                                             generator=g)[0].to(dev)
            qs.append(q)
            tokens.append(t)
            prev = t
        survival = torch.cumprod(torch.sigmoid(conf[:, :K]), dim=1)  # [B, K] S_i = c_1 ... c_i
        return torch.stack(tokens, 1), survival, torch.stack(qs, 1) if keep_q else None


def load_dspark(path, device, dtype=torch.float32) -> DSpark:
    """A DSpark drafter from a directory holding config.json and model.safetensors (no pickle)."""
    from safetensors.torch import load_file

    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"DSpark drafter: {path / name} is missing (a drafter directory holds "
                                    "config.json and model.safetensors)")
    cfg = DSparkConfig.from_dict(json.loads((path / "config.json").read_text()))
    net = DSpark(cfg)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"DSpark drafter {path}: missing weights {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}")
    return net.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_dspark(net: DSpark, path, dtype=torch.bfloat16) -> int:
    """Write config.json and model.safetensors; returns the weights' bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(net.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    return (path / "model.safetensors").stat().st_size
