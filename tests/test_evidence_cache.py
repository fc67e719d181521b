"""The evidence cache: entries stored and read back bit for bit, keyed by everything they depend on, checked
against their digest on every read, and a second identical run that reuses the probe, the stepping stones and
the original's losses with the same results."""

import copy
import importlib
import json
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

from hf_depthgrow.pipeline import RunConfig, run_pipeline
from hf_depthgrow.pipeline.checks import check_evidence_cache
from hf_depthgrow.pipeline.evidence_cache import EvidenceCache, default_root
from hf_depthgrow.storage import rows_fingerprint, weights_fingerprint, write_digest
from hf_depthgrow.probe.stepping_stone import rebuild_stepping_stone, stepping_stone
from hf_depthgrow.testing import tiny_inputs, tiny_model

from tiny_lm import make_tiny_lm

# `hf_depthgrow.probe` is also the name of the probe function: the modules by their full names.
signal_module = importlib.import_module("hf_depthgrow.probe.signal")
stone_module = importlib.import_module("hf_depthgrow.probe.stepping_stone")

PARTS = {"model": "m", "train": "t", "batch_size": 8}


def test_entry_round_trip_is_bit_identical(tmp_path):
    cache = EvidenceCache(tmp_path)
    tensors = {"a/w": torch.randn(3, 5), "b": torch.randn(2, dtype=torch.float64)}
    key = cache.store("probe", PARTS, {"signal": [0.1, 1 / 3]}, tensors)
    entry = cache.load("probe", PARTS)
    assert entry.key == key and entry.meta == {"signal": [0.1, 1 / 3]}
    assert all(torch.equal(entry.tensors[n], t) and entry.tensors[n].dtype == t.dtype for n, t in tensors.items())
    # Another kind, other parts: other keys, misses.
    assert cache.load("stepping_stones", PARTS) is None
    assert cache.load("probe", {**PARTS, "batch_size": 4}) is None
    assert [p.name for p in (tmp_path / "probe").iterdir()] == [key]  # no temporary folder left behind


def test_switched_off_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DEPTHGROW_EVIDENCE_CACHE", "none")
    assert default_root() is None and not EvidenceCache.from_setting("auto").enabled
    cache = EvidenceCache.from_setting(None)
    assert cache.store("probe", PARTS, {"x": 1}) is None and cache.load("probe", PARTS) is None
    monkeypatch.setenv("HF_DEPTHGROW_EVIDENCE_CACHE", str(tmp_path / "c"))
    assert EvidenceCache.from_setting("auto").root == tmp_path / "c"
    # Unset: evidence/ beside the SmolLM2 copy, under the package's one cache root.
    monkeypatch.delenv("HF_DEPTHGROW_EVIDENCE_CACHE")
    monkeypatch.setenv("HF_DEPTHGROW_CACHE", str(tmp_path / "root"))
    assert default_root() == tmp_path / "root" / "evidence"
    assert list(tmp_path.iterdir()) == []


def _rejected(folder: Path) -> list[Path]:
    return sorted(folder.glob(".rejected-*"))


def test_an_edited_or_damaged_entry_is_never_reused(tmp_path):
    from safetensors.torch import load_file, save_file

    cache = EvidenceCache(tmp_path)
    tensors = {"losses": torch.rand(6, dtype=torch.float64)}
    key = cache.store("paired_losses", PARTS, {"task": "causal_lm", "delta_r": 0.25}, tensors)
    folder = tmp_path / "paired_losses" / key
    edits = {
        # The original's losses x1.5: a readable file, only its digest can tell.
        "tensors.safetensors does not match its sha256": lambda: save_file(
            {n: 1.5 * t for n, t in load_file(str(folder / "tensors.safetensors")).items()}, str(folder / "tensors.safetensors")),
        "entry.json does not match its sha256": lambda: (folder / "entry.json").write_text(
            (folder / "entry.json").read_text().replace('"delta_r": 0.25', '"delta_r": 2.5')),
        "it has no digest.json": lambda: (folder / "digest.json").unlink(),  # an older version's entry, or a partial copy
        "tensors.safetensors, which its digest lists, is missing": lambda: (folder / "tensors.safetensors").unlink(),
        "its digest.json cannot be read": lambda: (folder / "digest.json").write_text("{"),
    }
    for n, (message, edit) in enumerate(edits.items(), 1):
        edit()
        with pytest.warns(UserWarning, match=f"not reusing the paired_losses entry {key[:12]}: {message}.*computing it afresh") as caught:
            assert cache.load("paired_losses", PARTS) is None
        assert len(caught) == 1  # one warning per damaged entry
        # Moved aside whole, never deleted: the damage stays there to be looked at.
        assert not folder.exists() and len(_rejected(folder.parent)) == n
        if n == 1:
            first = _rejected(folder.parent)[0]
        # The evidence computed afresh takes its place and is reused again, bit for bit.
        assert cache.store("paired_losses", PARTS, {"task": "causal_lm", "delta_r": 0.25}, tensors) == key
        entry = cache.load("paired_losses", PARTS)
        assert entry.meta["delta_r"] == 0.25 and torch.equal(entry.tensors["losses"], tensors["losses"])
    assert torch.equal(load_file(str(first / "tensors.safetensors"))["losses"], 1.5 * tensors["losses"])
    # A store that finds a damaged entry in place (never read, or not movable then) replaces it the same way.
    (folder / "digest.json").unlink()
    with pytest.warns(UserWarning, match=f"the paired_losses entry {key[:12]} in place fails its digest; replacing it"):
        assert cache.store("paired_losses", PARTS, {"task": "causal_lm", "delta_r": 0.25}, tensors) == key
    assert len(_rejected(folder.parent)) == len(edits) + 1 and cache.load("paired_losses", PARTS).meta["delta_r"] == 0.25


def test_unreadable_entries_are_skipped_with_a_warning(tmp_path):
    """An entry that passes its digest but cannot be parsed, or names another key, is moved aside (kept) and the
    fresh entry stored in its place: it would otherwise be skipped, and never replaced, on every run."""
    cache = EvidenceCache(tmp_path)
    key = cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(2)})
    folder = tmp_path / "probe" / key
    # Files that match their digest (written so) but cannot be parsed: skipped, not trusted.
    (folder / "tensors.safetensors").write_bytes(b"not a safetensors file")
    write_digest(folder)
    with pytest.warns(UserWarning, match="ignoring the unreadable probe entry.*moved aside"):
        assert cache.load("probe", PARTS) is None
    assert not folder.exists() and len(_rejected(folder.parent)) == 1
    assert cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(2)}) == key and cache.load("probe", PARTS).meta == {"x": 1}
    (folder / "entry.json").write_text("{broken")
    write_digest(folder)
    with pytest.warns(UserWarning, match="ignoring the unreadable"):
        assert cache.load("probe", PARTS) is None
    assert cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(2)}) == key and len(_rejected(folder.parent)) == 2
    # A whole entry renamed to another key's folder passes its digest but names another key: not trusted either.
    other = cache.store("probe", {"other": 1}, {"x": 2})
    os.rename(folder, tmp_path / "probe" / "elsewhere")
    os.rename(tmp_path / "probe" / other, folder)
    with pytest.warns(UserWarning, match="does not match the key"):
        assert cache.load("probe", PARTS) is None
    assert cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(2)}) == key and cache.load("probe", PARTS).meta == {"x": 1}
    # A store that finds such an entry in place (never loaded) replaces it too, keeping it aside.
    other = cache.store("probe", {"other": 1}, {"x": 2})
    os.rename(folder, tmp_path / "probe" / "mine")
    os.rename(tmp_path / "probe" / other, folder)
    with pytest.warns(UserWarning, match="in place was written for another key; replacing it"):
        assert cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(2)}) == key
    assert cache.load("probe", PARTS).meta == {"x": 1} and len(_rejected(folder.parent)) == 4


def test_writers_of_one_key_at_once_leave_one_whole_entry(tmp_path):
    """Several runs (threads here; processes on machines sharing the folder alike) storing the same key at once."""
    tensors = {"w": torch.arange(1000, dtype=torch.float32)}
    start, keys = threading.Barrier(6), []

    def write():
        start.wait()
        keys.append(EvidenceCache(tmp_path).store("probe", PARTS, {"x": 1}, tensors))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a writer that loses the race neither fails nor warns
        threads = [threading.Thread(target=write) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        entry = EvidenceCache(tmp_path).load("probe", PARTS)
    assert len(set(keys)) == 1 and None not in keys and len(keys) == 6
    assert [p.name for p in (tmp_path / "probe").iterdir()] == [keys[0]]  # no temporary folder left behind
    assert torch.equal(entry.tensors["w"], tensors["w"])


def test_a_writer_that_loses_the_rename_keeps_the_winners_entry(tmp_path, monkeypatch):
    """The race made certain: the entry appears after the loser's first look, before its rename."""
    import hf_depthgrow.storage as module

    cache = EvidenceCache(tmp_path)
    key = cache.store("probe", PARTS, {"x": "winner"})
    real, looks = module.is_whole, []
    monkeypatch.setattr(module, "is_whole", lambda folder: bool(looks.append(folder)) or (len(looks) > 1 and real(folder)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.store("probe", PARTS, {"x": "loser"}) == key
    assert len(looks) == 3  # the first look, the check before the rename, the check after the rename failed
    monkeypatch.undo()
    assert cache.load("probe", PARTS).meta == {"x": "winner"}
    assert [p.name for p in (tmp_path / "probe").iterdir()] == [key]


def test_a_reader_never_sees_a_half_written_entry(tmp_path, monkeypatch):
    import hf_depthgrow.storage as module

    cache, seen = EvidenceCache(tmp_path), []
    real = module.write_digest

    def read_while_writing(folder):
        # Every file is written, the digest is next: another reader of this key must miss, silently.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            seen.append(cache.load("probe", PARTS))
        real(folder)
        seen.append(cache.load("probe", PARTS))  # the digest is there, the folder not yet renamed into place

    monkeypatch.setattr(module, "write_digest", read_while_writing)
    key = cache.store("probe", PARTS, {"x": 1}, {"w": torch.ones(3)})
    assert seen == [None, None] and cache.load("probe", PARTS).key == key


def test_store_keeps_what_is_there_and_never_fails_the_run(tmp_path):
    cache = EvidenceCache(tmp_path)
    foreign = tmp_path / "probe" / "notes.txt"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("mine")
    key = cache.store("probe", PARTS, {"x": 1})
    assert cache.store("probe", PARTS, {"x": 2}) == key and cache.load("probe", PARTS).meta == {"x": 1}
    assert foreign.read_text() == "mine"
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not write"):
        assert EvidenceCache(blocked).store("probe", PARTS, {"x": 1}) is None
    assert blocked.read_text() == "not a folder"


def test_fingerprints_see_every_value():
    model = tiny_model("llama")
    twin = copy.deepcopy(model)
    assert weights_fingerprint(model) == weights_fingerprint(twin)
    with torch.no_grad():
        next(twin.parameters()).view(-1)[7] += 1e-6
    assert weights_fingerprint(model) != weights_fingerprint(twin)
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in range(40)]
    changed = copy.deepcopy(rows)
    changed[23]["input_ids"][1] = 9  # a row a 16-row sample would skip
    assert rows_fingerprint(rows) == rows_fingerprint(copy.deepcopy(rows)) != rows_fingerprint(changed)
    from datasets import Dataset

    ds = Dataset.from_list(rows)
    assert rows_fingerprint(ds) == rows_fingerprint(Dataset.from_list(rows)) != rows_fingerprint(Dataset.from_list(changed))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_rebuilt_stepping_stone_has_the_same_weights(family):
    model = tiny_model(family)
    rows = [tiny_inputs(model, seed=s) for s in range(3)]
    stone, info = stepping_stone(model, 1, rows)
    assert info.eta > 0 and info.gradient is not None
    again = rebuild_stepping_stone(model, type(info).from_dict(json.loads(json.dumps(info.to_dict()))), info.gradient)
    a, b = stone.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="not its gradient"):
        rebuild_stepping_stone(model, info, {n: 2 * t for n, t in info.gradient.items()})


def test_cache_folder_is_checked_before_the_run(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_evidence_cache(str(tmp_path / "file"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="inside output_dir"):
        check_evidence_cache(str(tmp_path / "out" / "cache"), str(tmp_path / "out"))
    check_evidence_cache(str(tmp_path / "cache"), str(tmp_path / "out"))
    assert RunConfig(evidence_cache="none").evidence_cache is None
    with pytest.raises(ValueError, match="evidence_cache needs"):
        RunConfig(evidence_cache=" ")


def test_cli_refuses_a_bad_cache_folder_with_one_line(tmp_path, capsys):
    from hf_depthgrow.cli.run import main as run_main

    (tmp_path / "file").write_text("x")
    out = tmp_path / "out"
    for cache, message in ((tmp_path / "file", "is a file, not a folder"), (out / "cache", "lies inside output_dir"), (" ", "needs auto")):
        assert run_main(["--evidence-cache", str(cache), "--output-dir", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_tiny_lm(tmp_path_factory.mktemp("evidence"))


def _config(workdir, out, cache, **overrides):
    settings = dict(model=str(workdir / "tiny"), data=str(workdir / "sample.txt"), output_dir=str(out), block_size=32,
                    max_examples=96, batch_size=8, train_steps=4, eval_steps=2, stone_max_batches=2, learning_rate=3e-3,
                    progress=False, loss_bound=10.0, control="none", evidence_cache=str(cache), force=True,
                    retention_data=str(workdir / "sample.txt"), retention_max_examples=16)
    settings.update(overrides)
    return RunConfig(**settings)


def _without_timings(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("timings_s", "reused")}


def test_second_identical_run_reuses_the_evidence_with_the_same_results(workdir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run_pipeline(_config(workdir, tmp_path / "a", cache))
    assert "reused" not in first.summary
    assert sorted(p.name for p in cache.iterdir()) == ["original_losses", "paired_losses", "probe", "stepping_stones", "stone_margin"]

    def must_not_run(*args, **kwargs):
        raise AssertionError("an identical run computed the evidence again")

    # The stages import these at call time: a second run that probes or searches a step fails here.
    monkeypatch.setattr(signal_module, "probe", must_not_run)
    monkeypatch.setattr(stone_module, "stepping_stone", must_not_run)
    # Another training (more steps, another learning rate) reads the same evidence.
    second = run_pipeline(_config(workdir, tmp_path / "b", cache, train_steps=6, learning_rate=1e-3))
    assert sorted(second.summary["reused"]) == [
        "original_losses", "probe", "retention_losses", "stepping_stones", "stone_margin", "test_losses"
    ]
    # The original's test and retention losses and the margins are the first run's.
    assert second.summary["test"]["loss_old"] == first.summary["test"]["loss_old"]
    assert second.summary["retention"]["growth"]["loss_old"] == first.summary["retention"]["growth"]["loss_old"]
    terms = [json.loads((tmp_path / side / "eval" / "report.json").read_text())["routes"] for side in "ab"]
    for name in ("delta_r", "delta_r_test"):
        assert terms[1]["terms"][name] == terms[0]["terms"][name]
    assert "by an identical earlier run" in terms[1]["terms"]["sources"]["delta_r"]
    assert "reused from an identical earlier run | probe (" in (tmp_path / "b" / "summary.md").read_text()
    for key in ("probe", "stepping_stones", "positions"):
        assert second.summary[key] == first.summary[key]
    assert second.summary["held_out_loss"]["before"] == first.summary["held_out_loss"]["before"]
    assert second.summary["train_losses"]["old"] == first.summary["train_losses"]["old"]
    # The stone rebuilt from the cache is the one the line search made: the same training loss, to the bit.
    assert second.summary["train_losses"]["stepping_stone"] == first.summary["train_losses"]["stepping_stone"]
    monkeypatch.undo()
    # The same training again: everything equal but the timings.
    third = run_pipeline(_config(workdir, tmp_path / "c", cache))
    assert _without_timings(third.summary) == _without_timings(first.summary)
    assert not any(Path(cache).rglob(".tmp-*"))


def test_other_data_or_position_computes_afresh(workdir, tmp_path):
    cache = tmp_path / "cache"
    first = run_pipeline(_config(workdir, tmp_path / "a", cache))
    other_seed = run_pipeline(_config(workdir, tmp_path / "b", cache, seed=1))
    assert "reused" not in other_seed.summary
    # Another position: the probe is read, but the stones it needs G_S for are not there, so the probe runs again.
    k = next(p for p in range(len(first.summary["probe"]["recommendation"]["positions"]) + 2) if [p] != first.summary["positions"])
    moved = run_pipeline(_config(workdir, tmp_path / "c", cache, positions=[k]))
    assert "stepping_stones" not in moved.summary.get("reused", {}) and "probe" not in moved.summary.get("reused", {})
    assert moved.summary["probe"] == first.summary["probe"]


def test_paired_losses_take_known_sides_without_running_them(monkeypatch):
    from hf_depthgrow import grow_depth
    from hf_depthgrow.evaluation.collector import Collector
    from hf_depthgrow.evaluation.paired import evaluate_delta, paired_losses

    model = tiny_model("llama")
    rows = [tiny_inputs(model, seed=s) for s in range(3)]
    stone, _ = stepping_stone(model, 2, rows)
    grown = grow_depth(copy.deepcopy(model), [2])
    with torch.no_grad():
        for p in grown.parameters():
            p.add_(1e-3)  # a "trained" model: other losses than the original's
    fresh, _ = paired_losses(grown, rows, extra={"stone": stone})
    stored = Collector.from_tensors(fresh.task, fresh.to_tensors(["old", "stone"]))

    ran = []
    real_run = Collector.run
    monkeypatch.setattr(Collector, "run", lambda self, which, *a, **k: (ran.append(which), real_run(self, which, *a, **k)))
    again, _ = paired_losses(grown, rows, extra={"stone": stone}, known=stored)
    assert ran == ["new"] * len(ran) and ran  # only the model not in `known` ran
    for side in ("old", "new", "stone"):
        assert torch.equal(again.cat(side).total, fresh.cat(side).total)
    assert evaluate_delta(grown, rows, losses=again, loss_bound=20.0).delta == evaluate_delta(grown, rows, losses=fresh, loss_bound=20.0).delta


def test_an_entry_that_cannot_be_rebuilt_is_computed_afresh(workdir, tmp_path):
    from safetensors.torch import load_file, save_file

    cache = tmp_path / "cache"
    first = run_pipeline(_config(workdir, tmp_path / "a", cache))
    (entry,) = (cache / "stepping_stones").iterdir()
    tensors = load_file(str(entry / "tensors.safetensors"))
    # A readable file whose gradients are not the ones the stones were made with, and a digest that matches it.
    save_file({n: 2 * t for n, t in tensors.items()}, str(entry / "tensors.safetensors"))
    write_digest(entry)
    with pytest.warns(UserWarning, match="the stepping_stones entry .* cannot be read"):
        again = run_pipeline(_config(workdir, tmp_path / "b", cache))
    assert "stepping_stones" not in again.summary["reused"] and "probe" not in again.summary["reused"]
    assert len(_rejected(cache / "stepping_stones")) == 1  # set aside: the fresh stones were stored in its place
    assert _without_timings(again.summary) == _without_timings(first.summary)


def test_an_edited_cache_gives_the_result_of_a_fresh_run(workdir, tmp_path):
    """An attack: the original's test losses x1.5 and the meta edited made a run certify a false gain."""
    from safetensors.torch import load_file, save_file

    cache = tmp_path / "cache"
    fresh = run_pipeline(_config(workdir, tmp_path / "a", cache))
    for entry in (cache / "paired_losses").iterdir():
        file = entry / "tensors.safetensors"
        save_file({n: 1.5 * t if n.endswith("/total") else t for n, t in load_file(str(file)).items()}, str(file))
    for kind, field in (("original_losses", "train"), ("stone_margin", "delta_r")):
        (entry,) = (cache / kind).iterdir()
        header = json.loads((entry / "entry.json").read_text())
        header["meta"][field] *= 1.5
        (entry / "entry.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    with pytest.warns(UserWarning) as caught:
        again = run_pipeline(_config(workdir, tmp_path / "b", cache))
    damaged = sorted(str(w.message).split(" entry ")[0].split()[-1] for w in caught if "not reusing" in str(w.message))
    assert damaged == ["original_losses", "paired_losses", "paired_losses", "stone_margin"]
    assert sorted(again.summary["reused"]) == ["probe", "stepping_stones"]
    assert _without_timings(again.summary) == _without_timings(fresh.summary)
    # The damaged entries were replaced by what was computed afresh: the next run reuses all of it.
    third = run_pipeline(_config(workdir, tmp_path / "c", cache))
    assert len(third.summary["reused"]) == 6 and _without_timings(third.summary) == _without_timings(fresh.summary)


def test_an_entry_whose_contents_cannot_be_rebuilt_is_set_aside_and_replaced(tmp_path):
    """Digest and key fine, contents wrong (another version's probe): moved aside, so the fresh result is stored;
    left in place, it would be skipped and never replaced on every later run."""
    from types import SimpleNamespace

    from hf_depthgrow.pipeline.reuse import _reuse
    from hf_depthgrow.probe.result import ProbeResult

    cache = EvidenceCache(tmp_path)
    key = cache.store("probe", PARTS, {"not": "a probe result"})
    run = SimpleNamespace(cache=cache, reused={}, log=lambda message: None)
    read = lambda entry: ProbeResult.from_dict(entry.meta)  # noqa: E731
    with pytest.warns(UserWarning, match="the probe entry .* cannot be read .*computing it afresh.*moved aside"):
        assert _reuse(run, "probe", PARTS, read) is None
    assert not (tmp_path / "probe" / key).exists() and len(_rejected(tmp_path / "probe")) == 1 and run.reused == {}
    assert cache.store("probe", PARTS, {"fresh": 1}) == key and cache.load("probe", PARTS).meta == {"fresh": 1}
