import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.detokenizer import IncrementalDetokenizer, StopChecker, decode_token
from deepinfer.testing.tokenizers import EOS, IM_END, MIN_VOCAB_SIZE, build_test_tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    # No merges: every UTF-8 byte is its own token, so multi-byte characters always split.
    return build_test_tokenizer(tmp_path_factory.mktemp("bytes"), vocab_size=MIN_VOCAB_SIZE)


def stream(detok, ids, chunks=None):
    """Feeds ids in chunks (default one at a time); returns the list of deltas."""
    sizes = chunks or [1] * len(ids)
    deltas, pos = [], 0
    for n in sizes:
        deltas.append(detok.step(ids[pos:pos + n]))
        pos += n
    assert pos == len(ids)
    return deltas


# ------------------------------------------------------------ detokenizer


@pytest.mark.parametrize("text", ["🙂", "你好", "héllo wörld 你好 🙂!", "a🙂b🚀c"])
def test_multibyte_chars_split_over_tokens_never_emit_fffd(byte_tok, text):
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # really split byte by byte
    detok = IncrementalDetokenizer(byte_tok, [])
    deltas = stream(detok, ids)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    assert detok.token_ids == ids


def test_emoji_held_back_until_complete(byte_tok):
    ids = byte_tok.encode("x🙂", add_special_tokens=False)
    assert stream(IncrementalDetokenizer(byte_tok, []), ids) == ["x", "", "", "", "🙂"]


ALPHABET = ["a", " ", "é", "你", "🙂", "\n", "def", "(x)", EOS, IM_END]


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    use_bytes=st.booleans(),
    skip=st.booleans(),
    prompt=st.sampled_from(["", "hello 你好", "<|im_start|>assistant\n"]),
)
def test_deltas_concatenate_to_full_decode(tok, byte_tok, data, use_bytes, skip, prompt):
    t = byte_tok if use_bytes else tok
    # Random ids anywhere in the vocab (incl. partial-byte and special tokens) ...
    random_ids = data.draw(st.lists(st.integers(0, t.vocab_size - 1), max_size=30))
    # ... or ids of real text, where multi-byte characters decode cleanly.
    text = data.draw(st.lists(st.sampled_from(ALPHABET), max_size=12).map("".join))
    ids = data.draw(st.sampled_from([random_ids, t.encode(text, add_special_tokens=False)]))
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(data.draw(st.integers(1, len(ids) - sum(chunks))))

    detok = IncrementalDetokenizer(t, t.encode(prompt), skip_special_tokens=skip)
    deltas = stream(detok, ids, chunks)
    full = t.decode(ids, skip_special_tokens=skip)
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)
        assert "".join(deltas) == full
    # Whatever was held back comes out on flush, so nothing is ever lost.
    assert "".join(deltas) + detok.flush() == full == detok.text
    assert detok.token_ids == ids


def test_special_tokens_kept_when_not_skipped(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.token_to_id(IM_END)]
    assert "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids)) == "hi" + IM_END
    assert "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=True), ids)) == "hi"


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("The quick brown fox")
    ids = tok.encode(" jumps over", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(detok, ids)) == " jumps over" == detok.text


def test_flush_emits_held_partial_char(byte_tok):
    ids = byte_tok.encode("ok🙂", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(byte_tok, [])
    assert "".join(stream(detok, ids)) == "ok"
    assert detok.flush() == FFFD
    assert detok.text == "ok" + FFFD
    assert detok.flush() == ""


def test_decodes_a_small_window_per_step(tok):
    calls = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode("def add(a, b):\n    return a + b\n" * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), tok.encode("prompt " * 50))
    stream(detok, ids)
    assert detok.text == tok.decode(ids)
    assert len(ids) > 200 and max(calls) <= 8


def test_decode_token(tok, byte_tok):
    assert decode_token(tok, tok.token_to_id(IM_END)) == IM_END
    hello = tok.encode("hello", add_special_tokens=False)
    assert "".join(decode_token(tok, i) for i in hello) == "hello"
    assert decode_token(tok, tok.vocab_size + 10) == ""
    assert decode_token(byte_tok, byte_tok.encode("🙂", add_special_tokens=False)[0]) == FFFD


# ------------------------------------------------------------ stop checking


def checker(**kw):
    args = dict(stop=(), stop_token_ids=(), eos_token_ids=(1,), ignore_eos=False, min_tokens=0, max_tokens=None)
    args.update(kw)
    return StopChecker(**args)


def run_stream(tok, detok, stop, ids):
    """Streams ids through detokenizer + checker as the engine does; returns (text, finish, stop_reason)."""
    for n, token_id in enumerate(ids, start=1):
        delta = detok.step([token_id])
        finish, cut, reason = stop.check(detok.text, len(delta), token_id, n)
        if finish is not None:
            return detok.text if cut is None else detok.text[:cut], finish, reason
    return detok.text, None, None


def test_stop_string_spanning_several_tokens_is_excluded(byte_tok):
    ids = byte_tok.encode("hello world STOP after", add_special_tokens=False)
    result = run_stream(byte_tok, IncrementalDetokenizer(byte_tok, []), checker(stop=["STOP"]), ids)
    assert result == ("hello world ", "stop", "STOP")


def test_stop_string_split_over_multibyte_tokens(byte_tok):
    ids = byte_tok.encode("abc 你好 def", add_special_tokens=False)
    result = run_stream(byte_tok, IncrementalDetokenizer(byte_tok, []), checker(stop=["你好"]), ids)
    assert result == ("abc ", "stop", "你好")


def test_include_stop_str_in_output(byte_tok):
    ids = byte_tok.encode("hello world STOP after", add_special_tokens=False)
    stop = checker(stop=["STOP"], include_stop_str_in_output=True)
    assert run_stream(byte_tok, IncrementalDetokenizer(byte_tok, []), stop, ids) == ("hello world STOP", "stop", "STOP")


def test_stop_string_in_the_middle_of_new_text():
    stop = checker(stop=["STOP"])
    assert stop.check("ab STOP cd", 10, 7, 1) == ("stop", 3, "STOP")
    inc = checker(stop=["STOP"], include_stop_str_in_output=True)
    assert inc.check("ab STOP cd", 10, 7, 1) == ("stop", 7, "STOP")


def test_earliest_of_two_stop_strings_wins():
    stop = checker(stop=["here", "STOP"])
    assert stop.check("x STOP y here", 13, 7, 1) == ("stop", 2, "STOP")


def test_old_text_is_not_searched_again():
    # "STOP" lies wholly in text that earlier calls already checked.
    assert checker(stop=["STOP"]).check("STOP and more", 3, 7, 5) == (None, None, None)


def test_stop_token_ids_report_the_id():
    stop = checker(stop_token_ids=[9])
    assert stop.check("abc", 1, 9, 3) == ("stop", 2, 9)  # the stop token's text is dropped
    assert checker(stop_token_ids=[9], include_stop_str_in_output=True).check("abc", 1, 9, 3) == ("stop", None, 9)
    assert stop.check("abc", 1, 8, 3) == (None, None, None)


def test_eos_with_and_without_ignore_eos():
    assert checker(eos_token_ids=(1, 4)).check("abc", 0, 4, 2) == ("stop", None, None)
    assert checker(eos_token_ids=(1, 4), ignore_eos=True).check("abc", 0, 4, 2) == (None, None, None)
    # ignore_eos does not turn off explicit stop_token_ids.
    assert checker(ignore_eos=True, stop_token_ids=[1]).check("abc", 0, 1, 2) == ("stop", None, 1)


def test_eos_through_the_stream(tok):
    ids = tok.encode("hi there", add_special_tokens=False) + [tok.eos_token_ids[0]] + tok.encode("x", add_special_tokens=False)
    stop = checker(eos_token_ids=tok.eos_token_ids)
    assert run_stream(tok, IncrementalDetokenizer(tok, []), stop, ids) == ("hi there", "stop", None)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert run_stream(tok, detok, stop, ids) == ("hi there", "stop", None)  # EOS text never shown


def test_min_tokens_suppresses_all_stops():
    stop = checker(stop=["S"], stop_token_ids=[9], min_tokens=3, max_tokens=10)
    for n in (1, 2, 3):
        assert stop.check("S", 1, 1, n) == (None, None, None)
        assert stop.check("S", 1, 9, n) == (None, None, None)
        assert stop.check("aS", 1, 7, n) == (None, None, None)
    assert stop.check("aS", 1, 1, 4)[0] == "stop"
    assert stop.check("aS", 1, 7, 4) == ("stop", 1, "S")


def test_min_tokens_does_not_block_length():
    assert checker(min_tokens=5, max_tokens=5).check("abc", 1, 1, 5) == ("length", None, None)


def test_max_tokens_gives_length():
    stop = checker(max_tokens=3)
    assert stop.check("ab", 1, 7, 2) == (None, None, None)
    assert stop.check("abc", 1, 7, 3) == ("length", None, None)
    assert checker(max_tokens=None).check("abc", 1, 7, 10_000) == (None, None, None)


def test_stop_beats_length_on_the_last_token():
    assert checker(max_tokens=3).check("abc", 0, 1, 3) == ("stop", None, None)
    assert checker(stop=["c"], max_tokens=3).check("abc", 1, 7, 3) == ("stop", 2, "c")


@pytest.mark.parametrize(
    "kw, field",
    [({"stop": [""]}, "stop"), ({"min_tokens": -1}, "min_tokens"), ({"max_tokens": 0}, "max_tokens"),
     ({"stop_token_ids": [-3]}, "stop_token_ids")],
)
def test_invalid_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        checker(**kw)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcS你", max_size=40),
    stops=st.lists(st.text(alphabet="abcS你", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_stop_strings_found_at_first_appearance(text, stops, data):
    """Fed in random chunks, the checker fires on the first chunk after which some stop string
    appears in the text, and the kept text contains no stop string."""
    stop = checker(stop=stops)
    pos, n = 0, 0
    while pos < len(text):
        size = data.draw(st.integers(1, len(text) - pos))
        pos += size
        n += 1
        finish, cut, reason = stop.check(text[:pos], size, 7, n)
        seen = any(s in text[:pos] for s in stops)
        assert (finish == "stop") == seen
        if finish:
            kept = text[:cut]
            assert reason in stops and text[cut:].startswith(reason)
            assert not any(s in kept for s in stops)
            return
    assert not any(s in text for s in stops)
