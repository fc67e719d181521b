"""Test-suite settings."""

import os

import pytest
import torch

# The evidence cache (hf_depthgrow.pipeline.evidence_cache) would make a test's run depend on which runs came
# before it, and write under ~/.cache: off for the suite; its own tests switch it on in a temporary folder.
os.environ["HF_DEPTHGROW_EVIDENCE_CACHE"] = "none"

# The models here are tiny (or one 135M model on short inputs): extra threads buy nothing, and on a
# shared 2-core machine OpenMP threads spinning against each other made generation several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for one test module, as on CI's 2 cores (two single-CPU trials, or one trial of two workers)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
