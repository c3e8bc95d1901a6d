"""The serving workload of `deepinfer bench` (deepinfer/bench_serving.py): arrivals, lengths, the loop, the metrics.

Nothing here asserts on a measured time: the loop is checked on a fake engine and clock, the metrics on hand-made
timelines (binary fractions, so the values are exact), the real run on counts and the row's fields.
"""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from deepinfer.bench import percentile
from deepinfer.bench_serving import (Timeline, arrival_times, delivery_gaps, draw_lengths, record_output, serve,
                                     summarize, tpot)
from deepinfer.cli import main


# --- arrivals and lengths ----------------------------------------------------------------------------------

def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_have_mean_gap_one_over_rate():
    times = arrival_times(20001, rate=4.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = _gaps(times)
    # Exponential gaps: the mean of 20000 has a relative std of 1/sqrt(20000) = 0.7%; 3% is > 4 sigma (and the
    # seed fixes the draw anyway).
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert arrival_times(50, 4.0, seed=0) == times[:50]  # reproducible from the seed
    assert arrival_times(50, 4.0, seed=1) != times[:50]


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, float("inf"), seed=3) == [0.0] * 7
    assert arrival_times(7, float("inf"), burstiness=0.2) == [0.0] * 7


@pytest.mark.parametrize("k", [0.25, 1.0, 4.0])
def test_burstiness_keeps_the_mean_and_sets_the_variance(k):
    # Gamma(shape k, scale 1/(k rate)): mean 1/rate, squared coefficient of variation 1/k. The sample CV^2 of
    # 20000 gaps is within ~4% (k = 0.25, the heaviest tail) of it: 15% leaves room.
    gaps = _gaps(arrival_times(20001, rate=2.0, burstiness=k, seed=5))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.05)
    assert statistics.variance(gaps) / mean**2 == pytest.approx(1 / k, rel=0.15)


@pytest.mark.parametrize("rate,k", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, float("inf"))])
def test_bad_rate_or_burstiness_is_refused(rate, k):
    with pytest.raises(ValueError):
        arrival_times(3, rate, k)


def test_lengths_are_uniform_inclusive_and_seeded():
    xs = draw_lengths(2000, 3, 6, seed=1, what="input")
    assert set(xs) == {3, 4, 5, 6}
    assert xs == draw_lengths(2000, 3, 6, seed=1, what="input")
    assert xs != draw_lengths(2000, 3, 6, seed=1, what="output")  # independent streams of one seed
    assert draw_lengths(4, 5, 5) == [5] * 4
    for lo, hi in [(0, 4), (5, 4)]:
        with pytest.raises(ValueError):
            draw_lengths(1, lo, hi)


# --- metrics on hand-made timelines ------------------------------------------------------------------------

def test_percentile_interpolates_linearly():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert [percentile(xs, q) for q in (0, 50, 100)] == [1.0, 2.5, 4.0]
    assert percentile(xs, 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile(xs, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile([0.25], 99) == 0.25


def test_gaps_tpot_of_one_request():
    # Tokens at 1.5, 1.75, then two in one step at 2.25, then 3.0.
    times = [1.5, 1.75, 2.25, 2.25, 3.0]
    assert delivery_gaps(times) == [0.25, 0.5, 0.75]  # one gap per delivering step, as vLLM's per chunk
    assert tpot(times) == 1.5 / 4  # every token after the first counts
    assert tpot([2.0]) is None and delivery_gaps([2.0]) == []


def test_summarize_pools_requests_and_skips_failures():
    lines = [
        Timeline(arrival=0.0, prompt_len=10, output_len=3, token_times=[0.5, 0.75, 1.0]),
        Timeline(arrival=0.5, prompt_len=20, output_len=2, token_times=[1.5, 2.0]),
        Timeline(arrival=1.0, prompt_len=30, output_len=1, token_times=[1.25]),
        Timeline(arrival=1.0, prompt_len=40, output_len=4, error="boom"),
    ]
    row = summarize(lines, duration=2.0)
    assert (row["completed"], row["failed"], row["first_error"]) == (3, 1, "boom")
    assert (row["input_tokens"], row["output_tokens"]) == (60, 6)
    assert (row["request_throughput"], row["output_tok_s"], row["total_tok_s"]) == (1.5, 3.0, 33.0)
    # TTFT 0.5, 1.0, 0.25; ITL 0.25, 0.25, 0.5; TPOT 0.25, 0.5 (the 1-token request has none); E2E 1.0, 1.5, 0.25.
    assert (row["ttft_mean_s"], row["ttft_p50_s"], row["ttft_p90_s"]) == (1.75 / 3, 0.5, 0.9)
    assert row["ttft_p99_s"] == pytest.approx(0.99, abs=1e-12)
    assert (row["itl_mean_s"], row["itl_p50_s"], row["itl_p90_s"]) == (1.0 / 3, 0.25, 0.45)
    assert (row["tpot_mean_s"], row["tpot_p50_s"], row["tpot_p99_s"]) == (0.375, 0.375, 0.4975)
    assert (row["e2e_p50_s"], row["e2e_p99_s"]) == (1.0, 1.49)


def test_summarize_with_nothing_completed_gives_none():
    row = summarize([Timeline(0.0, 5, 2, error="x")], duration=1.0)
    assert row["completed"] == 0 and row["ttft_p50_s"] is None and row["itl_mean_s"] is None


def _out(rid, tokens, error=None):
    return SimpleNamespace(request_id=rid, error=error, outputs=[SimpleNamespace(token_ids=list(tokens))])


def test_record_output_stamps_new_tokens_with_the_step_time():
    line = Timeline(0.0, 4, 3)
    record_output(line, _out("a", [7]), 1.0)
    record_output(line, _out("a", [7, 8, 9]), 2.0)  # two new tokens in one step share its time
    record_output(line, _out("a", [7, 8, 9]), 3.0)  # nothing new
    assert line.token_times == [1.0, 2.0, 2.0] and line.error is None
    record_output(line, _out("a", [], error="bad"), 4.0)
    assert line.error == "bad"


# --- the loop, on a fake engine and clock -----------------------------------------------------------------

class FakeEngine:
    """Each step takes one second of the fake clock and gives every running request one token."""

    def __init__(self, clock):
        self.clock, self.running, self.added = clock, {}, []

    def add_request(self, rid, prompt, params, stream=False):
        assert stream and params.ignore_eos and params.temperature == 0.0
        self.added.append((rid, self.clock.t, len(prompt["prompt_token_ids"])))
        self.running[rid] = [params.max_tokens, []]

    def has_unfinished(self):
        return bool(self.running)

    def step(self):
        self.clock.t += 1.0
        outs = []
        for rid, (n, toks) in list(self.running.items()):
            toks.append(len(toks))
            outs.append(_out(rid, toks))
            if len(toks) == n:
                del self.running[rid]
        return outs


class FakeClock:
    def __init__(self):
        self.t, self.sleeps = 0.0, []

    def __call__(self):
        return self.t

    def sleep(self, d):
        self.sleeps.append(d)
        self.t += d


def test_serve_adds_on_arrival_steps_and_sleeps_when_idle():
    clock = FakeClock()
    engine = FakeEngine(clock)
    prompts = [[1] * 3, [2] * 4, [3] * 5]
    lines, duration, steps = serve(engine, prompts, [2, 3, 1], [0.0, 0.5, 10.0], clock=clock, sleep=clock.sleep)
    # t=0: request 0 added; step -> t=1 (request 1, due at 0.5, waited for the step to end); it is added at t=1.
    assert engine.added == [("serve-0", 0.0, 3), ("serve-1", 1.0, 4), ("serve-2", 10.0, 5)]
    assert [ln.token_times for ln in lines] == [[1.0, 2.0], [2.0, 3.0, 4.0], [11.0]]
    assert clock.sleeps == [6.0]  # idle from t=4 to the arrival at 10
    assert (duration, steps) == (11.0, 5)
    row = summarize(lines, duration)
    assert [ln.token_times[0] - ln.arrival for ln in lines] == [1.0, 1.5, 1.0]  # TTFT from the scheduled arrival
    assert row["completed"] == 3 and row["output_tokens"] == 6


# --- end to end on a tiny model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    assert main(["init-model", "--arch", "llama", "--size", "tiny", "--out", str(d)]) == 0
    return d


SERVING_KEYS = {"model", "arch", "backend", "device", "dtype", "recipe", "max_num_seqs", "num_prompts", "workload",
                "request_rate", "burstiness", "input_len_range", "output_len_range", "seed", "sampling", "warmups",
                "steps", "completed", "failed", "duration_s", "request_throughput", "input_tokens", "output_tokens",
                "output_tok_s", "total_tok_s", "torch_version", "torch_threads", "cpu", "git_commit", "timestamp"} | {
    f"{m}_{s}_s" for m in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")}


def test_bench_serving_run_writes_a_reproducible_row(ckpt, tmp_path, capsys):
    out_file = tmp_path / "serving.jsonl"
    before = torch.get_num_threads()
    try:
        code = main([str(a) for a in ("bench", "--model", ckpt, "--num-prompts", 5, "--request-rate", 50,
                                      "--burstiness", 0.5, "--input-len-range", 4, 16, "--output-len-range", 1, 6,
                                      "--seed", 3, "--max-num-seqs", 3, "--warmups", 0, "--threads", 1,
                                      "--out", out_file)])
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TTFT" in out and "ITL" in out and "out tok/s" in out
    (row,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert SERVING_KEYS <= row.keys()
    assert (row["request_rate"], row["burstiness"], row["seed"], row["num_prompts"]) == (50.0, 0.5, 3, 5)
    assert (row["input_len_range"], row["output_len_range"], row["max_num_seqs"]) == ([4, 16], [1, 6], 3)
    assert row["sampling"] == {"temperature": 0.0, "ignore_eos": True} and row["torch_threads"] == 1
    assert (row["completed"], row["failed"]) == (5, 0)
    assert row["input_tokens"] == sum(draw_lengths(5, 4, 16, 3, "input"))
    assert row["output_tokens"] == sum(draw_lengths(5, 1, 6, 3, "output"))  # EOS ignored: the drawn lengths


def test_serve_on_the_engine_gives_each_request_its_drawn_length(ckpt):
    from deepinfer import LLM
    from deepinfer.bench import random_prompts

    llm = LLM(model=str(ckpt), max_model_len=64, max_num_seqs=2)
    out_lens = draw_lengths(4, 1, 8, seed=2, what="output")
    prompts = random_prompts(llm.tokenizer, 4, draw_lengths(4, 2, 20, seed=2, what="input"), seed=2)
    lines, duration, steps = serve(llm.engine, prompts, out_lens, arrival_times(4, 100.0, seed=2))
    assert [len(ln.token_times) for ln in lines] == out_lens and not any(ln.error for ln in lines)
    assert [ln.prompt_len for ln in lines] == [len(p) for p in prompts]
    assert all(ln.token_times == sorted(ln.token_times) and ln.token_times[0] >= ln.arrival for ln in lines)
    assert steps >= max(out_lens) and not llm.engine.has_unfinished()


def test_bench_serving_flags_are_checked(capsys):
    assert main(["bench", "--burstiness", "2"]) == 2
    assert "--burstiness needs --request-rate" in capsys.readouterr().err
    assert main(["bench", "--request-rate", "0"]) == 2
    assert "request rate" in capsys.readouterr().err
    assert main(["bench", "--output-len-range", "5", "2"]) == 2
    assert "range" in capsys.readouterr().err
