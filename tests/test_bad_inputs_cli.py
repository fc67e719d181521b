"""Bad input to any command: one line `hf-depthgrow <cmd>: <message>`, exit code 2, and nothing changed on disk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hf_depthgrow.cli import main
from hf_depthgrow.testing import tiny_model

EVIL = "from pathlib import Path\nPath(__file__).resolve().parents[2].joinpath('PWNED').write_text('x')\nclass EvilModel: pass\n"


def snapshot(root: Path) -> dict:
    """Every path under `root` with its mtime and (for files) content hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[p.relative_to(root).as_posix()] = (p.stat().st_mtime_ns, digest)
    return out


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny_model("llama").save_pretrained(root / "model")
    tiny_model("llama").save_pretrained(root / "evil")
    config = json.loads((root / "evil" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (root / "evil" / "config.json").write_text(json.dumps(config))
    (root / "evil" / "modeling_evil.py").write_text(EVIL)
    return root


@pytest.fixture
def workspace(tmp_path, monkeypatch, saved_models):
    """cwd = tmp_path holding in/model, in/evil, data.txt, a foreign folder and a few config files."""
    import shutil

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    for name in ("model", "evil"):
        shutil.copytree(saved_models / name, tmp_path / "in" / name)
    (tmp_path / "data.txt").write_text("to be or not to be\n" * 50)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.tex").write_text("years of work")
    (tmp_path / "lr.yaml").write_text("learning_rate: fast\n")
    (tmp_path / "typo.yaml").write_text("train_stepz: 3\n")
    (tmp_path / "broken.yaml").write_text("train_steps: [1, 2\n")
    (tmp_path / "routes.json").write_text('{"n_train": 100, "rho": "big"}')
    (tmp_path / "routes_typo.json").write_text('{"n_trian": 100}')
    return tmp_path


RUN = ["run", "--model", "in/model", "--data", "data.txt", "--no-progress"]
WD = "it is or holds the working directory"
CASES = [
    (RUN + ["--output-dir", ".", "--overwrite"], f"hf-depthgrow run: will not replace . with --overwrite: {WD}"),
    (RUN + ["--output-dir", "in", "--overwrite"], "hf-depthgrow run: will not replace in with --overwrite: it holds the input model in/model"),
    (RUN + ["--output-dir", "foreign", "--overwrite"],
     "hf-depthgrow run: will not replace foreign with --overwrite: it was not written by hf-depthgrow (no .hf_depthgrow_run file)"),
    (RUN + ["--output-dir", "o", "--learning-rate", "fast"], "hf-depthgrow run: argument --learning-rate: expected a float, got 'fast'"),
    (RUN + ["--output-dir", "o", "--config", "lr.yaml"], "hf-depthgrow run: lr.yaml: learning_rate: expected a float, got 'fast'"),
    (RUN + ["--output-dir", "o", "--max-steps", "-3"], "hf-depthgrow run: --max-steps must be >= 1, got -3"),
    (RUN + ["--output-dir", "o", "--max-stesp", "3"], "hf-depthgrow run: unknown option --max-stesp; did you mean --max-steps?"),
    (RUN + ["--output-dir", "o", "--config", "typo.yaml"], "hf-depthgrow run: typo.yaml: unknown key 'train_stepz'; did you mean 'train_steps'?"),
    (RUN + ["--output-dir", "o", "--config", "broken.yaml"],
     "hf-depthgrow run: broken.yaml: not valid YAML (while parsing a flow sequence: expected ',' or ']', but got '<stream end>', "
     "line 2); expected a mapping of option names to values"),
    (["run", "--model", "my models/tiny", "--output-dir", "o"], "hf-depthgrow run: no such model folder: my models/tiny"),
    (RUN + ["--output-dir", "o", "--positions", "-1"], "hf-depthgrow run: --positions must be a non-empty list of ints >= 0, got [-1]"),
    (RUN + ["--output-dir", "o", "--push-to-hub", "grown"],
     "hf-depthgrow run: repo_id 'grown' has no namespace: pass 'namespace/name', e.g. 'your-name/grown'"),
    (["run", "--model", "in/model", "--data", "missing.txt", "--output-dir", "o"], "hf-depthgrow run: no such data file or folder: missing.txt"),
    (["grow", "--model", "in/model", "--positions", "1", "--output-dir", ".", "--overwrite"], f"hf-depthgrow grow: will not replace . with --overwrite: {WD}"),
    (["grow", "--model", "in/model", "--positions", "1", "--output-dir", "foreign", "--overwrite"],
     "hf-depthgrow grow: will not replace foreign with --overwrite: it was not written by hf-depthgrow (no .hf_depthgrow_run file)"),
    (["grow", "--model", "in/model", "--positions", "1", "--output-dir", "in", "--overwrite"],
     "hf-depthgrow grow: will not replace in with --overwrite: it holds the input model in/model"),
    (["grow", "--model", "no/such/model", "--positions", "1", "--output-dir", "g"], "hf-depthgrow grow: no such model folder: no/such/model"),
    (["grow", "--model", "in/model", "--positions", "-1", "--output-dir", "g"], "hf-depthgrow grow: --positions must be ints >= 0, got [-1]"),
    (["probe", "--model", "in/model", "--data", "data.txt", "--output-dir", "p", "--positions", "3-x"],
     "hf-depthgrow probe: --positions must be ints or ranges, like 0 4 8 or 2-10, got '3-x'"),
    (["probe", "--model", "in/model", "--data", "nowhere/data.csv", "--output-dir", "p"], "hf-depthgrow probe: no such data file or folder: nowhere/data.csv"),
    (["probe", "--model", "in/model", "--data", "data.txt", "--output-dir", "p", "--threads", "0"], "hf-depthgrow probe: --threads must be >= 1, got 0"),
    (["eval", "--model", "in/model", "--data", "data.txt", "--output-dir", "e", "--routes", "routes.json"],
     "hf-depthgrow eval: --routes routes.json: rho must be a finite number, got 'big'"),
    (["eval", "--model", "in/model", "--data", "data.txt", "--output-dir", "e", "--routes", "routes_typo.json"],
     "hf-depthgrow eval: --routes routes_typo.json: unknown key 'n_trian'; did you mean 'n_train'?"),
    (["eval", "--model", "in/model", "--data", "data.txt", "--output-dir", "e", "--routes", "no.json"], "hf-depthgrow eval: no such --routes file: no.json"),
    (["eval", "--model", "in/model", "--dat", "data.txt", "--output-dir", "e"], "hf-depthgrow eval: unknown option --dat; did you mean --data?"),
    (["probe", "--model", "in/model", "--data", "data.txt", "--output-dir", "foreign"],
     "hf-depthgrow probe: foreign exists and is not empty, and --overwrite would not replace it: it was not written by hf-depthgrow (no .hf_depthgrow_run file); choose another output folder"),
    (["eval", "--model", "in/model", "--data", "data.txt", "--output-dir", "foreign", "--overwrite"],
     "hf-depthgrow eval: will not replace foreign with --overwrite: it was not written by hf-depthgrow (no .hf_depthgrow_run file)"),
    (["eval", "--model", "in/model", "--data", "data.txt", "--output-dir", "in", "--overwrite"],
     "hf-depthgrow eval: will not replace in with --overwrite: it holds the input model in/model"),
    (["train", "--model", "in/model", "--data", "missing.jsonl", "--max-steps", "2"],
     "hf-depthgrow train: no such data file or folder: missing.jsonl"),
    (["train", "--model", "./gone", "--data", "data.txt"], "hf-depthgrow train: no such model folder: ./gone"),
    (RUN + ["--output-dir", "o", "--test-fraction", "0"],
     "hf-depthgrow run: run needs a held-out and a test part: --held-out-fraction and --test-fraction must be > 0, got 0.15 and 0.0"),
    (["compare", "--model", "in/model", "--data", "data.txt", "--output-dir", "c", "--held-out-fraction", "0"],
     "hf-depthgrow compare: compare needs a held-out and a test part: --held-out-fraction and --test-fraction must be > 0, got 0.0 and 0.25"),
    (["demo", "--positions", "-1"], "hf-depthgrow demo: --positions must be >= 0, got -1"),
    (["demo", "--output-dir", "foreign"], "hf-depthgrow demo: foreign exists and is not empty, and --overwrite would not replace it: it was not written by hf-depthgrow (no .hf_depthgrow_run file); choose another output folder"),
]


def _forbid_loading(monkeypatch):
    """Fail the test if any command gets as far as loading a model: these inputs must be refused first."""

    def loader(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("hf_depthgrow.hub.loading.load_model", loader)
    monkeypatch.setattr("hf_depthgrow.data.models.load_smollm2", loader)


@pytest.mark.parametrize("argv, message", CASES, ids=[f"{i:02d}-{c[0][0]}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(argv, message, workspace, monkeypatch, capsys):
    _forbid_loading(monkeypatch)
    outside = sorted(p.name for p in workspace.parent.iterdir())
    before = snapshot(workspace)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == message
    assert snapshot(workspace) == before
    assert sorted(p.name for p in workspace.parent.iterdir()) == outside


def test_hostile_auto_map_is_never_imported(workspace, capsys):
    """A config.json whose auto_map names code that writes a file: neither load_model nor the CLI runs it."""
    from hf_depthgrow.hub.loading import load_model

    before = snapshot(workspace)
    assert main(["grow", "--model", "in/evil", "--positions", "1", "--output-dir", "g"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hf-depthgrow grow: evil: config.json has auto_map ['AutoModelForCausalLM'] (custom code shipped with the model); "
        "hf_depthgrow does not run it. Pass trust_remote_code=True only if you trust that code."
    )
    with pytest.raises(ValueError, match="auto_map"):
        load_model("in/evil")
    assert not (workspace / "PWNED").exists()
    assert snapshot(workspace) == before
