"""Bad inputs and faults for save / load / push / card / evaluate: one clear error each, nothing changed on disk.

Each case gets its own `tmp_path`; the wrapper asserts that nothing outside it (the working folder,
the sibling test folders) changed, and each case asserts what it must leave inside it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_depthgrow import grow_depth, load_pretrained, save_pretrained
from hf_depthgrow.evaluation import evaluate_delta
from hf_depthgrow.evaluation import metrics as ev_metrics
from hf_depthgrow.growth.record import InvalidGrowthRecordError
from hf_depthgrow.hub.model_card import render_model_card
from hf_depthgrow.hub.push import check_repo_id, push_model_to_hub, push_to_hub
from hf_depthgrow.hub.serialization import MARKER
from hf_depthgrow.testing import tiny_inputs, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:loss_bound not given")


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def _saved(tmp_path, name="m"):
    save_pretrained(grow_depth(tiny_model("llama"), [1]), tmp_path / name)
    return tmp_path / name


def _rows(model, n=4):
    batch = tiny_inputs(model, batch=n, seq=6, seed=0)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


# --------------------------------------------------------------------------- the cases


def save_onto_a_file(tmp_path):
    (tmp_path / "m").write_text("notes")
    with pytest.raises(FileExistsError, match=f"^{tmp_path / 'm'} exists and is not a folder: save_pretrained writes a folder"):
        save_pretrained(tiny_model("llama"), tmp_path / "m")
    assert _tree(tmp_path) == {"m": b"notes"}


def save_onto_a_foreign_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "thesis.tex").write_text("work")
    with pytest.raises(FileExistsError, match=f"^{tmp_path / 'm'} is a folder that holds no saved model"):
        save_pretrained(tiny_model("llama"), tmp_path / "m")
    assert _tree(tmp_path) == {"m/thesis.tex": b"work"}


def stale_backup_of_a_dead_save(tmp_path):
    folder = _saved(tmp_path)
    before = _tree(folder)
    os.replace(folder, tmp_path / f".m.old-{_dead_pid()}")  # the crash left only the moved-aside save
    load_pretrained(folder)  # rolled back: the previous save is in place again
    assert _tree(tmp_path) == {f"m/{k}": v for k, v in before.items()}


def crash_between_the_renames(tmp_path, monkeypatch):
    folder = _saved(tmp_path)
    before = _tree(tmp_path)
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("power cut")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="^power cut$"):
        save_pretrained(tiny_model("llama"), folder)
    monkeypatch.undo()
    assert _tree(tmp_path) == before


def pickle_weights_named_bin(tmp_path):
    folder = _saved(tmp_path)
    (folder / "model.safetensors").unlink()
    flag = tmp_path / "pwned"
    (folder / "pytorch_model.bin").write_bytes(b"cbuiltins\nexec\n(V" + f"open({str(flag)!r}, 'w')".encode() + b"\ntR.")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=r"^m has no .safetensors weights \(only pickle files \['pytorch_model.bin'\]"):
        load_pretrained(folder)
    with pytest.raises(ValueError, match=r"holds pickle files \['pytorch_model.bin'\]"):
        push_to_hub(folder, "me/grown", token=False, endpoint="http://127.0.0.1:9")
    assert not flag.exists() and _tree(tmp_path) == before


def hostile_auto_map(tmp_path):
    folder = _saved(tmp_path)
    flag = tmp_path / "pwned"
    (folder / "modeling_evil.py").write_text(f"open({str(flag)!r}, 'w').write('x')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.C", "AutoModelForCausalLM": "modeling_evil.M"}
    (folder / "config.json").write_text(json.dumps(config))
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=r"^m: config.json has auto_map \['AutoConfig', 'AutoModelForCausalLM'\]"):
        load_pretrained(folder)
    assert not flag.exists() and _tree(tmp_path) == before


def forged_growth_record(tmp_path):
    folder = _saved(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["depth_growth"]["base_num_layers"] -= 1
    config["depth_growth"]["num_layers"] -= 1  # self-consistent, but not these weights
    (folder / "config.json").write_text(json.dumps(config))
    before = _tree(tmp_path)
    with pytest.raises(InvalidGrowthRecordError, match="^m: growth record says 4 layers but the model has 5"):
        load_pretrained(folder)
    assert _tree(tmp_path) == before


def repo_id_without_namespace(tmp_path):
    with pytest.raises(ValueError, match=r"^repo_id 'grown' has no namespace: pass 'namespace/name', e.g. 'your-name/grown'$"):
        check_repo_id("grown")


def repo_id_with_dot_dot(tmp_path):
    with pytest.raises(ValueError, match=r"^repo_id 'me/\.\.' is not a valid Hub repository id"):
        check_repo_id("me/..")


def repo_id_path_traversal(tmp_path):
    with pytest.raises(ValueError, match=r"^repo_id '\.\./\.\./etc' is not a valid Hub repository id"):
        push_model_to_hub(tiny_model("llama"), "../../etc", token=False)
    assert _tree(tmp_path) == {}


def push_without_repo_id(tmp_path):
    with pytest.raises(ValueError, match="^repo_id is required"):
        push_model_to_hub(tiny_model("llama"), None, token=False)


def card_with_a_bad_license(tmp_path):
    with pytest.raises(ValueError, match="^CardInfo.license must be a Hub license id such as 'apache-2.0', got 'Apache 2.0'$"):
        render_model_card({"base_model": "gpt2", "license": "Apache 2.0"})


def evaluation_data_with_another_vocabulary(tmp_path):
    model = grow_depth(tiny_model("llama"), [1])
    rows = _rows(model)
    rows[2]["input_ids"][1] = 500  # the tiny vocabulary is 128
    with pytest.raises(ValueError, match=r"outside the vocabulary.*max id 500.*\[2\].*tokenizer does not match"):
        evaluate_delta(model, rows, loss_bound=10.0, n_bootstrap=20)


def evaluation_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(ev_metrics, "_HF_METRICS", {})
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    model = grow_depth(tiny_model("bert"), [1], block="adapter")
    result = evaluate_delta(model, _rows(model), loss_bound=5.0, n_bootstrap=20)
    assert attempts == [] and "evaluate not used: HF_HUB_OFFLINE is set" in result.metrics["source"]


CASES = [
    save_onto_a_file, save_onto_a_foreign_folder, stale_backup_of_a_dead_save, crash_between_the_renames,
    pickle_weights_named_bin, hostile_auto_map, forged_growth_record, repo_id_without_namespace, repo_id_with_dot_dot,
    repo_id_path_traversal, push_without_repo_id, card_with_a_bad_license, evaluation_data_with_another_vocabulary,
    evaluation_offline,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input(case, tmp_path, monkeypatch):
    outside = [Path.cwd(), tmp_path.parent]
    before = {str(d): sorted(p.name for p in d.iterdir()) for d in outside}
    args = (tmp_path, monkeypatch) if "monkeypatch" in case.__code__.co_varnames[: case.__code__.co_argcount] else (tmp_path,)
    case(*args)
    assert {str(d): sorted(p.name for p in d.iterdir()) for d in outside} == before
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != MARKER]
    assert leftovers == [], leftovers  # no temp or backup folder left behind


def test_the_matrix_covers_at_least_ten_cases():
    assert len(CASES) >= 10
