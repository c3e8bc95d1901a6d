"""Mixture-of-experts kernels of the reference backend: routing and SwiGLU experts in plain PyTorch.

Pure functions, any device. `experts_dense` is the oracle (every expert on every token);
`experts_routed` is the fast path (each expert runs only on its own tokens). Expert weights use
transformers' fused layout: w13 [E, 2F, d] (gate rows, then up rows) and w2 [E, d, F], in the activations'
dtype or as float8_e4m3fn with DeepSeek-V3's 128x128 block scales (w13_scale [E, cdiv(2F, 128), cdiv(d, 128)],
w2_scale [E, cdiv(d, 128), cdiv(F, 128)] float32; weight = fp8 value x its block's scale), which both
dequantize before computing as they do with unquantized weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid", "sqrt_softplus")
FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # DeepSeek-V3's 128 x 128 weight blocks
GROUP_SCORES = ("max", "top2sum")


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """logits: [T, E] float32 -> per-expert scores [T, E] float32."""
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    return F.softplus(logits).sqrt()


def _check_route(router_logits, top_k, scoring, n_group, topk_group, group_score, bias) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    E = router_logits.shape[1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}] (E experts), got {top_k}")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias must have shape ({E},), got {tuple(bias.shape)}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if n_group is None:
        if topk_group is not None:
            raise ValueError("n_group must be given when topk_group is")
        return
    if topk_group is None:
        raise ValueError("topk_group must be given when n_group is")
    if n_group < 1 or E % n_group != 0:
        raise ValueError(f"n_group must be >= 1 and divide E={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    group_size = E // n_group
    if group_score == "top2sum" and group_size < 2:
        raise ValueError(f"group_score='top2sum' needs >= 2 experts per group; n_group={n_group} gives {group_size}")
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_group * group_size} experts in the kept groups "
            f"(topk_group={topk_group} x {group_size})"
        )


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    scaling: float = 1.0,
    n_group: int | None = None,
    topk_group: int | None = None,
    group_score: str = "max",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token. router_logits: [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int64).

    Order of operations (all in float32): scores = scoring(logits) over all E experts; selection
    scores = scores + bias; optional grouped masking; top_k on the selection scores (ids sorted by
    descending selection score); weights = the UNBIASED scores of the chosen experts; optional
    renormalisation (sum + 1e-20 for sigmoid / sqrt_softplus); times `scaling`.

    Reproduces transformers 5.24 exactly with:
      * Mixtral (MixtralTopKRouter): scoring="softmax", renormalize=True.
      * Qwen2-MoE / Qwen3-MoE (Qwen*MoeTopKRouter): scoring="softmax", renormalize=norm_topk_prob.
        (HF then casts the weights to the logits' dtype; do that at the call site if wanted.)
      * DeepSeek-V2 (DeepseekV2TopkRouter): scoring="softmax", renormalize=False (HF ignores
        norm_topk_prob), scaling=routed_scaling_factor (HF always applies it); topk_method
        "group_limited_greedy" adds n_group, topk_group, group_score="max". HF zero-fills the
        dropped groups where we use -inf; identical unless softmax underflows to exactly 0.
        (The original DeepSeek-V2 code instead renormalises when norm_topk_prob and top_k > 1 and
        scales only otherwise: pass renormalize=True, scaling=1.0 for that.)
      * DeepSeek-V3 noaux_tc (DeepseekV3TopkRouter): scoring="sigmoid", bias=e_score_correction_bias,
        n_group, topk_group, group_score="top2sum", renormalize=norm_topk_prob, scaling=routed_scaling_factor.
      * DeepSeek-V4 (DeepseekV4TopKRouter, non-hash layers): scoring="sqrt_softplus",
        bias=e_score_correction_bias, renormalize=True, scaling=routed_scaling_factor.
    HF's DeepSeek routers use topk(sorted=False), so their ids may come in another order per row.
    """
    _check_route(router_logits, top_k, scoring, n_group, topk_group, group_score, bias)
    T, E = router_logits.shape
    scores = _scores(router_logits.float(), scoring)  # [T, E]
    choice = scores if bias is None else scores + bias.float()  # [T, E] selection only
    if n_group is not None:
        grouped = choice.reshape(T, n_group, E // n_group)  # [T, G, E/G]
        if group_score == "max":
            group_scores = grouped.amax(dim=-1)  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        keep = keep.repeat_interleave(E // n_group, dim=1)  # [T, E]
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)  # [T, 1]
        if scoring != "softmax":
            denom = denom + 1e-20  # as DeepSeek-V3/V4 do: guards an all-underflowed row
        weights = weights / denom
    return weights * scaling, ids


def _check_experts(x, w13, w2, weights, ids, clamp) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2 != 0 or w13.shape[2] != d:
        raise ValueError(f"w13 must be [E, 2F, d={d}], got shape {tuple(w13.shape)}")
    E, F2 = w13.shape[0], w13.shape[1]
    if tuple(w2.shape) != (E, d, F2 // 2):
        raise ValueError(f"w2 must be [E={E}, d={d}, F={F2 // 2}], got shape {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"ids must be [T={T}, k], got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights must match ids' shape {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_scales(w13, w2, w13_scale, w2_scale) -> None:
    """FP8 weights come with both block scales, of the shapes of w13/w2 in 128 x 128 blocks; others without."""
    E, F2, d = w13.shape
    F = F2 // 2
    fp8 = (w13.dtype == FP8, w2.dtype == FP8)
    if fp8[0] != fp8[1]:
        raise ValueError(f"w13 and w2 must both be float8_e4m3fn or neither; got {w13.dtype} and {w2.dtype}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale and w2_scale must be given together")
    if fp8[0] and w13_scale is None:
        raise ValueError("float8_e4m3fn w13/w2 need w13_scale and w2_scale (128x128 block scales)")
    if w13_scale is None:
        return
    if not fp8[0]:
        raise ValueError(f"w13_scale/w2_scale are for float8_e4m3fn weights, got w13 of dtype {w13.dtype}")
    c = _cdiv
    for name, s, want in (("w13_scale", w13_scale, (E, c(F2, SCALE_BLOCK), c(d, SCALE_BLOCK))),
                          ("w2_scale", w2_scale, (E, c(d, SCALE_BLOCK), c(F, SCALE_BLOCK)))):
        if tuple(s.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(s.shape)}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")


def dequantize_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block=(SCALE_BLOCK, SCALE_BLOCK),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., R, C] (FP8) with block scales [..., cdiv(R, br), cdiv(C, bc)] -> [..., R, C] in dtype: each value
    times its block's scale, in float32. Shapes are not checked here (check_scales, models.quant do)."""
    R, C = w.shape[-2:]
    s = scale.float().repeat_interleave(block[0], -2)[..., :R, :].repeat_interleave(block[1], -1)[..., :C]
    return (w.float() * s).to(dtype)


def _expert_weight(w: torch.Tensor, scale, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix of w [E, R, C] in dtype, dequantized when scale (FP8 block scales) is given."""
    return w[e].to(dtype) if scale is None else dequantize_fp8_blocks(w[e], scale[e], dtype=dtype)


def _swiglu(gate_up: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """gate_up: [..., 2F] -> [..., F]: silu(gate) * up, with DeepSeek-V4's optional clamps."""
    gate, up = gate_up.chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    return F.silu(gate) * up


def experts_dense(x, w13, w2, weights, ids, *, clamp: float | None = None, w13_scale=None,
                  w2_scale=None) -> torch.Tensor:
    """The oracle: every expert on every token, all in float32, mixed by a dense [T, E] weight matrix.

    x: [T, d]; w13: [E, 2F, d]; w2: [E, d, F]; weights, ids: [T, k] -> [T, d] in x.dtype. FP8 w13/w2 with
    their block scales are dequantized (every expert) to float32 first. Memory is O(E * T * F): for tests,
    not serving.
    """
    _check_experts(x, w13, w2, weights, ids, clamp)
    check_scales(w13, w2, w13_scale, w2_scale)
    if w13_scale is not None:
        w13, w2 = dequantize_fp8_blocks(w13, w13_scale), dequantize_fp8_blocks(w2, w2_scale)
    E = w13.shape[0]
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"ids must lie in [0, {E}), got range [{int(ids.min())}, {int(ids.max())}]")
    h = torch.einsum("td,efd->etf", x.float(), w13.float())  # [E, T, 2F]
    y = torch.einsum("etf,edf->etd", _swiglu(h, clamp), w2.float())  # [E, T, d]
    mix = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device)
    mix.scatter_add_(1, ids, weights.float())  # [T, E]; 0 where a token skips an expert
    return torch.einsum("te,etd->td", mix, y).to(x.dtype)


def experts_routed(x, w13, w2, weights, ids, *, clamp: float | None = None, w13_scale=None,
                   w2_scale=None) -> torch.Tensor:
    """The fast path: sort the T*k (token, expert) pairs by expert and run one matmul pair per used expert.

    x: [T, d]; w13: [E, 2F, d]; w2: [E, d, F]; weights, ids: [T, k] -> [T, d] in x.dtype.
    Matmuls run in x.dtype (as fused kernels do), SwiGLU and the weighted sum in float32. FP8 w13/w2 with
    their block scales: each used expert is dequantized (float32, then x.dtype) before its matmuls.
    One host sync: the per-expert counts that bound the Python loop over used experts.
    """
    _check_experts(x, w13, w2, weights, ids, clamp)
    check_scales(w13, w2, w13_scale, w2_scale)
    T, d = x.shape
    E = w13.shape[0]
    out = torch.zeros(T, d, dtype=torch.float32, device=x.device)  # [T, d]
    if ids.numel() == 0:
        return out.to(x.dtype)
    k = ids.shape[1]
    flat = ids.reshape(-1).long()  # [T*k]
    bad = ((flat < 0) | (flat >= E)).any()
    counts = expert_counts(flat.clamp(0, E - 1), E)  # [E]; clamped so a bad id is reported, not crashed on
    *counts, n_bad = torch.cat([counts, bad.long()[None]]).tolist()  # the one host sync
    if n_bad:
        raise ValueError(f"ids must lie in [0, {E})")
    order = torch.argsort(flat, stable=True)  # [T*k] pair indices grouped by expert
    tok = order // k  # [T*k] token of each sorted pair
    xs = x[tok]  # [T*k, d]
    ys = torch.empty(T * k, d, dtype=torch.float32, device=x.device)  # [T*k, d] sorted expert outputs
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        h = xs[seg] @ _expert_weight(w13, w13_scale, e, x.dtype).T  # [n, 2F]
        a = _swiglu(h.float(), clamp).to(x.dtype)  # [n, F]
        ys[seg] = a @ _expert_weight(w2, w2_scale, e, x.dtype).T  # [n, d]
        start += n
    ys *= weights.reshape(-1)[order].float()[:, None]
    out.index_add_(0, tok, ys)
    return out.to(x.dtype)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids: [...] expert ids in [0, num_experts) -> [num_experts] int64 assignments per expert.

    scatter_add_ rather than torch.bincount: CUDA bincount reads max(ids) back to the host to size
    its output even with minlength, and this must not sync. Ids are not range-checked (that would sync).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    flat = ids.reshape(-1).long()  # [N]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))
