"""One spelling per option across the commands: the concept table, the old spellings, the generated flag table of docs/cli.md."""

from __future__ import annotations

import argparse
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_depthgrow.cli.flag_table import command_parsers, updated
from hf_depthgrow.cli.spelling import CONCEPTS, check_spelling
from hf_depthgrow.config import SHARED_HELP, ConfigError, ConfigParser, shared_field

REPO = Path(__file__).resolve().parents[1]
PARSERS = command_parsers()


def test_no_two_commands_spell_one_concept_differently():
    assert check_spelling(PARSERS) == []


def test_the_spelling_check_names_every_kind_of_departure():
    @dataclass
    class Odd:
        model: str = shared_field("model")
        steps: int = field(default=1, metadata={"help": "Steps.", "flag": "--train-steps"})
        batch_size: int = field(default=1, metadata={"help": "Batch.", "flag": "--batch"})

    @dataclass
    class EstimateArguments:  # a field the table lists (EstimateArguments.batch_size) under another flag
        batch_size: int = field(default=1, metadata={"help": "Batch.", "flag": "--micro-batch"})

    @dataclass
    class EvalArguments:  # the split spelled otherwise than in run, train and compare
        eval_fraction: float = field(default=0.1, metadata={"help": "Held-out share."})
        test_fraction: float = field(default=0.1, metadata={"help": "Test share.", "flag": "--test-share"})

    problems = check_spelling({"grow": ConfigParser([Odd]), "estimate": ConfigParser([EstimateArguments]),
                               "eval": ConfigParser([EvalArguments])})
    assert "grow: --train-steps (Odd.steps) is an old spelling of steps: use --max-steps" in problems
    assert "grow: --batch (Odd.batch_size) is an old spelling of batch size: use --batch-size" in problems
    assert "estimate: EstimateArguments.batch_size is batch size but its flag is --micro-batch: use --batch-size" in problems
    assert "grow: no --trust-remote-code" in problems and "grow: no --overwrite" in problems
    assert any(p.startswith("RunConfig.train_steps (in the table of steps) is in no command") for p in problems)
    assert "eval: --eval-fraction (EvalArguments.eval_fraction) is an old spelling of held-out share: use --held-out-fraction" in problems
    assert "eval: EvalArguments.test_fraction is test share but its flag is --test-share: use --test-fraction" in problems


def test_every_command_that_splits_takes_the_same_split_flags():
    """run, train, eval and compare split their data one way: the same five flags, each with its one help text."""
    split = {"--train-fraction": "train_fraction", "--held-out-fraction": "held_out_fraction", "--test-fraction": "test_fraction",
             "--split-seed": "split_seed", "--split-by": "split_by"}
    for command in ("run", "train", "eval", "compare"):
        parser = PARSERS[command]
        for flag, name in split.items():
            assert flag in parser.flags, (command, flag)
            assert parser.specs[parser.flags[flag]].metadata["help"].startswith(SHARED_HELP[name]), (command, flag)


def test_docs_cli_flag_table_is_up_to_date():
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert updated(text, PARSERS) == text, "docs/cli.md is out of date: run python -m hf_depthgrow.cli.flag_table --write docs/cli.md"
    for command, parser in PARSERS.items():  # every visible flag of every command is in it
        section = text.split(f"### `hf-depthgrow {command}`", 1)[1].split("\n### ", 1)[0]
        visible = [f for f, name in parser.flags.items() if not parser.specs[name].metadata.get("hidden")]
        assert visible and all(f"| `{flag}` |" in section for flag in visible), command


def test_shared_options_have_one_help_text():
    shared = {"--model": "model", "--data": "data", "--output-dir": "output_dir", "--overwrite": "overwrite",
              "--trust-remote-code": "trust_remote_code", "--block-size": "block_size", "--max-examples": "max_examples",
              "--dtype": "dtype"}
    for command, parser in PARSERS.items():
        for flag, name in parser.flags.items():
            if flag in shared:
                assert parser.specs[name].metadata["help"].startswith(SHARED_HELP[shared[flag]]), (command, flag)


def _value(spec) -> list[str]:
    if spec.kind is bool and not spec.is_list:
        return []
    if spec.metadata.get("choices"):
        return [str(spec.metadata["choices"][-1])]
    return [{int: "3", float: "0.5", str: "bfloat16"}[spec.kind]]


OLD = [(command, old, new) for command, parser in PARSERS.items() for old, new in parser.deprecated.items() if not old.startswith("--no-")]


@pytest.mark.parametrize("command, old, new", OLD, ids=[f"{c}{o}" for c, o, _ in OLD])
def test_an_old_spelling_is_hidden_warns_once_and_means_the_new_flag(command, old, new, capsys):
    parser = PARSERS[command]
    spec = parser.specs[parser.flags[new]]
    value = _value(spec)
    def given(argv):
        return {k: v for k, v in vars(parser.parse_known_args(parser._normalise(argv))[0]).items() if k != "config"}

    with pytest.warns(FutureWarning) as caught:
        given_old = given([old, *value])
    assert [str(w.message) for w in caught] == [f"{old} is deprecated, use {new}"]
    assert given_old == given([new, *value]) == {spec.name: given_old[spec.name]}
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = capsys.readouterr().out
    assert new in shown and not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", shown)


def test_the_notice_of_an_old_spelling_is_one_line_naming_the_new_flag(tmp_path, capsys):
    from hf_depthgrow.cli import main
    from hf_depthgrow.cli.common import deprecations_on_one_line
    from hf_depthgrow.config import FlagDeprecation

    with pytest.warns(FlagDeprecation) as caught:
        assert main(["grow", "--out", str(tmp_path / "o"), "--model", str(tmp_path / "missing"), "--positions", "1", "--seed", "2"]) == 2
    assert [str(w.message) for w in caught] == ["--out is deprecated, use --output-dir", "--seed is deprecated, use --growth-seed"]
    assert capsys.readouterr().err.splitlines() == [f"hf-depthgrow grow: no such model folder: {tmp_path / 'missing'}"]
    assert not (tmp_path / "o").exists()
    # Printed (outside pytest, which records warnings instead), each is one line; other warnings keep Python's format.
    with deprecations_on_one_line("hf-depthgrow grow"):
        assert warnings.formatwarning("--out is deprecated, use --output-dir", FlagDeprecation, "x.py", 7) == (
            "hf-depthgrow grow: --out is deprecated, use --output-dir\n")
        assert "x.py:7: UserWarning: other" in warnings.formatwarning("other", UserWarning, "x.py", 7)
    assert warnings.formatwarning("--out", FlagDeprecation, "x.py", 7).startswith("x.py:7: FlagDeprecation")


def test_an_old_boolean_spelling_works_both_ways():
    parser = PARSERS["train"]
    with pytest.warns(FutureWarning, match="--no-progress-bar is deprecated, use --no-progress"):
        _, config, _ = parser.parse(["--no-progress-bar"])
    assert config.progress_bar is False
    with pytest.warns(FutureWarning, match="--progress-bar is deprecated, use --progress"):
        _, config, _ = parser.parse(["--progress-bar", "true"])
    assert config.progress_bar is True


def test_export_gguf_dtype_is_the_torch_dtype_and_a_gguf_type_given_there_moves_with_a_warning():
    from hf_depthgrow.cli.export import GGUF_TYPES

    parser = PARSERS["export-gguf"]
    (args,) = parser.parse(["--model", "m", "--output", "m.gguf", "--dtype", "bfloat16", "--gguf-type", "q8_0"])
    assert (args.dtype, args.gguf_type) == ("bfloat16", "q8_0")
    with pytest.warns(FutureWarning, match="--dtype q4_1 .a GGUF tensor type. is deprecated, use --gguf-type q4_1"):
        (args,) = parser.parse(["--model", "m", "--output", "m.gguf", "--dtype", "q4_1"])
    assert (args.dtype, args.gguf_type) == ("float32", "q4_1")
    with pytest.raises(ConfigError, match="give the GGUF type once"):
        parser.parse(["--model", "m", "--output", "m.gguf", "--dtype", "q4_1", "--gguf-type", "f32"])
    with pytest.raises(ConfigError, match="--dtype must be one of float32, bfloat16, float16"):
        parser.parse(["--model", "m", "--output", "m.gguf", "--dtype", "f64"])
    import hf_depthgrow.hub.gguf_export as gguf_export

    assert tuple(GGUF_TYPES) == gguf_export.DTYPES  # the command's list (no torch at --help) is the library's


def test_train_resume_alone_continues_the_latest_checkpoint_and_a_path_moves_to_resume_from_checkpoint():
    from hf_depthgrow.cli.train import _resume_flag

    parser = PARSERS["train"]
    _, config, output = parser.parse(_resume_flag(["--resume", "--max-steps", "3"]))
    assert output.resume and config.resume_from_checkpoint is None and config.max_steps == 3
    assert _resume_flag(["--resume", "latest"]) == ["--resume"] and _resume_flag(["--resume=no"]) == ["--no-resume"]
    with pytest.warns(FutureWarning, match="--resume runs/x/checkpoint-4 is deprecated, use --resume-from-checkpoint runs/x/checkpoint-4"):
        argv = _resume_flag(["--resume", "runs/x/checkpoint-4"])
    assert parser.parse(argv)[1].resume_from_checkpoint == "runs/x/checkpoint-4"


def test_probe_positions_take_ints_and_ranges_as_several_values():
    from hf_depthgrow.cli.probe import parse_positions

    (args, _) = PARSERS["probe"].parse(["--model", "m", "--data", "d", "--output-dir", "o", "--positions", "0", "4", "6-7"])
    assert parse_positions(args.positions) == [0, 4, 6, 7] and parse_positions("0,3-5") == [0, 3, 4, 5]


def test_every_concept_names_one_flag_and_distinct_spellings():
    flags = [c.flag for c in CONCEPTS]
    old = [o for c in CONCEPTS for o in c.old]
    assert len(set(flags)) == len(flags) and not set(flags) & set(old) and len(set(old)) == len(old)
    assert all(isinstance(p, argparse.ArgumentParser) for p in PARSERS.values())


def test_the_automatic_retention_choice_is_in_the_library(tmp_path):
    """`--retention-data auto` is `hf_depthgrow.data.retention`: the Python docs for text, none for images."""
    from hf_depthgrow.data.retention import load_retention, retention_source
    from hf_depthgrow.data.sources import load_data
    from hf_depthgrow.testing import byte_level_tokenizer, tiny_model

    assert retention_source("auto", "causal_lm") == retention_source("auto", "text_classification") == "python_docs"
    assert retention_source("auto", "image_classification") is None and retention_source("tweets", "causal_lm") == "tweets"
    assert load_retention("auto", tiny_model("vit"), None, block_size=16, max_examples=8) is None
    text = "general prose, outside the training domain. " * 40
    (tmp_path / "general.txt").write_text(text)
    model, tokenizer = tiny_model("llama", vocab_size=300), byte_level_tokenizer([text], vocab_size=300)
    rows = load_retention(str(tmp_path / "general.txt"), model, tokenizer, block_size=16, max_examples=8, seed=3)
    same = load_data(str(tmp_path / "general.txt"), model=model, tokenizer=tokenizer, block_size=16, max_examples=8, split="test", seed=3)
    assert len(rows) == len(same) == 8 and all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(rows, same))


def test_an_old_yaml_key_warns_and_sets_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: smollm2\npositions: [3]\nseq: 128\nbatch: 2\n")
    with pytest.warns(FutureWarning) as caught:
        (args,) = PARSERS["estimate"].parse(["--config", str(path)])
    assert (args.block_size, args.batch_size) == (128, 2)
    assert sorted(str(w.message) for w in caught) == [f"{path}: batch is deprecated, use batch_size", f"{path}: seq is deprecated, use block_size"]
