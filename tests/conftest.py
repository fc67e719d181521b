"""Test-suite settings."""

import gc
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


_frozen_at = [None]


def pytest_collection_finish(session):
    _freeze_long_lived()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # At a module's first test the previous module's fixtures are torn down: what is left is long-lived
    # (imports, session fixtures), including what earlier tests imported lazily.
    module = getattr(item, "module", None)
    if module is not _frozen_at[0]:
        _frozen_at[0] = module
        _freeze_long_lived()


def _freeze_long_lived() -> None:
    """Move what is loaded now (torch, transformers, test and benchmark modules) out of the collector's sight.

    Half a million long-lived objects made each full `gc.collect()` (after every comparison trial, and
    Python's own periodic full collections) cost 0.2 s of scanning objects that are never garbage.
    Garbage is collected first, so none is frozen; everything a test creates is collected as before.
    """
    gc.collect()
    gc.freeze()
