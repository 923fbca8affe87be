import os

import pytest
import torch

# The suite runs on small CPUs; two threads are plenty and keep runs repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
