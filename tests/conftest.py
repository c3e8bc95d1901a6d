"""Suite-wide settings: the test models are tiny, so one torch thread is fastest and keeps runs stable."""

import torch

torch.set_num_threads(1)
