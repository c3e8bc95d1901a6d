"""Device debug helper: run the tiny-model decode with and without CUDA graphs, each config in its own process."""
import subprocess, sys

CODE = r'''
import sys, tempfile, torch, traceback
from deepinfer.testing.models import build_tiny_hf_model
from deepinfer import LLM, SamplingParams
kw = eval(sys.argv[1]); n = int(sys.argv[2])
d = tempfile.mkdtemp(); build_tiny_hf_model(d, "llama")
prompts = [list(range(5, 5 + k)) for k in (3, 17, 40, 9, 26)][:n]
llm = LLM(d, device="cuda", num_kv_blocks=64, block_size=4, **kw)
try:
    out = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    print("RESULT", kw, n, "OK", llm.backend_name, out[0].outputs[0].token_ids[:8], flush=True)
except Exception as e:
    print("RESULT", kw, n, "FAILED", llm.backend_name, type(e).__name__, str(e)[:200], flush=True)
'''
for kw in ("dict(enforce_eager=True, backend='reference')", "dict(enforce_eager=True)",
           "dict(backend='reference')", "dict()"):
    for n in ("1", "5"):
        r = subprocess.run([sys.executable, "-c", CODE, kw, n], capture_output=True, text=True,
                           env={**__import__("os").environ, "CUDA_LAUNCH_BLOCKING": "1"})
        lines = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith("RESULT") or "Assertion" in l]
        print("\n".join(lines[:3]) or (r.stderr[-500:]), flush=True)
