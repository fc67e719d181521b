"""`hf-depthgrow train --output-dir`: claimed like every command's output; `--overwrite` replaces only what the tool wrote."""

from __future__ import annotations

import json

import pytest

from hf_depthgrow.pipeline.output import MARKER
from hf_depthgrow.testing import tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from hf_depthgrow.testing import byte_level_tokenizer

    root = tmp_path_factory.mktemp("saved")
    text = "the quick brown fox jumps over the lazy dog. " * 40
    (root / "data.txt").write_text(text)
    tokenizer = byte_level_tokenizer([text], vocab_size=300)
    tiny_model("llama", vocab_size=300).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


def _argv(saved, out, *extra):
    return ["train", "--model", str(saved / "model"), "--positions", "1", "--data", str(saved / "data.txt"), "--block-size", "16",
            "--max-examples", "16", "--held-out-fraction", "0", "--max-steps", "2", "--batch-size", "4", "--no-progress", "--no-fallback",
            "--output-dir", str(out), *extra]


def _tree(folder):
    return sorted((p.relative_to(folder).as_posix(), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


def test_train_refuses_a_folder_it_did_not_write_and_overwrites_only_its_own_run(saved, tmp_path, capsys):
    from hf_depthgrow.cli import main

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(_argv(saved, theirs)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hf-depthgrow train: will not write into {theirs}: it was not written by hf-depthgrow (no {MARKER} file); "
                   "choose another output folder"]
    assert _tree(theirs) == [("notes.txt", b"mine")]

    out = tmp_path / "run"
    assert main(_argv(saved, out)) == 0
    listed = json.loads((out / MARKER).read_text())["files"]
    assert "model/model.safetensors" in listed and "train_result.json" in listed
    capsys.readouterr()
    before = _tree(out)
    assert main(_argv(saved, out)) == 2  # an earlier run: say how to go on, change nothing
    assert capsys.readouterr().err.strip().endswith(f"{out} holds a training run written earlier: pass --resume to continue it or --overwrite to replace it")
    (out / "notes.txt").write_text("mine")
    assert main(_argv(saved, out, "--overwrite")) == 2  # a file the user put there: never deleted
    assert "it holds files hf-depthgrow did not write (notes.txt)" in capsys.readouterr().err
    assert _tree(out) == sorted([*before, ("notes.txt", b"mine")])
    (out / "notes.txt").unlink()
    assert main(_argv(saved, out, "--overwrite", "--resume")) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(_argv(saved, out, "--overwrite")) == 0
    assert json.loads((out / "train_result.json").read_text())["global_step"] == 2
