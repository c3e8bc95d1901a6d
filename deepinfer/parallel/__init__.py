"""Parallel serving: expert-parallel load balancing today (eplb.py, placement.py); workers over torch.distributed
later (issue 18)."""
