"""Output folders: one writer at a time (a lock beside the folder), probe/eval follow the overwrite rule,
what a killed run left is put back or removed, written files get the usual mode, old flag spellings warn and work."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_depthgrow.cli import main
from hf_depthgrow.pipeline.output import MARKER, check_output_dir, command_scope, staged_output
from hf_depthgrow.testing import tiny_model

FORK = multiprocessing.get_context("fork")
IN_USE = "is being written by another hf-depthgrow process"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny saved Llama with a tokenizer, a grown copy, and a text file it can read."""
    from hf_depthgrow import grow_depth, save_pretrained
    from hf_depthgrow.testing import byte_level_tokenizer

    root = tmp_path_factory.mktemp("saved")
    text = "the quick brown fox jumps over the lazy dog. " * 60
    (root / "data.txt").write_text(text)
    model = tiny_model("llama", vocab_size=300)  # room for the byte-level tokenizer's 259+ tokens
    tokenizer = byte_level_tokenizer([text], vocab_size=300)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    save_pretrained(grow_depth(tiny_model("llama", vocab_size=300), [1], block="native", init="random"), root / "grown", tokenizer=tokenizer)
    return root


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _wait_for_holder(out: Path, pid: int, timeout: float = 120) -> None:
    record = out.parent / f".{out.name}.lock.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if json.loads(record.read_text())["pid"] == pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no lock record of pid {pid} for {out}")


def _leftover_locks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".lock" in p.name)


def test_two_grows_into_one_folder_one_succeeds_the_other_names_it(saved, tmp_path, monkeypatch, capsys):
    """Before: both exited 0 and one model was lost. Now the second fails at once, exit 2, naming the first."""
    import hf_depthgrow.hub.serialization as serialization

    release = FORK.Event()
    real_save = serialization.save_pretrained

    def slow_save(*args, **kwargs):  # the first grow holds the folder until the test lets it save
        release.wait(120)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(serialization, "save_pretrained", slow_save)
    out = tmp_path / "g"
    argv = ["grow", "--model", str(saved / "model"), "--positions", "1", "--output-dir", str(out)]
    first = FORK.Process(target=lambda: sys.exit(main(argv)))
    first.start()
    try:
        _wait_for_holder(out, first.pid)
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"hf-depthgrow grow: {out} {IN_USE} (pid {first.pid}: hf-depthgrow grow --model ")
        assert "\n" not in err and not out.exists()
    finally:
        release.set()
        first.join(120)
    assert first.exitcode == 0
    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    assert _leftover_locks(tmp_path) == []  # the lock and its record go with the command


def test_compare_into_a_folder_being_written_fails_at_once(saved, tmp_path, capsys):
    """`compare` takes the lock through check_output_dir: no edit of the command needed."""
    release = FORK.Event()
    out = tmp_path / "cc"

    def hold():
        with command_scope("hf-depthgrow compare --output-dir cc"):
            check_output_dir(out, overwrite=False)
            release.wait(120)

    holder = FORK.Process(target=hold)
    holder.start()
    try:
        _wait_for_holder(out, holder.pid)
        assert main(["compare", "--model", str(saved / "model"), "--data", str(saved / "data.txt"), "--output-dir", str(out)]) == 2
        assert capsys.readouterr().err.strip().startswith(
            f"hf-depthgrow compare: {out} {IN_USE} (pid {holder.pid}: hf-depthgrow compare --output-dir cc)"
        )
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0 and _leftover_locks(tmp_path) == []


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    """The OS lock dies with its process; a stale lock file and record are taken over."""
    out = tmp_path / "o"
    (tmp_path / ".o.lock").write_text("")
    (tmp_path / ".o.lock.json").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "command": "x"}))
    with command_scope("test"):
        check_output_dir(out, overwrite=False)
        assert json.loads((tmp_path / ".o.lock.json").read_text())["pid"] == os.getpid()
    assert _leftover_locks(tmp_path) == []


def test_a_failed_command_leaves_no_lock_and_no_new_folders(saved, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert main(["grow", "--model", "bad", "--positions", "1", "--output-dir", "new/deep/g"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


@pytest.mark.parametrize("command", ["probe", "eval"])
def test_probe_and_eval_refuse_a_foreign_folder_and_replace_their_own(command, saved, tmp_path, capsys):
    """Before: probe.json / report.json of a user's folder were overwritten with exit 0, and there was no --overwrite."""
    argv = [command, "--data", str(saved / "data.txt"), "--block-size", "16", "--max-examples", "8", "--no-progress"]
    argv += ["--model", str(saved / "model"), "--max-batches", "2"] if command == "probe" else [
        "--model", str(saved / "grown"), "--loss-bound", "10", "--n-bootstrap", "50", "--no-evaluate"]
    name = "probe.json" if command == "probe" else "report.json"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / name).write_text("my own results")
    assert main(argv + ["--output-dir", str(foreign)]) == 2
    assert capsys.readouterr().err.strip() == f"hf-depthgrow {command}: {foreign} exists and is not empty, and --overwrite would not replace it: it was not written by hf-depthgrow (no .hf_depthgrow_run file); choose another output folder"
    assert main(argv + ["--output-dir", str(foreign), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hf-depthgrow {command}: will not replace {foreign} with --overwrite: it was not written by hf-depthgrow (no {MARKER} file)"
    )
    assert sorted(os.listdir(foreign)) == [name] and (foreign / name).read_text() == "my own results"

    out = tmp_path / "out"
    assert main(argv + ["--output-dir", str(out)]) == 0
    first = json.loads((out / name).read_text())
    assert (out / MARKER).is_file()
    assert main(argv + ["--output-dir", str(out)]) == 2
    assert main(argv + ["--output-dir", str(out), "--overwrite"]) == 0
    assert json.loads((out / name).read_text())["command"] != first["command"]
    assert f"wrote {out / name}" in capsys.readouterr().out  # the final paths, not the staging folder's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no staging folder, lock or backup left


def _killed_overwrite(out: Path, pid: int) -> None:
    """What a SIGKILL between the two renames of an --overwrite leaves: the old output aside, the new one staged."""
    out.rename(out.parent / f".{out.name}.old-{pid}")
    staged = out.parent / f".{out.name}.tmp-{pid}"
    staged.mkdir()
    (staged / "result.json").write_text("new")
    (staged / MARKER).write_text("hf_depthgrow\n")
    (out.parent / f".{out.name}.lock.json").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "command": "x"}))


def test_an_output_moved_aside_by_a_killed_overwrite_is_put_back(tmp_path):
    """Before: the output was gone for good and `.o.old-PID` / `.o.tmp-PID` stayed for ever."""
    out = tmp_path / "o"
    with staged_output(out) as tmp:
        (tmp / "result.json").write_text("old")
    _killed_overwrite(out, _dead_pid())
    with pytest.warns(UserWarning, match=r"put back .*/o from \.o\.old-\d+"):
        check_output_dir(out, overwrite=True)
    assert (out / "result.json").read_text() == "old" and (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_run_sigkilled_between_the_two_renames_is_undone_by_the_next(tmp_path):
    """The real thing: a process killed (SIGKILL) after moving the old output aside, before moving the new one in."""
    import signal

    out = tmp_path / "o"
    with staged_output(out) as tmp:
        (tmp / "result.json").write_text("old")

    def overwrite_and_die():
        real_rename = Path.rename

        def rename(self, target):
            if self.name.startswith(".o.tmp-"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_rename(self, target)

        Path.rename = rename
        with command_scope("hf-depthgrow grow --overwrite"):
            check_output_dir(out, overwrite=True)
            with staged_output(out) as tmp:
                (tmp / "result.json").write_text("new")

    child = FORK.Process(target=overwrite_and_die)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert not out.exists() and (tmp_path / f".o.old-{child.pid}").is_dir() and (tmp_path / f".o.tmp-{child.pid}").is_dir()
    with pytest.warns(UserWarning, match="put back"):
        check_output_dir(out, overwrite=True)
    assert (out / "result.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_leftovers_of_killed_runs_are_removed_only_when_provably_ours(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / MARKER).write_text("hf_depthgrow\n")
    dead, other_dead, alive = _dead_pid(), _dead_pid(), os.getppid()
    (tmp_path / f".ck.tmp-{dead}").mkdir()  # a killed compare's empty staging folder
    journal = tmp_path / f".ck.tmp-{other_dead}"  # half a run, named by the record of the run that died holding the lock
    (journal / "train").mkdir(parents=True)
    (journal / "train" / "loss.json").write_text("{}")
    old = tmp_path / f".ck.old-{dead}"  # killed after the swap, while removing the old output
    old.mkdir()
    (old / MARKER).write_text("hf_depthgrow\n")
    (tmp_path / ".ck.lock.json").write_text(json.dumps({"pid": other_dead, "host": socket.gethostname()}))
    unknown = tmp_path / f".ck.tmp-{_dead_pid()}"  # not provably ours: left alone
    unknown.mkdir()
    (unknown / "notes.txt").write_text("keep")
    live = tmp_path / f".ck.tmp-{alive}"  # a live process's: never touched
    live.mkdir()
    (live / "x").write_text("busy")
    with pytest.warns(UserWarning, match="removing what killed hf-depthgrow runs left"):
        check_output_dir(out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", unknown.name, live.name])
    assert (unknown / "notes.txt").read_text() == "keep" and (live / "x").read_text() == "busy"


def test_written_files_get_the_usual_mode(tmp_path):
    """Before: plots (mkstemp) were 0600 while the rest of an output was 0644."""
    from hf_depthgrow.plots import new_figure, save_figure
    from hf_depthgrow.utils import atomic_write_text

    previous = os.umask(0o022)
    try:
        save_figure(new_figure(), tmp_path / "plot.png")
        atomic_write_text(tmp_path / "a.json", "{}")
        with staged_output(tmp_path / "o") as tmp:
            save_figure(new_figure(), tmp / "curve.png")
    finally:
        os.umask(previous)
    for path in (tmp_path / "plot.png", tmp_path / "a.json", tmp_path / "o" / "curve.png"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_old_flag_spellings_warn_and_work(saved, tmp_path, capsys):
    from hf_depthgrow.cli.train import build_parser

    with pytest.warns(FutureWarning) as caught:
        assert main(["grow", str(saved / "model"), "--positions", "1", "--out", str(tmp_path / "g")]) == 0
    messages = [str(w.message) for w in caught]
    assert "--out is deprecated, use --output-dir" in messages
    assert "a positional MODEL is deprecated, use --model MODEL" in messages
    assert (tmp_path / "g" / "config.json").is_file()
    with pytest.warns(FutureWarning, match="--dataset is deprecated, use --data"):
        args, _, _ = build_parser().parse(["--model", "m", "--dataset", "shakespeare"])
    assert args.dataset == "shakespeare"
    assert build_parser().parse(["--data", "tweets"])[0].dataset == "tweets"
    assert main(["grow", "a", "--model", "b", "--positions", "1", "--output-dir", "x"]) == 2
    assert "model given twice" in capsys.readouterr().err


def test_outside_a_command_the_folder_is_checked_again_under_the_lock(tmp_path):
    """From Python each helper holds the lock only while it works: what another writer did in between is seen."""
    out = tmp_path / "o"
    check_output_dir(out, overwrite=False)
    assert _leftover_locks(tmp_path) == []  # released at once outside a command
    out.mkdir()
    (out / "theirs.json").write_text("{}")  # another process wrote the folder meanwhile
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        with staged_output(out):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and os.listdir(out) == ["theirs.json"]
