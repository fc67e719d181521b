"""The trial store and trial checkpoints under attack: swapped, tampered, truncated and foreign entries, checkpoints
of other sweeps, full disks, read-only folders, a file as the folder, interrupted writes, and --gather after repair.

Every case asserts what a user sees (warnings, refusals) and what is on disk afterwards; none may crash a compare,
reuse a stale result, or lose a result or checkpoint the store could keep.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_budget_sweep import _inputs
from test_ray_engine import _timeless

import hf_depthgrow.comparison.trial as trial_module
from hf_depthgrow.comparison import compare_plans
from hf_depthgrow.comparison.arms import Arm, build_arms
from hf_depthgrow.comparison.engine import run_serial
from hf_depthgrow.comparison.store import TrialStore, check_trials_dir, stored, warn_unresumed
from hf_depthgrow.comparison.trial import TrialInputs, TrialSpec, run_trial
from hf_depthgrow.comparison.trial_checkpoint import TrialCheckpoint
from hf_depthgrow.growth.placement import PlacementEntry
from hf_depthgrow.storage import write_digest
from hf_depthgrow.testing import tiny_model, tiny_rows

DISK_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
KW = dict(growth=["top:1"], controls=["layers"], budgets=[2, 4], learning_rates=[3e-3], lr_extensions=0, forgetting_rates=0, matched_controls=False, batch_size=4, allow_repeated_data=True,
          progress=False, n_bootstrap=50)


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("llama")
    rows = {name: tiny_rows(model, n, seed) for name, n, seed in (("train", 8, 0), ("eval", 4, 1), ("test", 4, 2), ("ret", 4, 3))}
    return model, rows


def _compare(setting, **kw):
    model, rows = setting
    return compare_plans(model, rows["train"], rows["eval"], rows["test"], retention_data=rows["ret"], **{**KW, **kw})


@pytest.fixture(scope="module")
def fresh(setting):
    """The comparison without a store: what every run below, however its store was attacked, must equal."""
    return _compare(setting)


def assert_same(a, b):
    assert _timeless(a.to_dict()["budgets"]) == _timeless(b.to_dict()["budgets"])
    for va, vb in zip(a.views, b.views, strict=True):
        for x, y in zip(va.arms, vb.arms, strict=True):
            np.testing.assert_array_equal(x.test_per_example, y.test_per_example)


@pytest.fixture(scope="module")
def trial(setting):
    """One trial (two budgets, a rung: two checkpoints), its uninterrupted result and the checkpoints it handed out."""
    base, rows = setting
    spec = TrialSpec(build_arms(base, ["at:2"], [])[1], 5e-3, 0, (2, 4), warmup_steps=1, scheduler="wsd", rungs=(1,))
    saved = []
    whole = run_trial(spec, _inputs(base, rows), checkpoint=saved.append)
    assert len(saved) == 2
    return spec, whole, saved


def _other_sweep(setting) -> TrialInputs:
    """The same trial's inputs in another sweep: fewer training rows (a 64- against a 96-example sweep)."""
    base, rows = setting
    return _inputs(base, {**rows, "train": rows["train"][:6]})


def assert_same_trial(a, b):
    assert sorted(a.scores) == sorted(b.scores) and a.heldout_curve == b.heldout_curve
    for budget in a.scores:
        assert a.scores[budget].heldout_loss == b.scores[budget].heldout_loss
        np.testing.assert_array_equal(a.scores[budget].test, b.scores[budget].test)


def _entries(trials: Path) -> list[Path]:
    """The stored trials (not the temporary folders of a write, nor the entries set aside)."""
    return sorted(p for p in (trials / "trials").iterdir() if not p.name.startswith(".")) if (trials / "trials").is_dir() else []


def _store_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("trial store")]


def _count_trials(monkeypatch) -> list[str]:
    calls, real = [], trial_module.trial_steps
    monkeypatch.setattr(trial_module, "trial_steps", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    return calls


def _disk_full_at(monkeypatch, where: str, error=None):
    """safetensors' writer fails (a full disk) for every file whose path contains `where`."""
    import safetensors.torch as st
    from safetensors import SafetensorError

    real = st.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if where in str(filename):
            raise error if error is not None else SafetensorError(DISK_FULL)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(st, "save_file", save_file)


# --------------------------------------------------------------------------- stored results: wrong keys, edits, gather


def test_swapped_trial_folders_are_set_aside_rerun_and_stored_so_gather_works(setting, fresh, tmp_path, monkeypatch):
    trials = tmp_path / "trials"
    first = _compare(setting, trials_dir=trials)
    a, b = _entries(trials)
    os.rename(a, trials / "trials" / "swap")
    os.rename(b, a)
    os.rename(trials / "trials" / "swap", b)
    calls = _count_trials(monkeypatch)
    with pytest.warns(UserWarning) as caught:
        again = _compare(setting, trials_dir=trials)
    messages = _store_warnings(caught)
    assert len(calls) == 2 and len(messages) == 2, messages
    assert all("does not match the key" in m and "running the trial again" in m and "moved aside" in m for m in messages)
    assert [p.name for p in _entries(trials)] == [a.name, b.name] and len(list((trials / "trials").glob(".rejected-*"))) == 2
    calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = _compare(setting, trials_dir=trials, engine="stored")
    assert not calls and not _store_warnings(caught)
    for result in (first, again, gathered):
        assert_same(result, fresh)


def test_under_gather_a_damaged_trial_counts_as_not_stored_and_a_rerun_repairs_it(setting, fresh, tmp_path, monkeypatch):
    trials = tmp_path / "trials"
    _compare(setting, trials_dir=trials)
    victim = _entries(trials)[0] / "tensors.safetensors"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated (a partial copy)
    with pytest.warns(UserWarning) as caught, pytest.raises(ValueError, match=r"1 of 2 trials are not stored in .* \(run the command without --gather"):
        _compare(setting, trials_dir=trials, engine="stored")
    (message,) = _store_warnings(caught)
    assert "does not match its sha256" in message and "it counts as not stored (--gather trains nothing)" in message
    assert "afresh" not in message and "running the trial again" not in message
    calls = _count_trials(monkeypatch)
    _compare(setting, trials_dir=trials)  # the repair: only the damaged trial trains
    assert len(calls) == 1
    calls.clear()
    assert_same(_compare(setting, trials_dir=trials, engine="stored"), fresh)
    assert not calls


def test_a_digest_valid_but_unreadable_trial_is_moved_aside_and_replaced(setting, trial, tmp_path):
    """An entry whose files match its digest (rewritten so) but which lacks a budget: set aside once and replaced,
    not skipped on every run for ever."""
    base, rows = setting
    spec, whole, _ = trial
    inputs = _inputs(base, rows)
    store = TrialStore(tmp_path, inputs)
    folder = tmp_path / "trials" / store.save(whole)
    entry = json.loads((folder / "entry.json").read_text())
    del entry["meta"]["scores"]["4"]
    (folder / "entry.json").write_text(json.dumps(entry))
    write_digest(folder)
    with pytest.warns(UserWarning, match=r"ignoring the unreadable stored trial at:2@lr0\.005@seed0 \(it holds budgets \[2\], not \[2, 4\]\); "
                                         "running the trial again .*moved aside"):
        assert store.load(spec) is None
    (result,) = stored(run_serial, store)([spec], inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_trial(store.load(spec), whole)
    assert_same_trial(result, whole)
    assert len(list((tmp_path / "trials").glob(".rejected-*"))) == 1


def test_a_tampered_stored_trial_is_never_reused(setting, trial, tmp_path):
    from safetensors.torch import load_file, save_file

    base, rows = setting
    spec, whole, _ = trial
    store = TrialStore(tmp_path, _inputs(base, rows))
    victim = tmp_path / "trials" / store.save(whole) / "tensors.safetensors"
    save_file({k: v * 0.5 for k, v in load_file(str(victim)).items()}, str(victim))  # lower losses: a better-looking result
    with pytest.warns(UserWarning, match="tensors.safetensors does not match its sha256.*running the trial again"):
        assert store.load(spec) is None
    assert _entries(tmp_path) == []


def test_an_edited_plan_init_is_not_the_stored_trial(setting, tmp_path):
    """A plan edited from `"init": "copy"` to `"random"` reused the copy's trial without training."""
    base, rows = setting
    inputs = _inputs(base, rows)
    copy_arm, random_arm = (build_arms(base, [[{"at": 2, "init": init}]], [])[1] for init in ("copy", "random"))
    spec = TrialSpec(copy_arm, 5e-3, 0, (2,), warmup_steps=1)
    store = TrialStore(tmp_path, inputs)
    store.save(run_trial(spec, inputs))
    assert store.load(spec) is not None
    assert store.load(replace(spec, arm=random_arm)) is None
    assert store.trial_key(spec) != store.trial_key(replace(spec, arm=random_arm))


def test_every_field_of_an_arm_a_spec_and_the_inputs_changes_the_key(setting, tmp_path):
    """Each dataclass field that can change a trial's result, enumerated: a field added later and left out of the store
    key fails here (add it to the key, or to NOT_IN_KEY with the reason it cannot change a result)."""
    base, rows = setting
    inputs = _inputs(base, rows)
    arm = build_arms(base, ["at:2"], [])[1]
    spec = TrialSpec(arm, 5e-3, 0, (2, 4), warmup_steps=1, scheduler="wsd", rungs=(1,))

    def key(s=spec, i=inputs):
        return TrialStore(tmp_path, i).trial_key(s)

    entry = arm.placement[0]
    changed = {
        PlacementEntry: ({"at": 3, "copy_from": 0, "init": "random"},
                         lambda f, v: replace(spec, arm=replace(arm, placement=[replace(entry, **{f: v})]))),
        Arm: ({"name": "other", "kind": "layers", "placement": [PlacementEntry(3)], "layers": [1], "lora_r": 2,
               "trainable_parameters": 1, "matched_to": "top:1"}, lambda f, v: replace(spec, arm=replace(arm, **{f: v}))),
        TrialSpec: ({"arm": replace(arm, name="other"), "learning_rate": 1e-3, "seed": 1, "budgets": (2, 8), "warmup_steps": 0,
                     "scheduler": "cosine", "decay_ratio": 0.5, "rungs": ()}, lambda f, v: replace(spec, **{f: v})),
        TrialInputs: ({"base": tiny_model("llama", seed=1), "train_rows": rows["test"], "eval_rows": rows["train"],
                       "test_rows": rows["eval"], "retention_rows": None, "batch_size": 2, "selection_max_examples": 2,
                       "lora_target_modules": ["q_proj"], "grow_kwargs": {"init": "random"}}, None),
    }
    not_in_key = {
        Arm: {"spec": "resolved into `placement`, which is in the key"},
        TrialInputs: {"original": "computed from the model, rows and batch size, all in the key",
                      "tracking": "where the trackers log, not what trains",
                      "gradient_checkpointing": "recomputes the same activations: the same gradients, up to float rounding"},
    }
    before = key()
    for cls, (values, make) in changed.items():
        names = {f.name for f in fields(cls)}
        assert names == set(values) | set(not_in_key.get(cls, {})), f"{cls.__name__}: fields {names ^ (set(values) | set(not_in_key.get(cls, {})))}"
        for name, value in values.items():
            after = key(i=replace(inputs, **{name: value})) if make is None else key(s=make(name, value))
            assert after != before, f"{cls.__name__}.{name} does not change the trial's store key"
    # What is left out is left out on purpose: changing it reuses the trial.
    assert key(s=replace(spec, arm=replace(arm, spec="at:2 (as typed)"))) == before
    assert key(i=replace(inputs, tracking={"report_to": ["tensorboard"], "logging_dir": "logs"})) == before
    assert key(i=replace(inputs, gradient_checkpointing=True)) == before


# --------------------------------------------------------------------------- checkpoints: foreign, keyless, tampered


def test_a_checkpoint_of_another_sweep_is_set_aside_and_the_trial_starts_over(setting, trial, tmp_path):
    spec, _, saved = trial
    mine = TrialStore(tmp_path, _inputs(*setting))
    mine.save_checkpoint(spec, saved[1])
    theirs = TrialStore(tmp_path, _other_sweep(setting), resume=True)
    shutil.copytree(mine._checkpoints(spec), theirs._checkpoints(spec))  # a copy into the other sweep's key
    with pytest.warns(UserWarning, match=r"not resuming at:2@lr0\.005@seed0 .*written for another trial: another model, data, "
                                         r"settings or spec\); it starts over"):
        assert theirs.resume_point(spec) is None
    assert len(list((tmp_path / "checkpoints").glob(".rejected-*"))) == 1 and not any(theirs._checkpoints(spec).iterdir())
    with pytest.raises(ValueError, match="resume: nothing to resume in"):
        theirs.check_resume([spec])  # what was there is no checkpoint of this sweep
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_trial(spec, _other_sweep(setting), **theirs.hooks(spec))  # from its start, this sweep's data
    assert_same_trial(got, run_trial(spec, _other_sweep(setting)))


def test_a_checkpoint_without_its_key_is_not_resumed(setting, trial, tmp_path):
    spec, _, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting), resume=True)
    saved[0].save(store._checkpoints(spec) / "0001")  # written by hand (or an older version): it names no key
    with pytest.warns(UserWarning, match=r"does not carry its trial's key .*it starts over"):
        assert store.resume_point(spec) is None


def test_a_tampered_newest_checkpoint_is_set_aside_and_the_older_whole_one_resumes(setting, trial, tmp_path):
    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting), resume=True)
    store.save_checkpoint(spec, saved[0])
    newest = store._checkpoints(spec) / f"{saved[1].events_done:04d}"
    replace(saved[1], key=store.trial_key(spec)).save(newest)
    data = bytearray((newest / "tensors.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its sha256"):
        point = store.resume_point(spec)
    assert point.events_done == saved[0].events_done and not newest.exists()
    assert len(list((tmp_path / "checkpoints").glob(".rejected-*"))) == 1
    assert_same_trial(run_trial(spec, _inputs(*setting), resume=point), whole)


def test_only_this_trials_own_checkpoints_are_announced_and_the_warning_allows_a_live_run(setting, trial, tmp_path):
    """Two sweeps sharing a store: one's checkpoint (or a copy of it in the other's key) is not the other's to resume."""
    spec, _, saved = trial
    mine, theirs = TrialStore(tmp_path, _inputs(*setting)), TrialStore(tmp_path, _other_sweep(setting))
    mine.save_checkpoint(spec, saved[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unresumed(theirs, [spec])
        shutil.copytree(mine._checkpoints(spec), theirs._checkpoints(spec))
        warn_unresumed(theirs, [spec])  # a copy of the other sweep's: not a checkpoint of this trial
    with pytest.warns(UserWarning, match=r"1 trial\(s\) to run \(at:2@lr0\.005@seed0\) have a checkpoint under .* from a run that "
                                         r"did not finish them \(interrupted, or still running elsewhere\): they start over here"):
        warn_unresumed(mine, [spec])


def test_a_users_own_files_beside_checkpoints_are_never_deleted(setting, trial, tmp_path):
    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting))
    folder = store._checkpoints(spec)
    (folder / "my_notes").mkdir(parents=True)
    (folder / "my_notes" / "x.txt").write_text("mine")
    (folder / "readme.txt").write_text("mine too")
    store.save_checkpoint(spec, saved[0])
    store.save_checkpoint(spec, saved[1])  # replaces the first checkpoint, nothing else
    assert sorted(p.name for p in folder.iterdir()) == [f"{saved[1].events_done:04d}", "my_notes", "readme.txt"]
    store.save(whole)
    store.drop_checkpoints(spec)
    assert sorted(p.name for p in folder.iterdir()) == ["my_notes", "readme.txt"]


# --------------------------------------------------------------------------- full disks, read-only folders, a file


def test_a_full_disk_while_checkpointing_warns_once_and_the_compare_finishes(setting, fresh, tmp_path, monkeypatch):
    """safetensors' own SafetensorError wrapping 'No space left on device' crashed compare (only OSError was caught)."""
    trials = tmp_path / "trials"
    _disk_full_at(monkeypatch, "checkpoints")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compare(setting, trials_dir=trials)
    (message,) = _store_warnings(caught)
    assert f"could not write under {trials} (No space left on device)" in message and "the run goes on" in message
    assert_same(got, fresh)
    assert len(_entries(trials)) == 2 and not list(trials.rglob(".tmp-*")) and not list((trials / "checkpoints").rglob("digest.json"))


def test_enospc_on_every_write_warns_once_leaves_nothing_half_written_and_a_later_run_stores(setting, trial, tmp_path, monkeypatch):
    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting))
    with monkeypatch.context() as full:
        _disk_full_at(full, str(tmp_path), OSError(errno.ENOSPC, "No space left on device"))
        with pytest.warns(UserWarning) as caught:
            store.save_checkpoint(spec, saved[0])
            assert store.save(whole) is None
            store.save_checkpoint(spec, saved[1])
    (message,) = _store_warnings(caught)
    assert f"could not write under {tmp_path} (No space left on device)" in message
    assert not list(tmp_path.rglob(".tmp-*")) and not list(tmp_path.rglob("digest.json"))
    assert store.load(spec) is None  # nothing half-written is read back
    assert store.save(whole) is not None  # the disk has room again
    assert_same_trial(store.load(spec), whole)


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint_whole(setting, trial, tmp_path, monkeypatch):
    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting), resume=True)
    store.save_checkpoint(spec, saved[0])
    with monkeypatch.context() as full, pytest.warns(UserWarning, match="No space left on device"):
        _disk_full_at(full, "checkpoints")
        store.save_checkpoint(spec, saved[1])
    assert [p.name for p in store._checkpoints(spec).iterdir()] == [f"{saved[0].events_done:04d}"]
    point = store.resume_point(spec)
    assert point.events_done == saved[0].events_done
    assert_same_trial(run_trial(spec, _inputs(*setting), resume=point), whole)


def test_a_result_that_cannot_be_stored_keeps_its_checkpoint_for_resume(setting, trial, tmp_path, monkeypatch):
    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting))
    with monkeypatch.context() as full, pytest.warns(UserWarning, match="could not write under"):
        _disk_full_at(full, str(tmp_path / "trials"))  # results fail, checkpoints still fit
        (result,) = stored(run_serial, store)([spec], _inputs(*setting))
    assert_same_trial(result, whole)
    assert _entries(tmp_path) == [] and list((tmp_path / "checkpoints").glob("*/*/digest.json"))
    resumed = TrialStore(tmp_path, _inputs(*setting), resume=True)
    calls, real = [], TrialCheckpoint.restore
    monkeypatch.setattr(TrialCheckpoint, "restore", lambda self, *a: calls.append(self.events_done) or real(self, *a))
    (again,) = stored(run_serial, resumed)([spec], _inputs(*setting))
    assert calls == [saved[-1].events_done]  # continued from its last checkpoint, not from its start
    assert_same_trial(again, whole)
    assert len(_entries(tmp_path)) == 1 and not list((tmp_path / "checkpoints").glob("*/*"))


def test_a_read_only_trials_dir_warns_once_naming_it_and_the_compare_finishes(setting, fresh, tmp_path, monkeypatch):
    """Root ignores chmod, so the read-only file system is simulated: every folder made under the store fails."""
    trials = tmp_path / "trials"
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(trials)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compare(setting, trials_dir=trials)
    (message,) = _store_warnings(caught)
    assert message.startswith(f"trial store: could not write under {trials} (Read-only file system): ")
    assert_same(got, fresh)
    assert not trials.exists()


def test_a_file_as_trials_dir_through_the_api_warns_once_and_is_left_alone(setting, fresh, tmp_path):
    blocked = tmp_path / "trials.txt"
    blocked.write_text("my notes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compare(setting, trials_dir=blocked)
    (message,) = _store_warnings(caught)
    assert f"could not write under {blocked} ({blocked} is a file, not a folder)" in message
    assert blocked.read_text() == "my notes"
    assert_same(got, fresh)


# --------------------------------------------------------------------------- where a store may live; interrupted writes


def test_trials_dir_at_root_home_or_an_input_folder_is_refused_before_any_work(setting, tmp_path, monkeypatch, capsys):
    from hf_depthgrow.cli import main

    model, _ = setting
    model_dir, data = tmp_path / "model", tmp_path / "data"
    (model_dir / "sub").mkdir(parents=True)
    data.mkdir()
    monkeypatch.setattr(trial_module, "trial_steps", lambda *a, **k: pytest.fail("a trial trained before the refusal"))
    monkeypatch.setattr("hf_depthgrow.cli.compare._load", lambda *a: pytest.fail("the model was loaded before the refusal"))
    cases = (("/", "is the root folder"), (str(Path.home()), "is the home folder"), (str(model_dir), "inside the input model folder"),
             (str(model_dir / "sub"), "inside the input model folder"), (str(data / "t"), "inside the input data folder"))
    out = tmp_path / "out"
    for trials_dir, message in cases:
        argv = ["compare", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--trials-dir", trials_dir]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-depthgrow compare: trials_dir ") and "\n" not in err and message in err, err
    assert not out.exists() and sorted(p.name for p in model_dir.iterdir()) == ["sub"] and not any(data.iterdir())
    monkeypatch.setattr(model, "name_or_path", str(model_dir))
    for trials_dir, message in (("/", "is the root folder"), (model_dir / "trials", "inside the input model folder")):
        with pytest.raises(ValueError, match=message):
            _compare(setting, trials_dir=trials_dir)
    with pytest.raises(ValueError, match="is the home folder"):
        check_trials_dir(Path.home())
    check_trials_dir(tmp_path / "beside", inputs={"model": str(model_dir), "data": "shakespeare"})  # beside them: fine


def test_temporary_folders_of_an_interrupted_write_are_never_read_nor_resumable(setting, trial, tmp_path):
    """A SIGKILLed write leaves its temporary folder: never read, never counted as something to resume."""
    from hf_depthgrow.cli.compare import CompareScript, _check_resume

    spec, whole, saved = trial
    store = TrialStore(tmp_path, _inputs(*setting), resume=True)
    left = tmp_path / "trials" / f".tmp-{store.trial_key(spec)[:16]}-1234-deadbeef"
    left.mkdir(parents=True)
    (left / "entry.json").write_text('{"format": 2, "meta": ')  # cut off mid-write, no digest yet
    partial = store._checkpoints(spec) / ".tmp-0002-1234-deadbeef"
    partial.mkdir(parents=True)
    saved[1].save(tmp_path / "whole-copy")
    shutil.copy(tmp_path / "whole-copy" / "tensors.safetensors", partial)  # its tensors, not yet its digest
    shutil.rmtree(tmp_path / "whole-copy")
    with pytest.raises(ValueError, match="nothing to resume in"):
        _check_resume(CompareScript(trials_dir=str(tmp_path), resume=True, output_dir=str(tmp_path / "out")))
    with pytest.raises(ValueError, match="nothing to resume in"):
        store.check_resume([spec])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load(spec) is None and store.resume_point(spec) is None
        store.resume = False
        (result,) = stored(run_serial, store)([spec], _inputs(*setting))
    assert_same_trial(result, whole)
    assert_same_trial(store.load(spec), whole)
    assert not store._checkpoints(spec).exists()  # its own temporary folder went with its checkpoints


def test_a_trials_seed_varies_its_new_blocks_initialisation_and_the_key_says_so(setting, tmp_path):
    """Seeds vary the new parameters as well as the data order: seed 1's new block starts from other weights than
    seed 0's, seed 0's is the block `grow_depth` builds by default, and a seed-1 growth trial stored before seeds
    varied the initialisation (a key without its block seed) is not reused."""
    from hf_depthgrow.comparison.trial import fresh_model
    from hf_depthgrow.growth.engine import new_block_parameters

    base, rows = setting
    inputs = _inputs(base, rows)
    copied, arm = (build_arms(base, [[{"at": 2, "init": init}]], [])[1] for init in ("copy", "random"))

    def new_weights(seed, grow_kwargs=None, a=arm):
        return {n: p.detach().clone() for n, p in new_block_parameters(fresh_model(base, a, grow_kwargs, seed))}

    zero, one, again = new_weights(0), new_weights(1), new_weights(1)
    default = {n: p.detach().clone() for n, p in new_block_parameters(trial_module.grow_arm(base, arm))}
    assert all(torch_equal(zero[n], default[n]) for n in zero)
    assert all(torch_equal(one[n], again[n]) for n in one)
    assert any(not torch_equal(zero[n], one[n]) for n in zero)
    # A growth seed given by the user is the base the trial seeds count from.
    assert all(torch_equal(new_weights(0, {"seed": 1})[n], one[n]) for n in one)
    # A copied block (LLaMA Pro's init) has no random part: its seeds differ in the data order only.
    c0, c1 = new_weights(0, a=copied), new_weights(1, a=copied)
    assert all(torch_equal(c0[n], c1[n]) for n in c0)
    store = TrialStore(tmp_path, inputs)
    spec0, spec1 = TrialSpec(arm, 5e-3, 0, (2,), warmup_steps=1), TrialSpec(arm, 5e-3, 1, (2,), warmup_steps=1)
    assert "block_seed" not in store._parts(spec0) and store._parts(spec1)["block_seed"] == 1
    stale = {k: v for k, v in store._parts(spec1).items() if k != "block_seed"}
    assert store.key("trial", stale) != store.trial_key(spec1)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_a_checkpoints_cuda_rng_states_go_back_to_their_own_devices_past_ten_gpus(setting, trial, tmp_path, monkeypatch):
    """The states are kept as `rng.cuda.<device>`: read back in device order, not name order (`10` before `2`)."""
    import hf_depthgrow.training.checkpoints as checkpoints

    spec, whole, saved = trial
    states = {f"rng.cuda.{i}": torch.full((4,), i, dtype=torch.uint8) for i in range(12)}
    point = TrialCheckpoint.load(replace(saved[-1], tensors={**saved[-1].tensors, **states}).save(tmp_path / "ckpt"))
    seen, real = [], checkpoints.set_rng_state
    monkeypatch.setattr(checkpoints, "set_rng_state", lambda state: seen.append(state.get("cuda")) or real(state))
    assert_same_trial(run_trial(spec, _inputs(*setting), resume=point), whole)
    assert [int(t[0]) for t in seen[0]] == list(range(12))
