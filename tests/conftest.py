import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def rng_seed():
    """A fresh seed per test run; printed on failure by pytest's captured output."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed
