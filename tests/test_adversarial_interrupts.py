"""Interrupts, failing writes, malformed config files and --overwrite against a user's files: what a user does to a
run that is not going well. Every case asserts the one line, the exit code and what is (not) on disk afterwards.

Interrupts are raised in-process where they can be (a stage raises `KeyboardInterrupt`, or the process sends itself
SIGTERM); one test sends a real SIGTERM to a `train` subprocess and resumes it. Failing writes are simulated with
monkeypatch (the tests may run as root, where a read-only mode blocks nothing).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_depthgrow.cli import main
from hf_depthgrow.pipeline import MARKER, check_output_dir, claim_output_dir, record_outputs, staged_output
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.utils import atomic_write_text, write_json

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny saved Llama with a byte-level tokenizer, and a text file it reads."""
    from hf_depthgrow.testing import byte_level_tokenizer

    root = tmp_path_factory.mktemp("adversarial")
    text = "the quick brown fox jumps over the lazy dog. " * 60
    (root / "data.txt").write_text(text)
    model = tiny_model("llama", vocab_size=300)
    byte_level_tokenizer([text], vocab_size=300).save_pretrained(root / "model")
    model.save_pretrained(root / "model")
    return root


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _grow(saved: Path, out: Path, *extra: str) -> int:
    return main(["grow", "--model", str(saved / "model"), "--positions", "1", "--output-dir", str(out), *extra])


def _recipe():
    spec = importlib.util.spec_from_file_location("recipe_regime_study_adv", REPO / "recipes" / "regime_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- interrupts


def test_ctrl_c_during_run_is_one_line_exit_130_and_the_old_output_stays(saved, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.pipeline.stages as stages

    out = tmp_path / "o"
    with staged_output(out) as tmp:  # an earlier run's output, replaced only by a run that finishes
        (tmp / "summary.json").write_text("{}")
    before = _tree(out)

    def interrupted(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "_probe", interrupted)
    code = main(["run", "--model", str(saved / "model"), "--data", str(saved / "data.txt"), "--output-dir", str(out), "--overwrite",
                 "--block-size", "16", "--max-examples", "16", "--no-progress", "--evidence-cache", "none"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == f"hf-depthgrow run: interrupted by SIGINT (Ctrl-C) during the run; {out} was not changed; the same command starts the run again"
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no staging folder or lock left


def test_sigterm_during_compare_is_exit_143_with_the_resume_hint(saved, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.comparison as comparison

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread: raised where it is, as Ctrl-C would be
        time.sleep(5)
        raise AssertionError("SIGTERM was not raised")

    monkeypatch.setattr(comparison, "compare_plans", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    out, trials = tmp_path / "cmp", tmp_path / "trials"
    code = main(["compare", "--model", str(saved / "model"), "--data", str(saved / "data.txt"), "--retention-data", "none",
                 "--block-size", "16", "--max-examples", "40", "--allow-repeated-data", "--output-dir", str(out), "--trials-dir", str(trials)])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err
    assert _last_line(err) == (f"hf-depthgrow compare: interrupted by SIGTERM during the comparison; {out} was not changed; the finished "
                               f"trials are in {trials}: the same command with --resume continues")
    assert not out.exists() and signal.getsignal(signal.SIGTERM) == previous  # the handler is the command's only


def test_ctrl_c_during_the_oracle_sweep_keeps_the_comparison_and_says_how_to_rerun_it(saved, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.comparison.validation as validation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(validation, "validate_probe", interrupted)
    out = tmp_path / "cmp"
    code = main(["compare", "--model", str(saved / "model"), "--data", str(saved / "data.txt"), "--retention-data", "none",
                 "--block-size", "16", "--max-examples", "40", "--growth", "top:1", "--controls", "layers", "--max-steps", "2",
                 "--batch-size", "4", "--learning-rates", "1e-3", "--n-bootstrap", "20", "--no-progress",
                 "--oracle-positions", "0", "1", "2", "3", "--oracle-seeds", "0", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == (f"hf-depthgrow compare: interrupted by SIGINT (Ctrl-C) during the oracle sweep; the comparison is saved "
                               f"in {out}; the same command with --overwrite runs the oracle sweep again")
    assert (out / "compare.json").is_file() and (out / "compare.md").is_file()
    assert "compare.json" in json.loads((out / MARKER).read_text())["files"]  # the tool's: --overwrite may replace it


def test_a_real_sigterm_stops_train_with_143_and_resume_continues(saved, tmp_path, capsys):
    out = tmp_path / "train"
    args = ["--model", str(saved / "model"), "--positions", "1",
            "--data", str(saved / "data.txt"), "--block-size", "16", "--max-examples", "24", "--held-out-fraction", "0",
            "--max-steps", "40", "--save-steps", "1", "--batch-size", "2",
            "--output-dir", str(out), "--no-progress", "--no-fallback"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # The signalled run is the real command in a process of its own (what a user or a scheduler stops).
    proc = subprocess.Popen([sys.executable, "-m", "hf_depthgrow.cli.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-2").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal could be sent"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    assert _last_line(err) == (f"hf-depthgrow train: interrupted by SIGTERM during training; the same command with "
                               f"--resume continues from the last checkpoint in {out}")  # checkpoint-2 is there
    steps = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert steps and steps[-1] < 40
    # The resume reads only what the killed process left on disk: run here, it needs no second interpreter.
    capsys.readouterr()
    code = main(["train", *args, "--resume"])
    resumed = capsys.readouterr()
    assert code == 0, resumed.err[-2000:]
    assert json.loads(resumed.out[resumed.out.index("{"):])["global_step"] == 40


def test_ctrl_c_in_the_regime_study_is_130_and_the_folder_is_resumable(tmp_path, monkeypatch, capsys):
    recipe = _recipe()

    def interrupted(cfg, log=print):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "prepare_base", interrupted)
    out = tmp_path / "study"
    code = recipe.main(["--smoke", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert _last_line(err) == (f"recipes/regime_study.py: interrupted by SIGINT (Ctrl-C) during the base; the base and the finished "
                               f"trials are kept: the same command with --resume continues ({out})")
    assert [p.name for p in out.iterdir()] == [MARKER]
    claim_output_dir(out, resume=False, overwrite=False, what="a regime study")  # nothing written yet: a fresh start is fine too


def test_the_trainer_surfaces_a_missing_checkpoint_not_an_attribute_error(tmp_path):
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_rows
    from hf_depthgrow.training import TrainConfig
    from hf_depthgrow.training.trainer import GrownTrainer

    model = grow_depth(tiny_model("llama"), [2])
    config = TrainConfig(max_steps=2, per_device_train_batch_size=2, progress_bar=False, output_dir=str(tmp_path / "t"),
                         resume_from_checkpoint="/nonexistent", save_final_model=False)
    trainer = GrownTrainer(model, config, tiny_rows(model, 8, 0))
    with pytest.raises(FileNotFoundError, match=r"^resume_from_checkpoint /nonexistent: no such checkpoint folder$"):
        try:
            trainer.begin()
        finally:
            trainer.close()  # before: AttributeError '_bar', raised from here, hid the error above


def test_ctrl_c_while_the_prefix_cache_is_built_surfaces_as_the_interrupt(monkeypatch):
    import hf_depthgrow.training.trainer as trainer_module
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_rows
    from hf_depthgrow.training import TrainConfig

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "build_caches", interrupted)
    model = grow_depth(tiny_model("llama"), [2])
    trainer = trainer_module.GrownTrainer(model, TrainConfig(max_steps=2, per_device_train_batch_size=2, progress_bar=False),
                                          tiny_rows(model, 8, 0))
    with pytest.raises(KeyboardInterrupt):
        try:
            trainer.begin()
        finally:
            trainer.close()
    trainer.close()  # twice: still safe


# --------------------------------------------------------------------------- failing writes


def _full_disk(monkeypatch, name: str):
    """Writing a file called `name` (anywhere) fails with ENOSPC after half the text, as a full disk does."""
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == name or self.name.startswith(f".{name}."):
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_full_disk_under_staged_output_names_the_final_path_and_keeps_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "o"
    with staged_output(out) as tmp:
        write_json(tmp / "summary.json", {"old": True})
    before = _tree(out)
    _full_disk(monkeypatch, "summary.json")
    with pytest.raises(OSError) as caught:
        with staged_output(out) as tmp:
            write_json(tmp / "summary.json", {"new": True})
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == f"cannot write {out}/summary.json: No space left on device ({out} is unchanged)"
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_full_disk_in_the_cli_is_one_line_naming_the_path_exit_1(saved, tmp_path, monkeypatch, capsys):
    _full_disk(monkeypatch, "probe.json")
    out = tmp_path / "p"
    code = main(["probe", "--model", str(saved / "model"), "--data", str(saved / "data.txt"), "--block-size", "16",
                 "--max-examples", "8", "--max-batches", "2", "--no-progress", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "[Errno" not in err
    assert _last_line(err) == f"hf-depthgrow probe: cannot write {out}: No space left on device ({out} is unchanged)"
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "study.md"
    target.write_text("old, trusted")
    _full_disk(monkeypatch, "study.md")
    with pytest.raises(OSError, match=rf"^cannot write {target}: No space left on device$"):
        atomic_write_text(target, "new " * 100)
    assert target.read_text() == "old, trusted" and [p.name for p in tmp_path.iterdir()] == ["study.md"]


@pytest.mark.parametrize("code, words", [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")])
def test_a_read_only_or_forbidden_output_parent_is_one_line_naming_the_folder(tmp_path, monkeypatch, code, words):
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.is_relative_to(tmp_path / "ro"):
            raise OSError(code, words, str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    out = tmp_path / "ro" / "out"
    with pytest.raises(OSError, match=rf"^cannot write {out}: {words}$"):
        check_output_dir(out, overwrite=False)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- malformed config files

ACCELERATE_CASES = {
    "invalid.yaml": ("compute_environment: [LOCAL\n", "not valid YAML (while parsing a flow sequence: expected ',' or ']', but got '<stream end>', line 2)"),
    "string.yaml": ("just some words\n", "got a string"),
    "empty.yaml": ("", "got nothing (an empty file)"),
    "list.yaml": ("- distributed_type: MULTI_CPU\n", "got a list"),
}


@pytest.mark.parametrize("name", sorted(ACCELERATE_CASES))
def test_a_bad_accelerate_config_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, name):
    pytest.importorskip("ray")
    monkeypatch.chdir(tmp_path)
    text, words = ACCELERATE_CASES[name]
    Path(name).write_text(text)
    code = main(["compare", "--engine", "ray", "--workers-per-trial", "2", "--accelerate-config", name, "--output-dir", "out"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.strip().startswith(f"hf-depthgrow compare: --accelerate-config {name}: ") and words in err
    if "valid YAML" not in words:
        assert "expected a mapping of accelerate settings" in err
    assert sorted(os.listdir(tmp_path)) == [name]


@pytest.mark.parametrize("content, words", [
    (b"train_steps: 3\n# caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 20); expected a mapping of option names to values"),
    (b"- train_steps\n- 3\n", "expected a mapping of option names to values, got a list"),
    (b"train_steps\n", "expected a mapping of option names to values, got a string"),
])
def test_a_config_file_of_the_wrong_shape_or_encoding_names_the_file(tmp_path, monkeypatch, capsys, content, words):
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_bytes(content)
    code = main(["run", "--config", "run.yaml", "--output-dir", "o"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"hf-depthgrow run: run.yaml: {words}"
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


@pytest.mark.parametrize("content, got", [
    ('"top"', "got a string"),
    ("[]", "got an empty list"),
    ('[{"at": 1}, 3]', "but entry 1 is a number"),
    ('{"at": 1}', "got a mapping with keys ['at']"),
    ("", "got nothing (an empty file)"),
])
def test_a_plan_file_of_the_wrong_shape_names_the_file(saved, tmp_path, monkeypatch, capsys, content, got):
    monkeypatch.chdir(tmp_path)
    Path("plan.json").write_text(content)
    code = main(["grow", "--model", str(saved / "model"), "--plan", "plan.json", "--output-dir", "g"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (
        "hf-depthgrow grow: plan file plan.json: expected a list of objects ({'at': k, ...}) or of positions, or a mapping "
        f"with 'plan' or mergekit 'slices', {got}"
    )
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_a_non_utf8_regime_config_names_the_file(tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_bytes(b"hidden_size: 32\nnote: \xff\n")
    code = _recipe().main(["--config", str(config), "--output-dir", str(tmp_path / "study")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: {config}: not UTF-8 text (byte 0xff at offset 22); expected a mapping of option names to values"
    assert sorted(os.listdir(tmp_path)) == ["study.yaml"]


# --------------------------------------------------------------------------- --overwrite and a user's files


def test_overwrite_refuses_a_tool_folder_holding_the_users_files(saved, tmp_path, capsys):
    out = tmp_path / "grown"
    assert _grow(saved, out) == 0
    (out / "my_notes.txt").write_text("mine")
    (out / "my_sub").mkdir()
    (out / "my_sub" / "x.csv").write_text("1,2\n")
    before = _tree(out)
    capsys.readouterr()
    assert _grow(saved, out, "--overwrite") == 2  # before: exit 0, both files gone
    assert capsys.readouterr().err.strip() == (
        f"hf-depthgrow grow: will not replace {out} with --overwrite: it holds files hf-depthgrow did not write "
        "(my_notes.txt, my_sub/x.csv): move them out of it first"
    )
    assert _tree(out) == before


def test_overwrite_replaces_a_tool_folder_that_holds_only_its_own_files(saved, tmp_path):
    out = tmp_path / "grown"
    assert _grow(saved, out) == 0
    listed = json.loads((out / MARKER).read_text())["files"]
    assert "config.json" in listed and "model.safetensors" in listed and MARKER not in listed
    first = (out / "config.json").stat().st_mtime_ns
    assert _grow(saved, out, "--overwrite") == 0
    assert (out / "config.json").stat().st_mtime_ns != first and sorted(p.name for p in tmp_path.iterdir()) == ["grown"]


def test_an_older_marker_protects_files_changed_after_it(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    (out / MARKER).write_text("hf_depthgrow 0.1\n")  # an older version's marker: no list of files
    check_output_dir(out, overwrite=True)  # written with the marker: the tool's
    (out / "notes.md").write_text("mine")
    later = time.time() + 60
    os.utime(out / "notes.md", (later, later))
    with pytest.raises(FileExistsError, match=r"it holds files hf-depthgrow did not write \(notes\.md\)"):
        check_output_dir(out, overwrite=True)


def test_a_file_put_into_the_output_while_it_is_replaced_is_kept(tmp_path):
    out = tmp_path / "o"
    with staged_output(out) as tmp:
        (tmp / "result.json").write_text("old")
    check_output_dir(out, overwrite=True)
    with pytest.warns(UserWarning, match=r"kept in .*: late\.txt \(not written by hf-depthgrow\)"):
        with staged_output(out) as tmp:
            (out / "late.txt").write_text("mine")  # the user, while the run works
            (tmp / "result.json").write_text("new")
    assert (out / "result.json").read_text() == "new" and (out / "late.txt").read_text() == "mine"
    assert "late.txt" not in json.loads((out / MARKER).read_text())["files"]  # still the user's: a later --overwrite refuses


def test_files_recorded_after_the_swap_are_replaced_by_a_later_overwrite(tmp_path):
    out = tmp_path / "o"
    with staged_output(out) as tmp:
        (tmp / "compare.json").write_text("{}")
    record_outputs(out, [atomic_write_text(out / "probe_validation.md", "oracle")])
    check_output_dir(out, overwrite=True)  # nothing foreign
    (out / "mine.txt").write_text("x")
    with pytest.raises(FileExistsError, match=r"\(mine\.txt\)"):
        check_output_dir(out, overwrite=True)


def test_the_regime_study_refuses_a_users_folder_and_keeps_its_files(tmp_path, capsys):
    out = tmp_path / "study"
    (out / "seed0").mkdir(parents=True)
    (out / "study.md").write_text("my study")
    (out / "seed0" / "compare.md").write_text("my table")
    before = _tree(out)
    recipe = _recipe()
    for flags in ([], ["--overwrite"], ["--resume"]):
        code = recipe.main(["--smoke", "--output-dir", str(out), *flags])
        err = capsys.readouterr().err
        assert code == 2 and err.strip() == (f"error: will not write into {out}: it was not written by hf-depthgrow (no {MARKER} file); "
                                             "choose another output folder")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["study"]


def test_the_regime_studys_own_folder_needs_resume_or_overwrite_and_overwrite_spares_the_users_files(tmp_path):
    out = tmp_path / "study"
    claim_output_dir(out, resume=False, overwrite=False, what="a regime study")
    record_outputs(out, [atomic_write_text(out / "study.md", "ours"), write_json(out / "seed0" / "compare.json", {})])
    with pytest.raises(FileExistsError, match=r"holds a regime study written earlier: pass --resume to continue it or --overwrite"):
        claim_output_dir(out, resume=False, overwrite=False, what="a regime study")
    claim_output_dir(out, resume=True, overwrite=False, what="a regime study")
    assert (out / "study.md").read_text() == "ours"  # resume changes nothing by itself
    claim_output_dir(out, resume=False, overwrite=True, what="a regime study")
    assert sorted(p.name for p in out.iterdir()) == [MARKER]  # what it wrote, and the folder it left empty, are gone
    (out / "study.md").write_text("the user's now")
    with pytest.raises(FileExistsError, match=r"did not write \(study\.md\)"):
        claim_output_dir(out, resume=False, overwrite=True, what="a regime study")
    assert (out / "study.md").read_text() == "the user's now"
