"""Speculative decoding: what a draft costs and how it is accepted, without changing the output distribution.

Configured as in vLLM: ``LLM(..., speculative_config={"method": NAME, "num_speculative_tokens": k})`` where
NAME is a registered stage of kind ``draft`` (the example plugin ``plugins/deepinfer-ngram`` registers
``"ngram"``: prompt lookup, with ``prompt_lookup_min`` / ``prompt_lookup_max``). Before each step the engine
asks the drafter for up to k tokens per decoding sequence (``propose``); the step computes the sequence's last
token and its drafts in one forward, like a short prefill chunk among the other rows; the verify stage gives
the target's logits at every drafted position; then acceptance decides, per row, how many drafts stand
(core/spec_accept.py, for the whole batch on the device; ``accept_row`` here is its one-row oracle):

- greedy rows: a draft stands while it equals the target's argmax; the first that does not is replaced by
  that argmax, and when all stand the target's token after the last one is added (the bonus token), so the
  output is exactly greedy decoding's;
- sampled rows: draft d at a position with target distribution p (temperature, top-k, top-p, min-p and
  penalties applied, penalties counting the drafts before it as output) and draft distribution q (a point mass for
  a drafter that gives no probabilities) stands with probability min(1, p(d) / q(d)); the first rejected one
  is replaced by a draw from the residual max(0, p - q) renormalised; the bonus is drawn from p. This is the
  standard rejection scheme: every emitted token has the target's distribution. Draws come from the
  request's own generator when it has a seed, so a seeded request repeats.

Rejected drafts are rolled back: the sequence's computed length drops to its accepted tokens (their paged
KV stays valid; the rest is overwritten by later steps), CED's SWA rings keep the window within their
speculative allowance (so k is capped by it), blocks past the accepted tokens are never committed to the
prefix cache (only known tokens are hashed). Requests whose sampling needs per-step host state the drafts
would bypass (jump-forward, logits processors, bad words, min_tokens, allowed_token_ids, logit bias) decode
one token at a time; structured outputs speculate, each drafted position masked by the grammar after the
drafts before it (stages/constrain.py). Penalty counts are corrected to the emitted tokens; logprobs are computed at
each emitted token's own position. Overlap scheduling is off while speculating (drafting reads the last token).

``stats`` keeps honest accounting: drafts proposed, draft tokens, accepted tokens, per draft position, and
emitted tokens per verified row (1 + accepted), from which tau is reported as measured, not as 1 + k x rate.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import Counter
from pathlib import Path
from typing import Optional

import attrs
import torch

MAX_SPECULATIVE_TOKENS = 16


def _k(inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config num_speculative_tokens={value!r} is invalid: must be an int in "
                         f"1..{MAX_SPECULATIVE_TOKENS}")


def _method(inst, attribute, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"speculative_config method={value!r} is invalid: must be the name of a registered draft "
                         "stage (e.g. 'ngram')")


@attrs.frozen
class SpeculativeConfig:
    method: str = attrs.field(validator=_method)
    num_speculative_tokens: int = attrs.field(validator=_k)
    dynamic: bool = False
    optional: bool = False  # a drafter that cannot be built (no drafter for this model) means no speculation
    step_time: Optional[str] = None  # a JSON file of measured steps (StepTime.save) that seeds T(n) for dynamic
    options: dict = attrs.field(factory=dict)  # everything else: the drafter's own arguments

    @classmethod
    def parse(cls, spec) -> Optional["SpeculativeConfig"]:
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {type(spec).__name__}")
        rest = dict(spec)
        for key in ("method", "num_speculative_tokens"):
            if key not in rest:
                raise ValueError(f"speculative_config lacks {key!r} (it has {sorted(spec)})")
        if "model" in rest:  # vLLM's key for the draft model's path
            rest["drafter"] = rest.pop("model")
        flags = {}
        for key in ("dynamic", "optional"):
            flags[key] = rest.pop(key, False)
            if not isinstance(flags[key], bool):
                raise ValueError(f"speculative_config {key}={flags[key]!r} is invalid: must be true or false")
        step_time = rest.pop("step_time", None)
        if step_time is not None and not isinstance(step_time, (str, os.PathLike)):
            raise ValueError(f"speculative_config step_time={step_time!r} is invalid: must be the path of a JSON "
                             "file written by StepTime.save")
        return cls(rest.pop("method"), rest.pop("num_speculative_tokens"), options=rest,
                   step_time=None if step_time is None else os.fspath(step_time), **flags)


class SpeculativeConfigError(ValueError):
    """speculative_config itself is wrong (a method that is no draft stage, an option the drafter does not take,
    dynamic without confidences): raised even with ``optional``, which covers a drafter unavailable here."""


def can_speculate(params) -> bool:
    """Whether a request's sampling lets drafted tokens be verified in one step (see the module docstring)."""
    return not (params.jump_forward or params.logits_processors or params.bad_words or params.min_tokens
                or params.allowed_token_ids or params.logit_bias)


def _drafter_class(pipeline, spec):
    """The draft stage class ``spec.method`` names, or None when none is registered (build_drafter says so)."""
    from .plugins import get_registry

    try:
        return (pipeline.registry or get_registry()).get("stage", spec.method).obj
    except ValueError:
        return None


def _found(factory, spec, model, model_path) -> bool:
    """False for an optional drafter whose stage says (``locate``) it has nothing to load for this model."""
    locate = getattr(factory, "locate", None)
    return not (spec.optional and locate is not None
                and locate(model, model_path, spec.options.get("drafter")) is None)


def wants_hidden(pipeline, config, model=None, model_path=None) -> bool:
    """Whether the configured drafter reads the target's hidden states (the engine then keeps them per
    sequence and does not capture decode in CUDA graphs, unless the model's graphs keep them:
    ``graphs_keep_hidden``); an optional one only if it can be built here."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None or getattr(model, "graphs_keep_hidden", False):
        return False
    factory = _drafter_class(pipeline, spec)
    if factory is None or not getattr(factory, "wants_hidden", False):
        return False
    return _found(factory, spec, model, model_path)


def verify_width(pipeline, config, model, model_path=None) -> int:
    """Q = k + 1, the tokens per row of the verify steps the engine captures in CUDA graphs (beside decode's),
    or 0: no speculation, an optional drafter that cannot be built here, or a model with per-sequence window
    state (SWA rings) that a padded token would write, unless the model keeps padding off it
    (``pads_verify_safely``: CED's decode path routes padding to its scratch slot and block)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None or (getattr(model, "max_draft_tokens", None) is not None
                        and not getattr(model, "pads_verify_safely", False)):
        return 0
    if spec.optional:
        factory = _drafter_class(pipeline, spec)
        if factory is None or not _found(factory, spec, model, model_path):
            return 0
    return spec.num_speculative_tokens + 1


def build_drafter(registry, spec: SpeculativeConfig, context: dict, model):
    """The draft stage speculative_config names, built with its options and the engine context it asks for."""
    from .graph import StageSpec, instantiate
    from .plugins import get_registry

    registry = registry or get_registry()
    entry = registry.get("stage", spec.method) if spec.method in registry.names("stage") else None
    if entry is None or entry.kind != "draft":
        drafts = [n for n in registry.names("stage") if registry.get("stage", n).kind == "draft"]
        what = f"unknown stage {spec.method!r}" if entry is None else f"a {entry.kind!r} stage, not a draft stage"
        raise SpeculativeConfigError(f"speculative_config method={spec.method!r}: {what}; registered draft stages: "
                         f"{', '.join(drafts) or 'none (pip install plugins/deepinfer-ngram)'}")
    limit = getattr(model, "max_draft_tokens", None)
    if limit is not None and spec.num_speculative_tokens > limit:
        raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} exceeds what "
                         f"{type(model).__name__} can roll back ({limit}: its SWA rings' speculative allowance)")
    takes = _options(entry.obj, context)
    unknown = [] if takes is None else sorted(set(spec.options) - takes)
    if unknown:
        raise SpeculativeConfigError(
            f"speculative_config {', '.join(map(repr, unknown))}: not an option of the {spec.method!r} drafter "
            f"(its options: {', '.join(sorted(takes)) or 'none'})")
    if spec.dynamic and not getattr(entry.obj, "reports_confidence", False):
        raise SpeculativeConfigError(f"speculative_config dynamic=True needs a drafter that reports confidences "
                                     f"(dspark); {spec.method!r} does not: use dynamic=False (fixed k)")
    stage = instantiate(StageSpec(spec.method, "draft", entry.obj, entry.plugin, dict(spec.options)),
                        {**context, "num_speculative_tokens": spec.num_speculative_tokens})
    if not callable(getattr(stage, "propose", None)):
        raise ValueError(f"draft stage {spec.method!r} has no propose(seq, k) method")
    return stage


def _options(factory, context: dict) -> Optional[set]:
    """The keyword arguments a drafter factory takes from speculative_config (its signature less the engine
    context it is given), or None when it takes any (**kwargs, or no signature to read)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if n not in context and n != "num_speculative_tokens"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def choose_lengths(survival: list, step_time) -> list:
    """Per request, how many of its drafts to verify (CED.md's DSpark scheduler).

    survival[r] = [S_1, S_2, ...]: the predicted probability that drafts 1..i of request r all stand (never
    rising with i); step_time(n): seconds of a step over n batched tokens. Maximises
    sum_r (1 + sum_{i <= k_r} S_{r,i}) / step_time(sum_r (1 + k_r)): every request verifies its last token
    (the bonus, the 1 +) whatever it drafts; drafts are admitted one (request, position) slot at a time in
    order of S, the next position of a request only after the previous, while the ratio rises."""
    k = [0] * len(survival)
    value, tokens = float(len(survival)), len(survival)
    best = value / step_time(tokens)
    heap = [(-s[0], r) for r, s in enumerate(survival) if s]  # each request's next slot, best first
    heapq.heapify(heap)
    while heap:
        neg, r = heapq.heappop(heap)
        ratio = (value - neg) / step_time(tokens + 1)
        if ratio <= best:
            break
        value, tokens, best = value - neg, tokens + 1, ratio
        k[r] += 1
        if k[r] < len(survival[r]):
            heapq.heappush(heap, (-survival[r][k[r]], r))
    return k


class StepTime:
    """T(n, R): seconds of an engine step over n batched tokens in R rows, a + b R + c n fitted (least squares) to
    the recent decode steps the engine reports; before enough of them, a prior (one step costs about as much as
    64 tokens). Rows and tokens are separate terms because a speculative step's host work grows with its rows
    (drafting, folding the accepted tokens) and its device work with its tokens: a fit in tokens alone, over
    verify steps of R rows x width tokens, prices a plain step of the same R rows at a fraction of what it costs.
    Samples whose tokens follow from their rows (every one a verify step of one width, or every one plain) do
    not separate the terms: ``separates()`` is False and the fit is in tokens alone."""

    def __init__(self, prior_s: float = 0.01, window: int = 256):
        self.prior, self.window, self.samples = prior_s, window, []
        self._fit = None  # (a, b, c) of the samples as they are; the scheduler asks T for every slot it admits
        self._sums = [0.0] * 9  # n, x, r, t, xx, rr, xr, xt, rt over the window (rows None counts r as 0)
        self._no_rows = 0  # samples without rows in the window
        self._since_exact = 0

    def record(self, tokens: int, seconds: float, rows: Optional[int] = None) -> None:
        """Add a step; the window's sums follow it in O(1) (refitting from them costs the same at any window:
        summing the window on every step took ~0.2 ms of a host-bound speculative step)."""
        self.samples.append((tokens, seconds, rows))
        self._add(self.samples[-1], 1.0)
        while len(self.samples) > self.window:
            self._add(self.samples.pop(0), -1.0)
        self._since_exact += 1
        if self._since_exact >= self.window:  # now and then from scratch, so float error cannot accumulate
            self._resum()
        self._fit = None

    def _add(self, sample, sign: float) -> None:
        x, t, r = sample
        self._no_rows += int(sign) if r is None else 0
        r = 0 if r is None else r
        for i, v in enumerate((1, x, r, t, x * x, r * r, x * r, x * t, r * t)):
            self._sums[i] += sign * v

    def _resum(self) -> None:
        self._sums, self._no_rows, self._since_exact = [0.0] * 9, 0, 0
        for sample in self.samples:
            self._add(sample, 1.0)

    def save(self, path) -> None:
        """The recorded steps as JSON, for ``speculative_config={"step_time": path}`` in a later engine."""
        Path(path).write_text(json.dumps({"prior_s": self.prior, "samples": [list(x) for x in self.samples]}))

    @classmethod
    def load(cls, path, window: int = 256) -> "StepTime":
        """A StepTime seeded with the steps a file holds (save's format: [tokens, seconds, rows] per step, rows
        optional); refreshed online as steps run."""
        try:
            data = json.loads(Path(path).read_text())
            samples = [(int(x[0]), float(x[1]), None if len(x) < 3 or x[2] is None else int(x[2]))
                       for x in data["samples"]]
            prior = float(data.get("prior_s", 0.01))
        except FileNotFoundError:
            raise ValueError(f"speculative_config step_time: no file {str(path)!r}") from None
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"speculative_config step_time: {str(path)!r} is not a StepTime.save file "
                             f"({{'samples': [[tokens, seconds, rows], ...]}}): {exc}") from None
        if any(n < 1 or not t > 0 or (r is not None and r < 1) for n, t, r in samples):
            raise ValueError(f"speculative_config step_time: {str(path)!r} holds a step of fewer than 1 token or "
                             "row, or a time that is not positive")
        st = cls(prior_s=prior, window=window)
        for n, t, r in samples:
            st.record(n, t, r)
        return st

    def coefficients(self) -> tuple:
        """(a, b, c): T(n, R) = a + b R + c n."""
        if self._fit is None:  # (refit once per recorded step: refitting per call cost ~30 ms a step at 128 rows)
            self._fit = self._least_squares()
        return self._fit

    def _moments(self):
        """(mean t, mean x, mean r or None without rows, Sxx, Srr, Sxr, Sxt, Srt): centred sums from the running ones."""
        n, x, r, t, xx, rr, xr, xt, rt = self._sums
        mt, mx, mr = t / n, x / n, r / n
        sxx, sxt = max(xx - x * mx, 0.0), xt - x * mt
        if self._no_rows:  # steps without rows (recorded so, or an old file)
            return mt, mx, None, sxx, 0.0, 0.0, sxt, 0.0
        return mt, mx, mr, sxx, max(rr - r * mr, 0.0), xr - x * mr, sxt, rt - r * mt

    def separates(self) -> bool:
        """Whether the samples tell a step's cost per row from its cost per token: its tokens vary other than
        as a fixed function of its rows (needs rows recorded)."""
        if len(self.samples) < 8:
            return False
        _, _, mr, sxx, srr, sxr, _, _ = self._moments()
        if mr is None or sxx <= 1e-9 * max(1.0, self._sums[4]):  # (running sums: zero up to rounding)
            return False
        resid = sxx - (sxr * sxr / srr if srr > 1e-9 * max(1.0, self._sums[5]) else 0.0)
        return resid > 1e-6 * sxx  # tokens' variance left once rows explain what they can

    def _least_squares(self) -> tuple:
        n = len(self.samples)
        if n == 0:
            return self.prior, 0.0, self.prior / 64
        mt, mx, mr, sxx, srr, sxr, sxt, srt = self._moments()
        if n < 8 or sxx <= 1e-9 * max(1.0, self._sums[4]):  # the prior's shape (a step costs as much as 64 tokens)
            a = mt / (1 + mx / 64)  # ... through what was measured: T(x0) = the mean time at the mean x0
            return a, 0.0, a / 64
        if self.separates() and srr > 1e-9 * max(1.0, self._sums[5]):
            det = sxx * srr - sxr * sxr
            c = (sxt * srr - srt * sxr) / det
            b = (srt * sxx - sxt * sxr) / det
            if b >= 0 and c >= 0:
                return max(mt - b * mr - c * mx, 1e-9), b, c
            if c < 0 <= b:  # more tokens never cost less: rows alone
                b = max(srt / srr, 0.0)
                return max(mt - b * mr, 1e-9), b, 0.0
        c = max(sxt / sxx, 0.0)  # tokens alone (rows fixed, unknown, or not separable from tokens)
        return max(mt - c * mx, 1e-9), 0.0, c

    def __call__(self, tokens: int, rows: Optional[int] = None) -> float:
        """T at ``tokens`` over ``rows`` (unknown: as many rows as tokens, a plain decode step)."""
        a, b, c = self.coefficients()
        return a + b * (tokens if rows is None else rows) + c * tokens


@attrs.frozen
class RowDistributions:
    """The sampling parameters of one row repeated over its k + 1 verified positions."""

    batch: object  # a SamplingBatch of k + 1 rows

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the sampler draws from (temperature, top-k, top-p, min-p) at each position."""
        from ..backends.reference.sampling import process_logits

        return process_logits(logits, self.batch)


def sampling_rows(batch, row: int, drafts: list) -> RowDistributions:
    """Row ``row`` of a SamplingBatch at each of its len(drafts) + 1 verified positions: the same parameters,
    and penalties that count the drafts before each position as output tokens (a speculating row has no bias,
    bans or processors)."""
    n = len(drafts) + 1
    idx = torch.full((n,), row, dtype=torch.long, device=batch.temperature.device)
    pen = {}
    if batch.output_counts is not None:
        counts = batch.output_counts[idx].clone()  # [n, V]
        for j, d in enumerate(drafts):
            counts[j + 1:, d] += 1
        pen = dict(presence_penalty=batch.presence_penalty[idx], frequency_penalty=batch.frequency_penalty[idx],
                   repetition_penalty=batch.repetition_penalty[idx], output_counts=counts,
                   prompt_mask=batch.prompt_mask[idx])
    none = dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty", "output_counts",
                          "prompt_mask"))
    pick = attrs.evolve(batch, temperature=batch.temperature[idx], top_k=batch.top_k[idx], top_p=batch.top_p[idx],
                        min_p=batch.min_p[idx], banned=None, generators=[batch.generators[row]] * n,
                        logit_bias=None, processors=None, processor_errors={}, **{**none, **pen})
    return RowDistributions(pick)


@attrs.define
class SpecStats:
    steps: int = 0  # verified rows (a sequence's step with at least one draft)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted + one target token per verified row
    accepted_at: Counter = attrs.field(factory=Counter)  # draft position (0-based) -> times it stood
    proposed_at: Counter = attrs.field(factory=Counter)  # draft position -> times it was proposed

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        self.proposed_at.update(range(drafted))
        self.accepted_at.update(range(accepted))

    def record_many(self, drafted: list, accepted: list) -> None:
        """``record`` for each (drafted[n], accepted[n]) of a step's verified rows, the positions counted once
        per length instead of once per row."""
        self.steps += len(drafted)
        self.draft_tokens += sum(drafted)
        self.accepted_tokens += sum(accepted)
        self.emitted_tokens += sum(accepted) + len(accepted)
        for counts, lengths in ((self.proposed_at, drafted), (self.accepted_at, accepted)):
            hist, reach = Counter(lengths), 0  # reach: rows whose length passes position p
            for p in range(max(lengths, default=0) - 1, -1, -1):
                reach += hist[p + 1]
                counts[p] += reach

    def add(self, other: "SpecStats") -> None:
        """Count ``other``'s steps too (a request's sequences summed)."""
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        self.accepted_at.update(other.accepted_at)
        self.proposed_at.update(other.proposed_at)

    def vllm_counts(self) -> dict:
        """The counts under vLLM's names: verify steps with drafts, drafts, accepted drafts, accepted drafts per
        position, and the mean acceptance length 1 + accepted / drafts (zeros without speculation)."""
        width = max(self.proposed_at, default=-1) + 1
        return {"num_drafts": self.steps, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens,
                "num_accepted_tokens_per_pos": [self.accepted_at[i] for i in range(width)],
                "mean_acceptance_length": 1 + self.accepted_tokens / self.steps if self.steps else 0.0}

    def summary(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        per_pos = [round(self.accepted_at[i] / self.proposed_at[i], 4) for i in sorted(self.proposed_at)]
        vllm = self.vllm_counts()
        return {**vllm, "mean_acceptance_length": round(vllm["mean_acceptance_length"], 4),
                "verified_rows": self.steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": round(rate, 4),
                "acceptance_by_position": per_pos,
                "tokens_per_verified_row": round(self.emitted_tokens / self.steps, 4) if self.steps else 0.0}


def _draw(probs: torch.Tensor, gen, e=None) -> int:
    """One token drawn from probs [V] (non-negative, any scale) with gen, on gen's device; with exponentials
    e [V] given, the exponential race argmax(probs / e) instead (core/spec_accept.py draws the same way)."""
    if e is not None:
        return int((probs.float() / e).argmax())
    return int(torch.multinomial(probs.double(), 1, generator=gen).item())


def _uniform(gen, device) -> float:
    return torch.rand((), generator=gen, dtype=torch.float64, device=device).item()


def _residual_draw(p: torch.Tensor, q: torch.Tensor, gen, e=None) -> int:
    r = (p - q).clamp_min(0)
    if not r.sum() > 0:  # p <= q everywhere (p == q): a draw from p is exact
        r = p
    return _draw(r, gen, e)


def accept_row(logits: torch.Tensor, drafts: list, draft_probs: Optional[torch.Tensor], greedy: bool,
               gen: Optional[torch.Generator], noise: Optional[tuple] = None) -> list:
    """Tokens one row emits: its accepted drafts and one target token.

    logits [k + 1, V]: the target's processed logits (process_logits: what the sampler draws from) at the row's
    drafted positions and after the last draft; drafts: the k drafted tokens; draft_probs [k, V] the drafter's
    distributions, or None for a point mass at each draft; greedy: take argmaxes; gen: the row's generator
    (its seed), or None for torch's default (the caller passes the engine's when the request has none);
    noise: (u [>= k] uniforms, e [V] exponentials) to use instead of drawing from gen (the oracle of
    core/spec_accept.accept_batch, which the engine runs)."""
    k = len(drafts)
    if greedy:
        best = logits.argmax(dim=-1).tolist()
        out = []
        for j in range(k):
            if drafts[j] != best[j]:
                return out + [best[j]]
            out.append(drafts[j])
        return out + [best[k]]
    u, e = noise if noise is not None else (None, None)
    device = e.device if e is not None else gen.device if gen is not None else torch.device("cpu")
    p = logits.float().softmax(dim=-1).to(device)  # [k + 1, V]
    out = []
    for j in range(k):
        d = drafts[j]
        if draft_probs is None:
            q = torch.zeros_like(p[j])
            q[d] = 1.0
        else:
            q = draft_probs[j].float().to(device)
        qd = float(q[d])
        if qd > 0 and (float(u[j]) if u is not None else _uniform(gen, device)) < min(1.0, float(p[j, d]) / qd):
            out.append(d)
            continue
        return out + [_residual_draw(p[j], q, gen, e)]
    return out + [_draw(p[k], gen, e)]
