"""Suite-wide settings: the test models are tiny, so one torch thread is fastest, and on a shared 2-core
machine it avoids OpenMP spin-waits that cost 5-10x. Triton's interpreter on machines without CUDA."""

import os

import pytest
import torch
from hypothesis import settings

# Hypothesis draws the same examples on every run (a CI failure reproduces, and one run's luck cannot fail a
# clean clone); DEEPINFER_HYPOTHESIS_RANDOM=1 draws fresh ones to explore (and found real bugs that way).
settings.register_profile("deepinfer", derandomize=not os.environ.get("DEEPINFER_HYPOTHESIS_RANDOM"))
settings.load_profile("deepinfer")

# Without CUDA the nvidia backend's Triton kernels run in Triton's interpreter, which must be chosen before
# anything imports triton (transformers does, so a test module cannot rely on being first).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def spec_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (seed 3) for the speculative-decoding tests, built once per process."""
    from deepinfer.testing.models import build_tiny_hf_model

    d = tmp_path_factory.mktemp("spec_llama")
    build_tiny_hf_model(d, "llama", seed=3)
    return str(d)
