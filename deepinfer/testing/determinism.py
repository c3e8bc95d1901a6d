"""The batch-invariance check, shared by tests/test_batch_invariant.py and the GPU tests and scripts: one target
request run among random traffic, its output reduced to what must be bitwise equal (tokens and per-step
logprobs), and ``scenario_outputs``: the target alone (cold, then a prefix hit), among N random requests at a
random position (cold, and with a hit), and with chunked prefill, greedy and seeded; ``differing`` names the
scenarios whose output is not the cold run's.

``Output`` holds the target's token ids and a float tensor of its per-step logprobs (the chosen token's, then
every entry in rank order, +inf padding; their token ids alongside); two runs agree when ``same`` holds (torch.equal on
the values, so -0.0 == 0.0). ``to_json``/``from_json`` carry an output across processes
exactly (floats as hex), for the restart check; nothing is pickled.
"""

from __future__ import annotations

import json
import random
from typing import Optional

import attrs
import torch

from ..core.params import SamplingParams


@attrs.frozen
class Output:
    token_ids: tuple
    logprobs: torch.Tensor  # [steps, 1 + n] float64 holding float32 values: chosen token's, then the top-n
    ranked_ids: tuple  # per step, ((token id, rank), ...) of the logprob entries in rank order

    def same(self, other: "Output") -> bool:
        return (self.token_ids == other.token_ids and self.ranked_ids == other.ranked_ids
                and self.logprobs.shape == other.logprobs.shape and torch.equal(self.logprobs, other.logprobs))

    def to_json(self) -> str:
        return json.dumps({"token_ids": list(self.token_ids), "ranked_ids": [list(r) for r in self.ranked_ids],
                           "logprobs": [[float(x).hex() for x in row] for row in self.logprobs.tolist()]})

    @classmethod
    def from_json(cls, text: str) -> "Output":
        d = json.loads(text)
        rows = [[float.fromhex(x) for x in row] for row in d["logprobs"]]
        lp = torch.tensor(rows, dtype=torch.float64) if rows else torch.zeros(0, 0, dtype=torch.float64)
        return cls(tuple(d["token_ids"]), lp, tuple(tuple(tuple(x) for x in r) for r in d["ranked_ids"]))

    def key(self) -> str:
        """A hashable digest of everything ``same`` compares (for counting distinct outputs)."""
        return self.to_json()


def output_of(request_output) -> Output:
    """The target's Output from a RequestOutput (the request must ask for logprobs)."""
    out = request_output.outputs[0]
    if out.logprobs is None:
        raise ValueError("the target request must ask for logprobs (SamplingParams.logprobs >= 0)")
    rows, ranked = [], []
    for tok, entry in zip(out.token_ids, out.logprobs):
        items = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0]))
        rows.append([entry[tok].logprob] + [lp.logprob for _, lp in items])
        ranked.append(tuple((t, lp.rank) for t, lp in items))
    width = max((len(r) for r in rows), default=0)
    lp = torch.tensor([r + [float("inf")] * (width - len(r)) for r in rows], dtype=torch.float64) if rows \
        else torch.zeros(0, 0, dtype=torch.float64)
    return Output(tuple(out.token_ids), lp, tuple(ranked))


def random_traffic(rng: random.Random, n: int, vocab: int, max_prompt: int = 60, max_tokens: int = 16,
                   lo_token: int = 3) -> tuple:
    """n random requests: prompts of 1..max_prompt tokens (ids in [lo_token, vocab)) and mixed sampling (greedy,
    seeded, unseeded, top-k/top-p, 1..max_tokens tokens, some asking for logprobs). Returns (prompts, params)."""
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(lo_token, vocab) for _ in range(rng.randint(1, max_prompt))])
        kind = rng.random()
        kw = dict(max_tokens=rng.randint(1, max_tokens), ignore_eos=True)
        if kind < 0.4:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]))
            if kind < 0.7:
                kw["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            kw["logprobs"] = rng.randint(0, 3)
        params.append(SamplingParams(**kw))
    return prompts, params


def run_among(llm, target_prompt, target_params: SamplingParams, others: int, position: Optional[int],
              rng: random.Random, vocab: int, max_prompt: int = 60, max_tokens: int = 16) -> Output:
    """Generate the target among ``others`` random requests, placed at ``position`` (None: drawn), in one
    generate call (so they share steps); returns the target's Output."""
    prompts, params = random_traffic(rng, others, vocab, max_prompt, max_tokens)
    pos = rng.randint(0, others) if position is None else position
    prompts.insert(pos, list(target_prompt))
    params.insert(pos, target_params)
    return output_of(llm.generate(prompts, params, use_tqdm=False)[pos])


DEMO_VOCAB = 4096
TARGET_LEN = 200  # > (layers + 1) * window + a block: exact SWA replay can use a prefix hit of the demo model
TRAFFIC = dict(max_prompt=40, max_tokens=8)  # the other requests: prompts of 1..40 tokens, 1..8 new tokens
GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
SEEDED = dict(max_tokens=6, temperature=0.9, top_p=0.95, seed=1234, logprobs=2, ignore_eos=True)


def target_prompt(seed: int = 7, n: int = TARGET_LEN, vocab: int = DEMO_VOCAB) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def scenario_llm(recipe: str, dtype: str, device: str = "cpu", model=None, **kw):
    """The engine the scenarios run on: ``model`` (None: the bundled demo), 128 sequences, 1024 KV blocks."""
    from .. import LLM

    return LLM(model=model, recipe=recipe, dtype=dtype, device=device, num_kv_blocks=1024, max_num_seqs=128, **kw)


def scenario_outputs(recipe: str, dtype: str, model=None, vocab: int = DEMO_VOCAB, others=((1, 127), (9,)),
                     target_len: int = TARGET_LEN, device: str = "cpu") -> dict:
    """{"greedy" | "seeded": {scenario: Output}}: the target (``target_prompt``) greedy among others[0] random
    requests, seeded among others[1]. With the deterministic recipe the prefix-hit scenarios must really hit
    (asserted: else they would prove nothing)."""
    rng = random.Random(11)
    target = target_prompt(n=target_len, vocab=vocab)
    llm = scenario_llm(recipe, dtype, device, model)
    chunked = scenario_llm(recipe, dtype, device, model, max_num_batched_tokens=48)  # the target's prefill in chunks
    results = {}
    for (kind, kw), among in zip((("greedy", GREEDY), ("seeded", SEEDED)), others):
        sp = SamplingParams(**kw)
        got = {}
        llm.reset_prefix_cache()
        got["alone, cold"] = output_of(llm.generate([target], sp, use_tqdm=False)[0])
        hits = llm.cache_stats().get("hit_tokens", 0)
        got["alone, prefix hit"] = output_of(llm.generate([target], sp, use_tqdm=False)[0])
        if recipe == "deterministic":
            assert llm.cache_stats()["hit_tokens"] > hits, f"no prefix hit happened: {llm.cache_stats()}"
        for n in among:
            llm.reset_prefix_cache()
            got[f"among {n}, cold"] = run_among(llm, target, sp, n, None, rng, vocab, **TRAFFIC)
        got[f"among {among[-1]}, prefix hit"] = run_among(llm, target, sp, among[-1], None, rng, vocab, **TRAFFIC)
        chunked.reset_prefix_cache()
        got["chunked prefill, among 3"] = run_among(chunked, target, sp, 3, None, rng, vocab, **TRAFFIC)
        results[kind] = got
    return results


def differing(results: dict) -> list:
    """The scenarios of ``scenario_outputs`` whose output is not bitwise the cold run's alone, as "kind: name"."""
    bad = []
    for kind, got in results.items():
        base = got["alone, cold"]
        bad += [f"{kind}: {k}" for k, out in got.items() if not out.same(base)]
    return bad
