"""Continued pretraining from a stream (hf_depthgrow.data.streaming): packing, order, resume, short streams."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.data.lm_blocks import causal_lm_blocks
from hf_depthgrow.data.streaming import StreamedBlocks, StreamTooShortError, stream_data
from hf_depthgrow.testing import byte_level_tokenizer, tiny_model
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.trainer import GrownTrainer, train

WORDS = "to be or not to be that is the question whether tis nobler in the mind to suffer the slings".split()
DOCS = [" ".join(WORDS[i % 7 :] + WORDS[: i % 5]) + f" {i}" for i in range(120)]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(DOCS)


def _shards(folder, docs=DOCS, per_shard=40):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(docs), per_shard):
        with open(folder / f"shard-{s // per_shard:03d}.jsonl", "w") as f:
            for doc in docs[s : s + per_shard]:
                f.write(json.dumps({"text": doc}) + "\n")
    return folder


def _grown(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    grow_depth(model, [2])
    return model


def test_streamed_blocks_are_the_materialised_blocks_in_order(tokenizer, tmp_path):
    held_out, rows = stream_data(str(_shards(tmp_path / "c")), tokenizer, block_size=16, train_blocks=40, held_out_blocks=8)
    expected = causal_lm_blocks(tokenizer, DOCS, 16, max_blocks=48)
    assert torch.equal(torch.stack([r["input_ids"] for r in held_out]), expected[:8])
    assert torch.equal(torch.stack([rows[i]["input_ids"] for i in range(40)]), expected[8:48])
    assert rows.opened == 1  # one pass in stream order (the check pass reads its own copy)
    rows[3]  # behind the read position but inside the window: no reopening
    assert rows.opened == 1


def test_training_reads_a_stream_once_in_order_without_repeating_a_block(tokenizer, tmp_path):
    _, rows = stream_data(str(_shards(tmp_path / "c")), tokenizer, block_size=16, train_blocks=24, held_out_blocks=0)
    seen = []
    original = StreamedBlocks.__getitem__

    def spy(self, index):
        seen.append(int(index))
        return original(self, index)

    StreamedBlocks.__getitem__ = spy
    try:
        result = train(_grown(tokenizer), rows, max_steps=6, per_device_train_batch_size=4, fallback=False,
                       progress_bar=False, output_dir=str(tmp_path / "out"))
    finally:
        StreamedBlocks.__getitem__ = original
    assert result.global_step == 6
    assert seen == list(range(24))  # 6 steps x 4 rows, in stream order, each once
    assert result.prefix_cache is None  # one pass: a cache would save nothing and hold the corpus
    with pytest.raises(ValueError, match="cannot cache streamed training rows"):
        train(_grown(tokenizer), rows, max_steps=6, per_device_train_batch_size=4, fallback=False, prefix_cache="memory",
              progress_bar=False, output_dir=str(tmp_path / "out2"))


def test_a_resumed_stream_ends_with_the_weights_of_an_uninterrupted_run(tokenizer, tmp_path):
    corpus = str(_shards(tmp_path / "c"))
    settings = dict(max_steps=6, per_device_train_batch_size=4, fallback=False, progress_bar=False, seed=3)

    def run(out, **extra):
        torch.manual_seed(0)
        _, rows = stream_data(corpus, tokenizer, block_size=16, train_blocks=24, held_out_blocks=4)
        return train(_grown(tokenizer), rows, output_dir=str(out), **settings, **extra)

    straight = run(tmp_path / "straight")
    # Stop after 3 steps by training a 3-step prefix of the same schedule: a checkpoint at step 3 of 6.
    stopped = tmp_path / "stopped"
    trainer_rows = stream_data(corpus, tokenizer, block_size=16, train_blocks=24, held_out_blocks=4)[1]
    torch.manual_seed(0)
    config = TrainConfig(output_dir=str(stopped), save_steps=3, **settings)
    trainer = GrownTrainer(_grown(tokenizer), config, train_dataset=trainer_rows)
    trainer.begin()
    trainer.run_steps(3)
    trainer.close()
    checkpoint = GrownTrainer.list_checkpoints(stopped)[-1]
    resumed = run(stopped, resume_from_checkpoint=str(checkpoint), save_steps=3)
    assert resumed.global_step == 6
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.2.mlp.down_proj.weight"].abs().sum() > 0  # the new block trained: the equality is not trivial


def test_a_stream_that_ends_before_the_run_needs_is_refused_before_training(tokenizer, tmp_path):
    corpus = _shards(tmp_path / "c", DOCS[:10])
    with pytest.raises(StreamTooShortError, match=r"gives \d+ training blocks .* fewer than the 500 the run needs"):
        stream_data(str(corpus), tokenizer, block_size=16, train_blocks=500, held_out_blocks=2)
    _, rows = stream_data(str(corpus), tokenizer, block_size=16, train_blocks=8)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="holds 8 rows, fewer than 5 steps x 4 rows per step"):
        train(_grown(tokenizer), rows, max_steps=5, per_device_train_batch_size=4, fallback=False, output_dir=str(out))
    assert not out.exists() or not any(out.iterdir())


def test_a_hub_id_is_streamed_with_datasets_and_refused_offline(tokenizer, tmp_path, monkeypatch):
    calls = []

    def load_dataset(source, split, streaming):
        calls.append((source, split, streaming))
        return datasets.IterableDataset.from_generator(lambda: ({"text": d} for d in DOCS))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    _, rows = stream_data("someone/corpus", tokenizer, block_size=16, train_blocks=8)
    assert torch.equal(rows[7]["input_ids"], causal_lm_blocks(tokenizer, DOCS, 16, max_blocks=8)[7])
    assert calls[0] == ("someone/corpus", "train", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls.clear()
    with pytest.raises(ValueError, match="not a local path, and the Hub is switched off"):
        stream_data("someone/corpus", tokenizer, block_size=16, train_blocks=8)
    assert calls == []  # offline: no load attempted


def test_token_ids_the_model_cannot_score_are_refused_by_the_check_pass(tokenizer, tmp_path):
    small = tiny_model("llama", vocab_size=64)  # the byte-level tokenizer's ids reach 300
    with pytest.raises(ValueError, match="token"):
        stream_data(str(_shards(tmp_path / "c")), tokenizer, block_size=16, train_blocks=8, model=small)


def test_train_streams_from_the_command_line_and_refuses_a_short_stream_in_one_line(tokenizer, tmp_path, capsys):
    from hf_depthgrow.cli.train import main

    base = tmp_path / "base"
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    corpus = str(_shards(tmp_path / "c"))
    args = ["--model", str(base), "--data", corpus, "--streaming", "--positions", "2", "--block-size", "16",
            "--batch-size", "4", "--held-out-blocks", "4", "--no-progress", "--no-fallback"]
    assert main(args + ["--max-steps", "3", "--output-dir", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["global_step"] == 3
    short = tmp_path / "short"
    assert main(args + ["--max-steps", "500", "--output-dir", str(short)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]  # transformers' bar
    assert len(err) == 1 and "fewer than the 2000 the run needs" in err[0], err
    assert not short.exists()
