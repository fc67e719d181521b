"""Test-suite settings."""

import os

import torch

# The evidence cache (hf_depthgrow.pipeline.evidence_cache) would make a test's run depend on which runs came
# before it, and write under ~/.cache: off for the suite; its own tests switch it on in a temporary folder.
os.environ["HF_DEPTHGROW_EVIDENCE_CACHE"] = "none"

# The models here are tiny (or one 135M model on short inputs): extra threads buy nothing, and on a
# shared 2-core machine OpenMP threads spinning against each other made generation several times slower.
torch.set_num_threads(1)
