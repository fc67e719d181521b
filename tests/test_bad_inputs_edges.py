"""Edges of bad input: special files as data, bounded reads, non-UTF-8 text, block sizes beyond the
model's positions, non-finite weights, and settings and faults that must not end in a traceback."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from hf_depthgrow.cli import main
from hf_depthgrow.data import causal_lm_blocks, load_data
from hf_depthgrow.data import text_files
from hf_depthgrow.testing import tiny_model

from tiny_lm import make_tiny_lm


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    root = make_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))
    tok = transformers.AutoTokenizer.from_pretrained(root / "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "tiny")
    return root, model, tok


def _in_thread(fn, timeout: float = 60):
    """Run `fn` in a daemon thread; fail (instead of hanging the suite) if it has not returned in `timeout` s."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the test below
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s (blocked on a read?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------------------------------------------------------------
# Defect 5: special files as data, and reads bounded by max_examples
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_fifo_as_data_is_refused_at_once_not_read_for_ever(tiny_lm, tmp_path):
    _, model, tok = tiny_lm
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"^data path .*data\.txt is a named pipe \(FIFO\), not a regular file or folder$"):
        _in_thread(lambda: load_data(str(fifo), model=model, tokenizer=tok, block_size=16, max_examples=4))


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_dev_zero_as_data_is_refused_not_a_memory_error(tiny_lm):
    _, model, tok = tiny_lm
    with pytest.raises(ValueError, match=r"^data path /dev/zero is a character device, not a regular file or folder$"):
        _in_thread(lambda: load_data("/dev/zero", model=model, tokenizer=tok, block_size=16, max_examples=4))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_run_with_a_fifo_as_data_is_one_line_exit_2_and_writes_nothing(tiny_lm, tmp_path, monkeypatch, capsys):
    root, _, _ = tiny_lm
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe")
    code = _in_thread(lambda: main(["run", "--model", str(root / "tiny"), "--data", "pipe", "--output-dir", "o", "--no-progress"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == "hf-depthgrow run: data path pipe is a named pipe (FIFO), not a regular file or folder"
    assert sorted(os.listdir(tmp_path)) == ["pipe"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_the_input_checks_refuse_a_fifo_before_a_model_loads(tmp_path):
    from hf_depthgrow.pipeline.checks import check_data_source

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match=r"^retention data path .*pipe is a named pipe \(FIFO\), not a regular file or folder$"):
        check_data_source(str(tmp_path / "pipe"), "retention data")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_the_lm_eval_text_source_refuses_a_fifo_and_reads_a_file_only_as_far_as_needed(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from hf_depthgrow.evaluation.lm_eval_task import check_text_source, text_documents

    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(ValueError, match=r"^data path .*pipe\.txt is a named pipe \(FIFO\), not a regular file or folder$"):
        _in_thread(lambda: check_text_source(str(tmp_path / "pipe.txt")))
    os.remove(tmp_path / "pipe.txt")
    big = tmp_path / "big.txt"
    big.write_text(("word " * 19 + "\n") * 200_000)  # 20 MB
    chars, read = [], text_files.TextFile._read
    monkeypatch.setattr(text_files.TextFile, "_read", lambda self, f, size: chars.append(size) or read(self, f, size))
    docs = text_documents(str(big), max_docs=4, doc_chars=500)
    assert len(docs) == 4 and sum(chars) <= 2 * text_files.PIECE_CHARS  # not the 20 MB


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_special_files_inside_a_data_folder_are_skipped(tiny_lm, tmp_path):
    root, model, tok = tiny_lm
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text((root / "sample.txt").read_text()[:20_000])
    os.mkfifo(folder / "b.txt")
    ds = _in_thread(lambda: load_data(str(folder), model=model, tokenizer=tok, block_size=16, max_examples=4))
    assert len(ds) == 4


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's per-process I/O counters")
def test_a_large_text_file_is_read_only_as_far_as_max_examples_needs(tiny_lm, tmp_path):
    root, model, tok = tiny_lm
    text = (root / "sample.txt").read_text()
    big = tmp_path / "big.txt"
    with big.open("w") as f:
        for _ in range(32 * 2**20 // len(text) + 1):  # 32 MiB
            f.write(text)

    def bytes_read() -> int:
        return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar")).split()[1])

    before = bytes_read()
    ds = load_data(str(big), model=model, tokenizer=tok, block_size=32, max_examples=8)
    read = bytes_read() - before
    assert len(ds) == 8
    # 8 blocks of 32 tokens need a few kB; one piece is PIECE_CHARS (256 Ki characters), plus what imports read.
    assert read < 4 * 2**20, f"read {read / 2**20:.1f} MiB of a 32 MiB file for 8 blocks"


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's per-process I/O counters")
def test_json_lines_are_read_only_as_far_as_max_examples_needs_and_give_the_same_blocks(tiny_lm, tmp_path, monkeypatch):
    from hf_depthgrow.data import sources

    root, model, tok = tiny_lm
    lines = (root / "sample.txt").read_text().splitlines()
    rows = "".join(json.dumps({"id": j, "text": "\n".join(lines[j : j + 20])}) + "\n" for j in range(0, len(lines), 20))
    big = tmp_path / "big.jsonl"
    big.write_text(rows * (16 * 2**20 // len(rows) + 1))  # 16 MiB
    load_data(str(big), model=model, tokenizer=tok, block_size=8, max_examples=1)  # imports read files too: done first
    before = int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])
    lazy = load_data(str(big), model=model, tokenizer=tok, block_size=32, max_examples=8)
    read = int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0]) - before
    assert read < 2**20, f"read {read / 2**20:.1f} MiB of a 16 MiB file for 8 blocks"
    small = tmp_path / "small.jsonl"
    small.write_text(rows)
    read_all = sources._read_local
    monkeypatch.setattr(sources, "_read_local", lambda path, t, l, lazy=False: read_all(path, t, l, lazy=False))
    eager = load_data(str(small), model=model, tokenizer=tok, block_size=32, max_examples=8)
    assert torch.equal(torch.stack(list(eager["input_ids"])), torch.stack(list(lazy["input_ids"])))


def test_a_json_line_that_is_not_json_is_one_line(tiny_lm, tmp_path):
    _, model, tok = tiny_lm
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "to be or not to be"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl: line 2 is not JSON \(Expecting value: line 1 column 10 \(char 9\)\)$"):
        load_data(str(path), model=model, tokenizer=tok, block_size=4, max_examples=100)


@pytest.mark.parametrize("indent", ["", "   "])  # indented: no line end between two non-blanks, cut before a word
def test_pieces_of_a_file_give_the_same_blocks_as_the_whole_text(tiny_lm, tmp_path, indent):
    root, _, tok = tiny_lm
    path = tmp_path / "a.txt"
    sample = "\n".join(indent + line for line in (root / "sample.txt").read_text()[:30_000].splitlines())
    path.write_text(sample + "\r\nlast line\r\n  indented\n\n")
    whole = causal_lm_blocks(tok, [path.read_text()], 8)
    pieces = list(text_files.TextFile(path, piece_chars=1000))
    assert len(pieces) > 20 and "".join(pieces) == path.read_text() and max(map(len, pieces)) <= 1000
    assert torch.equal(causal_lm_blocks(tok, [text_files.TextFile(path, piece_chars=1000)], 8), whole)


def test_a_file_without_line_ends_is_still_cut_into_bounded_pieces(tmp_path):
    path = tmp_path / "one_line.txt"
    path.write_text("x" * 10_500)
    pieces = list(text_files.TextFile(path, piece_chars=1000))
    assert "".join(pieces) == "x" * 10_500 and max(map(len, pieces)) <= 1000


def test_non_utf8_bytes_are_replaced_with_one_warning_naming_the_file_and_count(tiny_lm, tmp_path):
    _, model, tok = tiny_lm
    path = tmp_path / "latin1.txt"
    path.write_bytes(("caf\xe9 na\xefve " * 200).encode("latin-1"))
    with pytest.warns(UnicodeWarning) as record:
        ds = load_data(str(path), model=model, tokenizer=tok, block_size=16, max_examples=2)
    assert len(ds) == 2
    messages = [str(w.message) for w in record if issubclass(w.category, UnicodeWarning)]
    # max_examples=2 stops early, so the count is what was read: the whole of this small file (one piece).
    assert messages == [f"{path}: 400 byte(s) that are not UTF-8 were replaced by U+FFFD"]


def test_clean_utf8_text_gives_no_warning(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("na\u00efve caf\u00e9 \ufffd stays\n" * 10, encoding="utf-8")  # a literal U+FFFD is not a replacement
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "".join(text_files.TextFile(path)) == path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# Block size beyond the model's positions
# ---------------------------------------------------------------------------------------------------------------------


def test_a_block_beyond_gpt2s_learned_positions_is_refused_before_any_work(tiny_lm):
    root, _, tok = tiny_lm
    gpt2 = tiny_model("gpt2", vocab_size=len(tok))  # n_positions=128
    message = (
        r"^the data '.*sample\.txt' tokenized by \w+: sequences of 256 tokens, but GPT2LMHeadModel "
        r"has 128 learned positions: use block_size <= 128$"
    )
    with pytest.raises(ValueError, match=message):
        load_data(str(root / "sample.txt"), model=gpt2, tokenizer=tok, block_size=256, max_examples=2)
    assert len(load_data(str(root / "sample.txt"), model=gpt2, tokenizer=tok, block_size=128, max_examples=2)) == 2


def test_the_check_is_the_one_every_consumer_runs_so_probe_data_of_any_form_is_refused():
    from hf_depthgrow import probe

    gpt2 = tiny_model("gpt2")
    ids = torch.randint(0, 128, (2, 200))
    with pytest.raises(ValueError, match="sequences of 200 tokens, but GPT2LMHeadModel has 128 learned positions"):
        probe(gpt2, {"input_ids": ids, "labels": ids})


@pytest.mark.parametrize("model_type, limit", [("bert", 64), ("roberta", 62)])
def test_encoders_learned_positions_count_roberta_padding_offset(model_type, limit):
    from hf_depthgrow.data.checks import check_batch, position_limit

    model = tiny_model(model_type)
    assert position_limit(model) == (limit, True)
    ok = torch.full((1, limit), 5)
    model(input_ids=ok)  # the limit is really the longest input the model accepts
    check_batch(model, {"input_ids": ok, "labels": torch.tensor([0])}, where="x")
    with pytest.raises(ValueError, match=f"use block_size <= {limit}$"):
        check_batch(model, {"input_ids": torch.full((1, limit + 1), 5), "labels": torch.tensor([0])}, where="x")


def test_a_rope_block_beyond_max_position_embeddings_is_warned_not_refused(tiny_lm):
    root, model, tok = tiny_lm  # Llama, max_position_embeddings=128
    with pytest.warns(UserWarning, match=r"sequences of 512 tokens exceed the max_position_embeddings=128 of LlamaForCausalLM"):
        ds = load_data(str(root / "sample.txt"), model=model, tokenizer=tok, block_size=512, max_examples=2)
    assert len(ds) == 2 and len(ds[0]["input_ids"]) == 512
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_data(str(root / "sample.txt"), model=model, tokenizer=tok, block_size=128, max_examples=2)


# ---------------------------------------------------------------------------------------------------------------------
# One line instead of a traceback: disk full, a pickle in a checkpoint, a device this machine lacks, a bad seed
# ---------------------------------------------------------------------------------------------------------------------


def _full_disk_writers():
    from safetensors import SafetensorError

    return {
        "OSError": lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")),
        # What safetensors raises for the same thing: its Rust io::Error, as text.
        "SafetensorError": lambda *a, **k: (_ for _ in ()).throw(
            SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
        ),
    }


@pytest.mark.parametrize("raised", ["OSError", "SafetensorError"])
def test_a_full_disk_on_save_says_no_space_left_and_leaves_the_old_save(tmp_path, monkeypatch, raised):
    import transformers.modeling_utils

    from hf_depthgrow import grow_depth, save_pretrained
    from hf_depthgrow.hub.serialization import NoSpaceError

    model = grow_depth(tiny_model("llama"), [1])
    save_pretrained(model, tmp_path / "grown")
    before = {p.name: p.read_bytes() for p in (tmp_path / "grown").iterdir()}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _full_disk_writers()[raised])
    with pytest.raises(NoSpaceError) as caught:
        save_pretrained(model, tmp_path / "grown")
    target = tmp_path / "grown"
    assert str(caught.value) == (
        f"no space left on {target}: the save was rolled back and what was there is unchanged; free some space and save again"
    )
    assert caught.value.errno == 28
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grown"]  # no temp folder left beside it


def test_a_full_disk_on_grow_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    import transformers.modeling_utils

    monkeypatch.chdir(tmp_path)
    tiny_model("llama").save_pretrained("model")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _full_disk_writers()["SafetensorError"])
    code = main(["grow", "--model", "model", "--positions", "1", "--output-dir", "grown"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert err.strip().splitlines()[-1].startswith("hf-depthgrow grow: no space left on ")
    assert code == 1  # the machine's state, not bad input (cli.common)
    assert sorted(os.listdir(tmp_path)) == ["model"]


def _evil_pickle(path: Path) -> Path:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {path.parent / 'PWNED'}",))

    path.write_bytes(pickle.dumps(Evil()))
    return path


def test_a_pickle_refused_by_torch_load_is_one_line_and_never_runs(tmp_path, capsys):
    from hf_depthgrow.cli.common import run_command

    evil = _evil_pickle(tmp_path / "optimizer.pt")
    code = run_command("train", lambda argv: torch.load(evil, weights_only=True), [])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err == (
        "hf-depthgrow train: refused to load a pickle file that holds more than tensors (loading it could run code; it was "
        "not run): only files this tool wrote, or safetensors, are loaded\n"
    )
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("device", ["tpu:7", "cuda:99"])
def test_a_device_this_machine_cannot_use_is_one_line(device, capsys):
    from hf_depthgrow.cli.common import run_command

    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 99:
        pytest.skip("this machine has that device")
    code = run_command("probe", lambda argv: tiny_model("llama").to(device), [])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("hf-depthgrow probe: unusable device: ")


def test_a_real_bug_keeps_its_traceback():
    from hf_depthgrow.cli.common import run_command

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_command("probe", lambda argv: (_ for _ in ()).throw(RuntimeError("shape mismatch")), [])


def test_a_negative_seed_is_refused_naming_the_setting():
    from hf_depthgrow.evaluation.checks import check_level
    from hf_depthgrow.pipeline.config import RunConfig

    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1$"):
        RunConfig(model="m", data="shakespeare", output_dir="o", seed=-1)
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1$"):
        check_level(0.05, 100, -1)  # evaluate_delta / compare_models, and so `hf-depthgrow eval --seed -1`


# ---------------------------------------------------------------------------------------------------------------------
# A mergekit plan's model: must be the model being grown, and is never stored as a local path
# ---------------------------------------------------------------------------------------------------------------------


def _plan(path: Path, model: str) -> Path:
    path.write_text(
        f"merge_method: passthrough\nslices:\n- sources:\n  - model: {model}\n    layer_range: [0, 2]\n"
        f"- sources:\n  - model: {model}\n    layer_range: [1, 4]\n"
    )
    return path


@pytest.fixture
def two_saved_models(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "models" / "tiny-a")
    tiny_model("llama", seed=1).save_pretrained(tmp_path / "models" / "tiny-b")
    tiny_model("llama", hidden_size=64).save_pretrained(tmp_path / "models" / "wider")
    return tmp_path / "models"


def test_a_plan_for_another_model_is_refused_before_any_change(two_saved_models, tmp_path):
    from hf_depthgrow import grow_depth

    model = transformers.AutoModelForCausalLM.from_pretrained(two_saved_models / "tiny-a")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for other in (str(two_saved_models / "tiny-b"), "someone/tiny-b"):
        plan = _plan(tmp_path / "plan.yaml", other)
        with pytest.raises(ValueError, match=rf"^this mergekit config copies layers of '{other}', but the model being grown is "):
            grow_depth(model, str(plan), block="native")
    assert model.config.num_hidden_layers == 4 and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_plan_naming_the_model_by_hub_id_folder_or_copy_is_accepted(two_saved_models, tmp_path):
    import shutil

    from hf_depthgrow import grow_depth

    shutil.copytree(two_saved_models / "tiny-a", tmp_path / "copy-of-a")
    for named in ("me/tiny-a", "ME/Tiny-A", str(two_saved_models / "tiny-a"), str(tmp_path / "copy-of-a")):
        model = transformers.AutoModelForCausalLM.from_pretrained(two_saved_models / "tiny-a")
        grow_depth(model, str(_plan(tmp_path / "plan.yaml", named)), block="native")
        assert model.config.num_hidden_layers == 5, named


def test_an_unnamed_model_is_checked_against_a_local_folders_config(two_saved_models, tmp_path):
    from hf_depthgrow import grow_depth

    model = tiny_model("llama")  # built in memory: no name to compare
    with pytest.raises(ValueError, match="copies layers of .*wider', but the model being grown is 'an unnamed LlamaForCausalLM'"):
        grow_depth(model, str(_plan(tmp_path / "plan.yaml", str(two_saved_models / "wider"))), block="native")
    grow_depth(model, str(_plan(tmp_path / "plan.yaml", "my/model")), block="native")  # a Hub id: nothing to compare
    assert model.config.num_hidden_layers == 5


def test_a_plans_local_path_is_never_stored_in_config_json(two_saved_models, tmp_path):
    from hf_depthgrow import grow_depth, save_pretrained

    model = transformers.AutoModelForCausalLM.from_pretrained(two_saved_models / "tiny-a")
    grow_depth(model, str(_plan(tmp_path / "plan.yaml", str(two_saved_models / "tiny-a"))), block="native")
    save_pretrained(model, tmp_path / "grown")
    config = (tmp_path / "grown" / "config.json").read_text()
    record = json.loads(config)["depth_growth"]
    assert record["history"][0]["config"]["placement"]["spec"]["slices"][0]["sources"][0]["model"] == "tiny-a"
    assert str(tmp_path) not in config
