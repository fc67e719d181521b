"""Test-suite settings."""

import torch

# The models here are tiny (or one 135M model on short inputs): extra threads buy nothing, and on a
# shared 2-core machine OpenMP threads spinning against each other made generation several times slower.
torch.set_num_threads(1)
