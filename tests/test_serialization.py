"""Round trips: native growth through plain transformers, adapter growth through hf_depthgrow; crash-safe saves."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import transformers

from hf_depthgrow import grow_depth, growth_record, load_pretrained, new_block_parameters, save_pretrained
from hf_depthgrow.hub.serialization import ADAPTER_WEIGHTS, MARKER
from hf_depthgrow.testing import TINY, model_output, tiny_inputs, tiny_model


def _grown(model_type, block):
    model = tiny_model(model_type)
    grow_depth(model, [0, 2, 4], block=block)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("model_type", [m for m in TINY if m not in ("bert", "roberta")])
def test_native_round_trip_with_plain_transformers(model_type, tmp_path):
    model = _grown(model_type, "native")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert not list((tmp_path / "m").glob("*.bin")) and not list((tmp_path / "m").glob("*.pt"))
    cls = getattr(transformers, model.config.architectures[0])
    loaded = cls.from_pretrained(tmp_path / "m").eval()  # no hf_depthgrow, no remote code
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    assert growth_record(loaded) == growth_record(model)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["depth_growth"]["native_indices"] == [0, 3, 6]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "bert", "roberta", "vit", "dinov2"])
def test_adapter_round_trip(model_type, tmp_path):
    model = _grown(model_type, "adapter")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / ADAPTER_WEIGHTS).exists()
    loaded = load_pretrained(tmp_path / "m").eval()
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    assert growth_record(loaded) == growth_record(model)
    # Plain transformers sees a clean base checkpoint: it loads the original model.
    cls = getattr(transformers, model.config.architectures[0])
    base = cls.from_pretrained(tmp_path / "m").eval()
    original = tiny_model(model_type)
    assert (model_output(base, inputs) - model_output(original, inputs)).abs().max().item() <= 1e-6


def test_adapters_only_save_references_the_base(tmp_path):
    base = tiny_model("bert")
    base.save_pretrained(tmp_path / "base")
    model = _grown("bert", "adapter")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "delta", adapters_only=True, base_model=str(tmp_path / "base"))
    files = sorted(p.name for p in (tmp_path / "delta").iterdir())
    assert files == [MARKER, "depthgrow_adapters.json", ADAPTER_WEIGHTS]
    loaded = load_pretrained(tmp_path / "delta").eval()
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="base_model"):
        save_pretrained(model, tmp_path / "x", adapters_only=True)
    assert not (tmp_path / "x").exists()


def test_failed_save_leaves_previous_folder_intact(tmp_path, monkeypatch):
    model = _grown("llama", "native")
    save_pretrained(model, tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folder left behind


def test_missing_adapter_file_is_a_clear_error(tmp_path):
    model = _grown("bert", "adapter")
    save_pretrained(model, tmp_path / "m")
    (tmp_path / "m" / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(ValueError, match="adapter blocks but depthgrow_adapters.safetensors is missing"):
        load_pretrained(tmp_path / "m")


def _dead_pid() -> int:
    """The pid of a process that has exited (a crashed save's leftovers carry one)."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_save_onto_a_file_is_refused(tmp_path):
    (tmp_path / "m").write_text("my notes")
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'm'} exists and is not a folder"):
        save_pretrained(tiny_model("llama"), tmp_path / "m")
    assert (tmp_path / "m").read_text() == "my notes"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_save_onto_a_foreign_folder_is_refused_but_a_previous_save_is_replaced(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="holds no saved model .* saving would delete its files"):
        save_pretrained(tiny_model("llama"), tmp_path / "docs")
    assert _files(tmp_path / "docs") == {"thesis.tex": b"years of work"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]
    save_pretrained(tiny_model("llama"), tmp_path / "m")
    save_pretrained(_grown("llama", "native"), tmp_path / "m")  # a previous save: replaced, as asked
    assert growth_record(load_pretrained(tmp_path / "m"))
    assert json.loads((tmp_path / "m" / MARKER).read_text())["hf_depthgrow"]


def test_crash_between_the_renames_keeps_the_previous_save(tmp_path, monkeypatch):
    save_pretrained(tiny_model("llama"), tmp_path / "m")
    before = _files(tmp_path / "m")
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # target moved aside, new save not yet moved in
            raise OSError("power cut")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="power cut"):
        save_pretrained(_grown("llama", "native"), tmp_path / "m")
    monkeypatch.undo()
    assert _files(tmp_path / "m") == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_leftovers_of_a_dead_save_are_recovered(tmp_path):
    """Target missing after a crash: the complete temp (marker written last) finishes the save;
    a backup alone is restored; incomplete temps and stale backups go; look-alikes stay."""
    save_pretrained(_grown("llama", "native"), tmp_path / "m")
    new = _files(tmp_path / "m")
    pid = _dead_pid()
    os.replace(tmp_path / "m", tmp_path / f".m.tmp-{pid}-abc123")  # complete, never moved in
    shutil.copytree(tmp_path / f".m.tmp-{pid}-abc123", tmp_path / f".m.old-{pid}")
    (tmp_path / f".m.tmp-{pid}-zzz").mkdir()  # incomplete: no marker
    (tmp_path / ".m.tmp-notes").mkdir()  # not our naming: never touched
    assert growth_record(load_pretrained(tmp_path / "m"))
    assert _files(tmp_path / "m") == new
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.tmp-notes", "m"]

    os.replace(tmp_path / "m", tmp_path / f".m.old-{pid}")  # only the moved-aside backup survived
    save_pretrained(tiny_model("llama"), tmp_path / "m2")
    load_pretrained(tmp_path / "m")
    assert _files(tmp_path / "m") == new


def test_stale_backup_does_not_break_the_next_save(tmp_path):
    save_pretrained(tiny_model("llama"), tmp_path / "m")
    for pid in (os.getpid(), _dead_pid()):  # a crashed save of this process, and of a dead one
        shutil.copytree(tmp_path / "m", tmp_path / f".m.old-{pid}")
    save_pretrained(_grown("llama", "native"), tmp_path / "m")
    assert growth_record(load_pretrained(tmp_path / "m"))
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_saved_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        save_pretrained(_grown("bert", "adapter"), tmp_path / "m")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o755
    for p in (tmp_path / "m").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name


def test_auto_map_never_runs_code(tmp_path):
    save_pretrained(tiny_model("llama"), tmp_path / "m")
    flag = tmp_path / "pwned"
    (tmp_path / "m" / "modeling_evil.py").write_text(f"open({str(flag)!r}, 'w').write('x')\n")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel", "AutoConfig": "modeling_evil.EvilConfig"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"m: config.json has auto_map \['AutoConfig', 'AutoModelForCausalLM'\] .* does not run it"):
        load_pretrained(tmp_path / "m")
    assert not flag.exists()


def test_pickle_weights_are_never_unpickled(tmp_path):
    save_pretrained(tiny_model("llama"), tmp_path / "m")
    flag = tmp_path / "pwned"
    (tmp_path / "m" / "model.safetensors").unlink()
    payload = (b"cbuiltins\nexec\n(V" + f"open({str(flag)!r}, 'w').write('x')".encode() + b"\ntR.")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ValueError, match=r"m has no .safetensors weights \(only pickle files \['pytorch_model.bin'\], which are never unpickled\)"):
        load_pretrained(tmp_path / "m")
    assert not flag.exists()
