"""Which MLA decode kernel the engine runs (device check): a tiny DeepSeek-V3 generates on CUDA; prints the
backend's kernel-call counts of the MLA ops (``mla_decode:tilelang`` when TileLang served them)."""

import tempfile

from deepinfer import LLM, SamplingParams
from deepinfer.testing.models import build_tiny_hf_model

d = tempfile.mkdtemp()
build_tiny_hf_model(d, "deepseek_v3")
llm = LLM(d, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16)
out = llm.generate([list(range(5, 40))], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print("tokens:", out[0].outputs[0].token_ids)
print("kernel calls:", {k: v for k, v in llm.engine.ops.kernel_calls.items() if "mla" in k})
