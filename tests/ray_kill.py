"""Killing a Tune trial mid-way, for the tests that check it resumes from its checkpoint."""

from __future__ import annotations

import pytest


def kill_after_second_checkpoint(storage, killed: list, timeout: float = 180.0, title: str = "ImplicitFunc") -> None:
    """SIGKILL a process titled `title` (the Tune trial process, ray::ImplicitFunc, by default; a Ray Train worker is
    ray::RayTrainWorker) once trial 0's second checkpoint is in `storage`.

    The second, not the first: the trial went on after its first report only once the driver had taken it (Tune's
    function trainables wait for that), so the driver knows a checkpoint to retry from.
    """
    import os
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not killed:
        if any(storage.glob("*/*index=0*/checkpoint_000001")):
            for proc in psutil.Process().children(recursive=True):  # the local Ray's processes, not another Ray's
                try:
                    if title in " ".join(proc.cmdline()):
                        os.kill(proc.pid, signal.SIGKILL)
                        killed.append(proc.pid)
                        return
                except psutil.Error:
                    continue
        time.sleep(0.02)
