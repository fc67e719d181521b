"""One split scheme in every command: the same shares and seed give the same train / held-out / test parts in `train`,
`eval` and `compare` (`hf_depthgrow.data.split_fractions`), and the old spellings (`train --eval-fraction`,
`eval --splits`) still work, with one deprecation line."""

from __future__ import annotations

import json

import pytest

from hf_depthgrow.data.sources import load_data, split_dataset, split_fractions
from hf_depthgrow.testing import byte_level_tokenizer, tiny_model

SHARES = ["--train-fraction", "0.6", "--held-out-fraction", "0.15", "--test-fraction", "0.25"]
DATA = ["--block-size", "16", "--max-examples", "40"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    # Numbered lines, so that every block differs and a part is known by its rows' tokens.
    text = " ".join(f"line {i} reads {i * 7 % 13} then {i * 3 % 11}." for i in range(400))
    (root / "data.txt").write_text(text)
    tokenizer = byte_level_tokenizer([text], vocab_size=300)
    tiny_model("llama", vocab_size=300).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


def _rows(data) -> list[tuple]:
    return [tuple(row["input_ids"].tolist()) for row in data]


def _compare_parts(saved, *extra) -> dict:
    from hf_depthgrow.cli.compare import _load, build_parser

    script, cfg = build_parser().parse(["--model", str(saved / "model"), "--data", str(saved / "data.txt"), *DATA, *SHARES,
                                        "--retention-data", "none", *extra])
    return {name: _rows(part) for name, part in _load(script, cfg)[1].items()}


def test_train_then_eval_with_the_same_shares_and_seed_score_exactly_the_test_rows_compare_uses(saved, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.evaluation.paired as paired
    import hf_depthgrow.training.trainer as trainer
    from hf_depthgrow.cli import main

    seen = {}
    real_train, real_evaluate = trainer.train, paired.evaluate_delta

    def recording_train(model, train_data, **kwargs):
        seen["train"], seen["held_out"] = _rows(train_data), _rows(kwargs["eval_data"])
        return real_train(model, train_data, **kwargs)

    def recording_evaluate(model, data, **kwargs):
        seen["evaluated"] = _rows(data)
        return real_evaluate(model, data, **kwargs)

    monkeypatch.setattr(trainer, "train", recording_train)
    monkeypatch.setattr(paired, "evaluate_delta", recording_evaluate)
    common = ["--data", str(saved / "data.txt"), *DATA, *SHARES, "--split-seed", "3"]
    assert main(["train", "--model", str(saved / "model"), "--positions", "1", *common, "--max-steps", "1", "--batch-size", "4",
                 "--no-progress", "--no-fallback", "--output-dir", str(tmp_path / "trained")]) == 0
    assert main(["eval", "--model", str(tmp_path / "trained" / "model"), *common, "--eval-split", "test", "--loss-bound", "20",
                 "--n-bootstrap", "20", "--no-evaluate", "--no-progress", "--output-dir", str(tmp_path / "eval")]) == 0
    capsys.readouterr()

    parts = _compare_parts(saved, "--seed", "3")  # compare seeds its split with --seed unless --split-seed is given
    assert parts == _compare_parts(saved, "--seed", "0", "--split-seed", "3")
    assert (len(parts["train"]), len(parts["held_out"]), len(parts["test"])) == (24, 6, 10)
    assert seen == {"train": parts["train"], "held_out": parts["held_out"], "evaluated": parts["test"]}
    assert not set(seen["train"]) & set(seen["evaluated"])  # the test part is one training never saw
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["extra"]["eval split"] == "test" and report["extra"]["examples"] == 10


def test_split_fractions_is_the_one_meaning_of_the_three_shares():
    assert split_fractions(None, 0.1, 0.0) == {"train": 0.9, "held_out": 0.1}  # none: what the others leave
    assert split_fractions(0.6, 0.15, 0.25) == {"train": 0.6, "held_out": 0.15, "test": 0.25}
    assert split_fractions(0.8, 0.0, 0.2) == {"train": 0.8, "test": 0.2}  # a share of 0: no such part
    import datasets

    data = datasets.Dataset.from_list([{"input_ids": [i]} for i in range(20)])
    with_empty = split_dataset(data, split_fractions(0.5, 0.0, 0.25), seed=1)
    with_held_out = split_dataset(data, split_fractions(0.5, 0.25, 0.25), seed=1)
    assert with_empty["train"]["input_ids"] == with_held_out["train"]["input_ids"]  # a zero part moves no other part
    for bad, message in [((0.7, 0.2, 0.2), "sum to more than 1"), ((None, 1.0, 0.0), "train_fraction must be > 0"),
                         ((0.5, -0.1, 0.0), "held_out_fraction must be a share in"), ((0.5, 0.1, True), "test_fraction must be a share in")]:
        with pytest.raises(ValueError, match=message):
            split_fractions(*bad)


def test_train_eval_fraction_still_works_as_held_out_fraction_with_one_deprecation_line(saved, tmp_path):
    from hf_depthgrow.cli.train import build_parser

    parser = build_parser()
    with pytest.warns(FutureWarning) as caught:
        args, _, _ = parser.parse(["--model", "m", "--eval-fraction", "0.2", "--split-seed", "5"])
    assert [str(w.message) for w in caught] == ["--eval-fraction is deprecated, use --held-out-fraction"]
    assert (args.train_fraction, args.held_out_fraction, args.test_fraction) == (None, 0.2, 0.0)
    model = tiny_model("llama", vocab_size=300)
    from transformers import AutoTokenizer

    data = load_data(str(saved / "data.txt"), model=model, tokenizer=AutoTokenizer.from_pretrained(saved / "model"), block_size=16,
                     max_examples=40)
    train, held_out = args.split(data)
    before = split_dataset(data, {"train": 0.8, "held_out": 0.2}, seed=5)  # the split --eval-fraction 0.2 made
    assert (_rows(train), _rows(held_out)) == (_rows(before["train"]), _rows(before["held_out"]))
    with pytest.warns(FutureWarning, match="--eval-fraction is deprecated"):
        args, _, _ = parser.parse(["--model", "m", "--eval-fraction", "0"])
    train, held_out = args.split(data)
    assert held_out is None and _rows(train) == _rows(data)  # 0: nothing held out, every row trains, in order
    (tmp_path / "c.yaml").write_text("model: m\neval_fraction: 0.3\n")
    with pytest.warns(FutureWarning, match="eval_fraction is deprecated, use held_out_fraction"):
        args, _, _ = parser.parse(["--config", str(tmp_path / "c.yaml")])
    assert args.held_out_fraction == 0.3


def test_eval_splits_still_works_as_the_three_shares_with_one_deprecation_line(saved, capsys):
    from transformers import AutoTokenizer

    from hf_depthgrow.cli.eval import build_parser, load_splits

    parser = build_parser()
    given = ["--model", "m", "--data", str(saved / "data.txt"), "--output-dir", "o", *DATA, "--split-seed", "2"]
    model, tokenizer = tiny_model("llama", vocab_size=300), AutoTokenizer.from_pretrained(saved / "model")
    data = load_data(str(saved / "data.txt"), model=model, tokenizer=tokenizer, block_size=16, max_examples=40, seed=2)
    for splits, new, part in [("train=0.8,held_out=0.1,test=0.1", "--train-fraction 0.8 --held-out-fraction 0.1 --test-fraction 0.1", "test"),
                              ("train=0.5,test=0.5", "--train-fraction 0.5 --held-out-fraction 0 --test-fraction 0.5", "train")]:
        with pytest.warns(FutureWarning) as caught:
            (args,) = parser.parse([*given, "--splits", splits, "--eval-split", part])
        assert [str(w.message) for w in caught] == [f"--splits is deprecated, use {new}"]
        before = split_dataset(data, {k: float(v) for k, v in (p.split("=") for p in splits.split(","))}, seed=2)
        parts, evaluated = load_splits(args, model, tokenizer)
        assert _rows(evaluated) == _rows(before[part]) and all(_rows(parts[k]) == _rows(v) for k, v in before.items())
    with pytest.raises(ValueError, match="--splits test=0.2,train=0.8: the parts are train, held_out, test, in that order"):
        parser.parse([*given, "--splits", "test=0.2,train=0.8"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = capsys.readouterr().out
    assert "--splits" not in shown and "--test-fraction" in shown


def test_eval_without_a_test_share_scores_every_loaded_example(saved):
    from transformers import AutoTokenizer

    from hf_depthgrow.cli.eval import build_parser, load_splits

    (args,) = build_parser().parse(["--model", "m", "--data", str(saved / "data.txt"), "--output-dir", "o", *DATA])
    model, tokenizer = tiny_model("llama", vocab_size=300), AutoTokenizer.from_pretrained(saved / "model")
    parts, evaluated = load_splits(args, model, tokenizer)
    assert _rows(evaluated) == _rows(parts["all"]) and len(evaluated) == 40 and list(parts) == ["all"]
    args.block_terms = "train"  # the block terms of the train part: the parts are made, every example is still evaluated
    parts, evaluated = load_splits(args, model, tokenizer)
    assert len(evaluated) == 40 and sorted(parts) == ["all", "held_out", "train"] and len(parts["train"]) == 36
    (args,) = build_parser().parse(["--model", "m", "--data", str(saved / "data.txt"), "--output-dir", "o", *DATA, "--eval-split", "held_out",
                                    "--held-out-fraction", "0"])
    with pytest.raises(ValueError, match="--eval-split held_out: that part is empty .its --held-out-fraction is 0."):
        load_splits(args, model, tokenizer)
