#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): install the carried wheels, then the GPU tests.
# Usage (from the repo root there): bash scripts/device_check.sh [pytest args]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider "$@"
