"""Suite-wide settings: the test models are tiny, so one torch thread is fastest, and on a shared 2-core
machine it avoids OpenMP spin-waits that cost 5-10x."""

import torch

torch.set_num_threads(1)
