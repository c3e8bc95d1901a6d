"""Builds a small, real byte-level BPE tokenizer directory for tests.

Trained in milliseconds on a fixed corpus, so tests get a tokenizer with the same
moving parts as a real checkpoint (byte-level merges, special tokens, a chat template,
characters split across tokens) without downloading anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from deepinfer.tokenizer import Tokenizer

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
# Every byte is a token of its own, so a vocab this small has no merges at all.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Inference engines batch many requests together to keep the accelerator busy.",
    "Once upon a time there was a little robot who wanted to learn how to write poems.",
    "She said that the weather would be sunny tomorrow, but it rained all afternoon.",
    "Please answer the question in one short sentence and then stop.",
    "Numbers like 0, 1, 2, 3, 42, 100, 2024 and 3.14159 appear in text too.",
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.blocks = []\n",
    "for i in range(10):\n    print(f\"value {i} is {i * i}\")\n",
    "import torch\nx = torch.zeros(4, 8)\ny = x @ x.T\nprint(y.shape)\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "with open(\"data.json\") as f:\n    config = json.load(f)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "result = [x for x in items if x is not None]\n",
    "héllo wörld 你好 🙂",
    "Café crème, naïve façade, Zürich, São Paulo, Ελληνικά, Русский текст.",
    "你好，世界。今天天气很好。🙂🚀✨",
    "The attention layer reads keys and values from the paged cache.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "User: what is two plus two?\nAssistant: two plus two is four.",
    "Scheduling decides which sequences run in each step; preemption frees memory when blocks run out.",
    "Mountains, rivers, forests and deserts cover different parts of every continent on Earth.",
    "Yesterday morning my grandmother baked bread, cookies, and a chocolate cake for the family.",
    "Quantization stores weights with fewer bits, trading a little accuracy for speed and memory.",
    "The museum exhibition featured sculptures, paintings, photographs, and ancient manuscripts.",
    "Jupiter, Saturn, Uranus and Neptune are giant planets far beyond the orbit of Mars.",
    "async def fetch(session, url):\n    async with session.get(url) as response:\n        return await response.text()\n",
    "try:\n    value = int(text)\nexcept ValueError as error:\n    raise RuntimeError(f\"bad value: {text!r}\") from error\n",
    "@dataclass\nclass Request:\n    prompt: str\n    max_tokens: int = 16\n    temperature: float = 1.0\n",
    "assert len(tokens) == expected_length, \"tokenizer produced the wrong number of tokens\"\n",
    "lambda item: sorted(dictionary.items(), key=operator.itemgetter(1), reverse=False)",
    "HTTP/1.1 200 OK\nContent-Type: application/json\n\n{\"choices\": [{\"index\": 0, \"text\": \"ok\"}]}",
    "Kubernetes, PostgreSQL, JavaScript, TypeScript, WebAssembly, GraphQL and Elasticsearch.",
    "Photosynthesis converts sunlight, water, and carbon dioxide into glucose and oxygen.",
)


def build_test_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    add_bos: bool = True,
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer, writes it (and its config) to out_dir, and loads it.

    The vocab has exactly vocab_size entries when the corpus has enough merges to offer,
    never more. Same arguments give a byte-identical tokenizer.json.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    texts = list(_CORPUS if corpus is None else corpus)

    backend = _HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    if add_bos:
        # Also in the post-processor, so HF's loaders of this directory add BOS the same way.
        bos_id = backend.token_to_id(BOS)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(root / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return Tokenizer.from_dir(root)
