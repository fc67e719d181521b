"""Evidence a later run reuses: the probe, the stepping stones and the original's losses of an identical earlier run.

None of them depends on what is trained afterwards, only on the original model, the data it read and
the settings that produced it: a run that changes the training (steps, learning rate, the control,
retention) computes the same numbers again, about a quarter of the default run. So each is stored under a
key that hashes everything it depends on: every weight and the config of the model, every row of the
data, its settings, the versions of torch and transformers, and the source of this package (a code
change never reuses an entry). A hit gives back what was stored, bit for bit; an entry that cannot be
read is skipped with a warning and the evidence is computed afresh.

Entries are `hf_depthgrow.storage` entries: verified on every read, written whole, an unverified one moved
aside (never deleted) and computed afresh; a write that fails warns once and the run goes on. Nothing here
deletes an entry or anything else: clear the cache by removing its folder. The folder: `RunConfig.evidence_cache`, whose `"auto"` is
`$HF_DEPTHGROW_EVIDENCE_CACHE` where set (a folder, or `none`: off), else `evidence/` under the package's
cache root (`$HF_DEPTHGROW_CACHE`, else `~/.cache/hf_depthgrow`, where the SmolLM2 copy lives too);
`"none"` switches it off.

Example:
    ```python
    >>> from hf_depthgrow.storage import rows_fingerprint, weights_fingerprint
    >>> cache = EvidenceCache.from_setting("auto")
    >>> parts = {"model": weights_fingerprint(model), "train": rows_fingerprint(train_rows), "batch_size": 8}
    >>> entry = cache.load("probe", parts)                  # None on a miss
    >>> cache.store("probe", parts, {"signal": [0.1, 0.2]}) # the key, or None where it cannot write
    ```
"""

from __future__ import annotations

import os
from pathlib import Path

from ..storage import EntryStore

__all__ = ["EVIDENCE_ENV", "EvidenceCache", "default_root"]

EVIDENCE_ENV = "HF_DEPTHGROW_EVIDENCE_CACHE"
_OFF = ("none", "off", "null", "0", "false")


def default_root() -> Path | None:
    """`$HF_DEPTHGROW_EVIDENCE_CACHE` (`none`: off), else `evidence/` under `hf_depthgrow.data.models.default_cache_root()`."""
    from ..data.models import default_cache_root

    env = os.environ.get(EVIDENCE_ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    return default_cache_root() / "evidence"


class EvidenceCache(EntryStore):
    """The run's evidence under `root` (`None`: switched off), an `EntryStore` named in its warnings as the evidence cache.

    Args:
        root: The cache folder; created on the first `store`.
    """

    label = "evidence cache"  # how its warnings name it

    @classmethod
    def from_setting(cls, setting: str | None) -> "EvidenceCache":
        """`"auto"` (`default_root()`), `None` / `"none"` (off) or a folder."""
        if setting is None or setting.strip().lower() in _OFF:
            return cls(None)
        return cls(default_root() if setting == "auto" else Path(setting).expanduser())
