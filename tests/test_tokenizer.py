import json
import shutil

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.testing.tokenizers import (
    BOS, DEFAULT_CHAT_TEMPLATE, EOS, IM_END, IM_START, MIN_VOCAB_SIZE, PAD, build_test_tokenizer,
)
from deepinfer.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🙂"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_test_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def copy_dir(src, tmp_path, **json_files):
    """A copy of a tokenizer dir with some JSON files replaced (None deletes the file)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    for name, content in json_files.items():
        path = dst / f"{name}.json"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(content))
    return dst


def edit_config(src, tmp_path, **changes):
    config = json.loads((src / "tokenizer_config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            config.pop(k, None)
        else:
            config[k] = v
    return copy_dir(src, tmp_path, tokenizer_config=config)


# ------------------------------------------------------------------ building


def test_builder_vocab_exact_and_special_ids(tok):
    assert tok.vocab_size == 512
    ids = [tok.token_to_id(t) for t in (BOS, EOS, PAD, IM_START, IM_END)]
    assert tok.bos_token_id == ids[0]
    assert tok.eos_token_ids == (ids[1],)
    assert tok.pad_token_id == ids[2]
    assert tok.all_special_ids == frozenset(ids)


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 1024])
def test_builder_vocab_size_is_exact(tmp_path, vocab_size):
    assert build_test_tokenizer(tmp_path, vocab_size).vocab_size == vocab_size


def test_builder_vocab_never_exceeds_request_when_corpus_is_small(tmp_path):
    t = build_test_tokenizer(tmp_path, vocab_size=5000, corpus=["tiny corpus"])
    assert MIN_VOCAB_SIZE <= t.vocab_size < 5000


def test_builder_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_test_tokenizer(tmp_path, vocab_size=100)


def test_builder_is_deterministic(tmp_path):
    build_test_tokenizer(tmp_path / "a")
    build_test_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tiny_vocab_splits_multibyte_chars_into_byte_tokens(tmp_path):
    t = build_test_tokenizer(tmp_path, vocab_size=MIN_VOCAB_SIZE)
    assert len(t.encode("🙂", add_special_tokens=False)) == 4
    assert len(t.encode("你", add_special_tokens=False)) == 3


# ------------------------------------------------------------ encode/decode


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tok):
    ids = tok.encode(f"{IM_START}user\nhi{IM_END}")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}{IM_START}user\nhi{IM_END}"


def test_bos_added_once(tok):
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[1:] == tok.encode("hello", add_special_tokens=False)
    assert tok.encode(BOS + "hello") == ids  # text already carries the BOS string


def test_bos_not_doubled_after_chat_template(tok):
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert prompt.startswith(BOS)
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_no_bos_when_checkpoint_does_not_ask(tmp_path):
    t = build_test_tokenizer(tmp_path, add_bos=False)
    assert not t.add_bos_token
    assert t.encode("hello") == t.encode("hello", add_special_tokens=False)
    assert t.bos_token_id is not None  # the token exists; it just is not added


def test_bos_from_post_processor_when_config_is_silent(tok_dir, tmp_path):
    t = Tokenizer.from_dir(edit_config(tok_dir, tmp_path, add_bos_token=...))
    assert t.encode("hi")[0] == t.bos_token_id


def test_config_flag_overrides_post_processor(tok_dir, tmp_path):
    t = Tokenizer.from_dir(edit_config(tok_dir, tmp_path, add_bos_token=False))
    assert t.encode("hi") == t.encode("hi", add_special_tokens=False)


def test_bos_found_from_post_processor_without_tokenizer_config(tok_dir, tmp_path):
    t = Tokenizer.from_dir(copy_dir(tok_dir, tmp_path, tokenizer_config=None))
    assert t.bos_token_id == t.token_to_id(BOS)
    assert t.bos_token == BOS
    assert t.encode("hi")[0] == t.bos_token_id
    assert t.eos_token_ids == ()


def test_eos_ids_merged_from_generation_and_model_config(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path, generation_config={"eos_token_id": [4, 1]}, config={"eos_token_id": 2})
    assert Tokenizer.from_dir(d).eos_token_ids == (1, 4, 2)


def test_eos_id_from_generation_config_int_and_text_config(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path, generation_config={"eos_token_id": 3}, config={"text_config": {"eos_token_id": 4}})
    assert Tokenizer.from_dir(d).eos_token_ids == (1, 3, 4)


def test_null_bos_in_tokenizer_config_is_not_overridden_by_model_config(tok_dir, tmp_path):
    d = edit_config(tok_dir, tmp_path, bos_token=None, add_bos_token=False)
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0}))
    t = Tokenizer.from_dir(d)
    assert t.bos_token_id is None
    assert t.encode("hi") == t.encode("hi", add_special_tokens=False)


def test_special_token_as_added_token_dict(tok_dir, tmp_path):
    d = edit_config(tok_dir, tmp_path, eos_token={"content": IM_END, "special": True})
    assert Tokenizer.from_dir(d).eos_token_ids == (Tokenizer.from_dir(tok_dir).token_to_id(IM_END),)


def test_unknown_eos_token_names_the_field(tok_dir, tmp_path):
    with pytest.raises(ValueError, match="eos_token='<nope>'"):
        Tokenizer.from_dir(edit_config(tok_dir, tmp_path, eos_token="<nope>"))


def test_missing_tokenizer_json_names_the_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_bad_config_json_names_the_file(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_dir(d)


def test_convert_ids_to_tokens(tok):
    ids = tok.encode("hello", add_special_tokens=False)
    assert "".join(tok.convert_ids_to_tokens(ids)) == "hello"
    assert tok.convert_ids_to_tokens([tok.bos_token_id]) == [BOS]
    with pytest.raises(ValueError, match="token id 99999"):
        tok.convert_ids_to_tokens([99999])


# ------------------------------------------------------------ chat template


def test_chat_template_with_and_without_generation_prompt(tok):
    with_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    without = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    expected = f"{BOS}{IM_START}system\nbe brief{IM_END}\n{IM_START}user\nhi 🙂{IM_END}\n"
    assert without == expected
    assert with_prompt == expected + f"{IM_START}assistant\n"


def test_no_chat_template_is_a_clear_error(tmp_path):
    t = build_test_tokenizer(tmp_path, chat_template=None)
    assert t.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template(MESSAGES, tokenize=False)
    # An explicit override still works.
    assert t.apply_chat_template(MESSAGES, tokenize=False, chat_template="{{ messages|length }}") == "2"


def test_chat_template_override_and_extra_kwargs(tok):
    out = tok.apply_chat_template(
        MESSAGES, chat_template="{{ eos_token }}|{{ flavour }}|{{ add_generation_prompt }}", flavour="x",
        add_generation_prompt=False, tokenize=False,
    )
    assert out == f"{EOS}|x|False"


def test_named_chat_templates(tok_dir, tmp_path):
    templates = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools|length }}"}]
    t = Tokenizer.from_dir(edit_config(tok_dir, tmp_path, chat_template=templates))
    assert t.apply_chat_template(MESSAGES, tokenize=False) == "D"
    assert t.apply_chat_template(MESSAGES, tokenize=False, tools=[{"name": "f"}]) == "T1"
    assert t.apply_chat_template(MESSAGES, tokenize=False, chat_template="tool_use", tools=[]) == "T0"


def test_chat_template_from_jinja_file(tok_dir, tmp_path):
    d = edit_config(tok_dir, tmp_path, chat_template=...)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES, tokenize=False) == "[system][user]"


def test_chat_template_helpers(tok):
    assert tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{{ {'a': '<b>'}|tojson }}") == '{"a": "<b>"}'
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{{ raise_exception('only user turns') }}")
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert tok.apply_chat_template(MESSAGES, tokenize=False, chat_template=loop) == "system"
    gen = "{% generation %}{{ messages[0].content }}{% endgeneration %}"
    assert tok.apply_chat_template(MESSAGES, tokenize=False, chat_template=gen) == "be brief"


def test_chat_template_trims_blocks_like_hf(tok):
    template = "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}"
    assert tok.apply_chat_template(MESSAGES, tokenize=False, chat_template=template) == "    system\n    user\n"


def test_chat_template_is_sandboxed(tok):
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{% set x = messages.append(1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{% set ns = namespace(__x=1) %}")


def test_chat_template_syntax_error_is_value_error(tok):
    with pytest.raises(ValueError, match="syntax error"):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="{% for %}")


def test_matches_transformers(tok_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    text = "héllo wörld 你好 🙂 def f(x):\n    return x  # done"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        )
    assert DEFAULT_CHAT_TEMPLATE == hf.chat_template


# ------------------------------------------------------------ transformers' calls, on the demo tokenizer


def test_demo_tokenizer_answers_like_transformers():
    from collections.abc import Mapping
    from pathlib import Path

    import torch

    import deepinfer

    transformers = pytest.importorskip("transformers")
    demo = Path(deepinfer.__file__).parent / "assets" / "demo"
    hf = transformers.AutoTokenizer.from_pretrained(str(demo))
    tok = Tokenizer.from_dir(demo)
    texts = ["def f(x):\n    return x", "héllo 🙂 <|im_end|>", "a"]
    for t in texts:
        enc = tok(t)
        assert dict(enc) == dict(hf(t)) and enc.input_ids == enc["input_ids"]
        for special in (True, False):
            assert tok.encode(t, add_special_tokens=special) == hf.encode(t, add_special_tokens=special)
            assert tok(t, add_special_tokens=special)["input_ids"] == hf(t, add_special_tokens=special)["input_ids"]
        ids = hf.encode(t)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert tok.decode(torch.tensor(ids)) == tok.decode(ids) and tok.decode(ids[1]) == hf.decode(ids[1])
    assert dict(tok(texts)) == dict(hf(texts))
    ours, theirs = tok(texts, padding=True, return_tensors="pt"), hf(texts, padding=True, return_tensors="pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(ValueError, match="padding=True"):
        tok(texts, return_tensors="pt")
    rows = [hf.encode(t) for t in texts]
    assert tok.batch_decode(rows, skip_special_tokens=True) == hf.batch_decode(rows, skip_special_tokens=True)
    assert tok.batch_decode(ours["input_ids"][:1]) == [tok.decode(ours["input_ids"][0])]

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "x"}]
    for kw in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": False}):
        assert tok.apply_chat_template(msgs, tokenize=False, **kw) == hf.apply_chat_template(msgs, tokenize=False, **kw)
        want = hf.apply_chat_template(msgs, **kw)  # transformers 5: a BatchEncoding; 4: the ids
        want = want["input_ids"] if isinstance(want, Mapping) else want
        assert tok.apply_chat_template(msgs, **kw) == want
        assert tok.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)["input_ids"] == want

    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id)
    assert len(tok) == len(hf) and tok.vocab_size == hf.vocab_size
    assert tok.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert tok.convert_ids_to_tokens([5, 300]) == hf.convert_ids_to_tokens([5, 300])
    assert tok.convert_tokens_to_ids(["<|im_end|>", "!"]) == hf.convert_tokens_to_ids(["<|im_end|>", "!"])
    assert tok.get_vocab() == hf.get_vocab()
