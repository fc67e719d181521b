"""`hf_depthgrow.config`: one set of dataclasses gives the flags and the YAML of every command and recipe."""

from __future__ import annotations

import pytest
import yaml

from hf_depthgrow.cli.demo import DemoArguments
from hf_depthgrow.cli.estimate import EstimateArguments
from hf_depthgrow.cli.eval import EvalArguments
from hf_depthgrow.cli.export import ExportArguments
from hf_depthgrow.cli.grow import GrowArguments
from hf_depthgrow.cli.probe import ProbeArguments
from hf_depthgrow.config import ConfigError, ConfigParser, ScriptArguments, load_config, option_name, parse_args
from hf_depthgrow.growth.config import GrowthConfig
from hf_depthgrow.pipeline import RunConfig
from hf_depthgrow.training.config import TrainConfig

# Non-default values of every kind of field (str, int, float, bool, list, optional) for each command.
COMMANDS = {
    "run": ((RunConfig,), dict(model="m", data="d.txt", block_size=32, max_examples=None, positions=[1, 3], learning_rate=0.01,
                                overwrite=True, progress=False, loss_bound=7.5, push_to_hub="me/x")),
    "train": ((ScriptArguments, TrainConfig), dict(model="m", positions=[2], dataset="shakespeare", held_out_fraction=0.25,
                                                  test_fraction=0.1, split_by="document",
                                                  stepping_stone=True, learning_rate=0.005, max_steps=6, progress_bar=False,
                                                  fallback=False, lora_target_modules=["q_proj", "v_proj"], trainable="new+lora")),
    "probe": ((ProbeArguments, GrowthConfig), dict(model="m", data="d.txt", output_dir="o", positions=["0", "2-4"], covariance=False,
                                                  shuffle=True, z_threshold=3.0, max_batches=4, block="adapter", eps=1e-5)),
    "eval": ((EvalArguments,), dict(model="m", data="d", output_dir="o", base="b", train_fraction=0.5, held_out_fraction=0.0,
                                     test_fraction=0.5, eval_split="train", delta_erm=0.01,
                                     evaluate=False, progress=False, dtype="bfloat16")),
    "grow": ((GrowArguments, GrowthConfig), dict(model="m", positions=[0, 2], output_dir="o", overwrite=True, init="random", seed=3)),
    "demo": ((DemoArguments,), dict(position=4, max_new_tokens=8, output="x.json", output_dir="g", overwrite=True)),
    "export-gguf": ((ExportArguments,), dict(model="m", output="m.gguf", gguf_type="q8_0", dtype="bfloat16", trust_remote_code=True)),
    "estimate": ((EstimateArguments,), dict(model="m", positions=[3], block_size=128, batch_size=2, trainable=["new", "full"], json=True)),
}


def _flags(types, values: dict) -> list[str]:
    parser = ConfigParser(types)
    argv = []
    for key, value in values.items():
        spec = parser.specs[key]
        if spec.metadata.get("positional"):
            argv.insert(0, value)
        elif isinstance(value, bool):
            flag = spec.metadata.get("flag") or option_name(key)
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            argv += [option_name(key), "none"]
        else:
            argv += [spec.metadata.get("flag") or option_name(key), *map(str, value if isinstance(value, list) else [value])]
    return argv


def _expected(types, values):
    return tuple(cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__}) for cls in types)


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_and_yaml_give_equal_configs(command, tmp_path):
    types, values = COMMANDS[command]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    from_flags = ConfigParser(types).parse(_flags(types, values))
    from_yaml = ConfigParser(types).parse(["--config", str(path)])
    assert from_flags == from_yaml == _expected(types, values)
    assert load_config(path, *types) == from_yaml


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_kebab_case(command):
    parser = ConfigParser(COMMANDS[command][0])
    for action in parser._actions:
        for flag in action.option_strings:
            assert "_" not in flag, flag


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: a\nmax_steps: 5\nfallback: false\n")
    args, config = parse_args(ScriptArguments, TrainConfig, argv=["--config", str(path), "--max-steps", "9", "--fallback"])
    assert (args.model, config.max_steps, config.fallback) == ("a", 9, True)


def test_unknown_flag_and_key_suggest_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown option --learning-rte; did you mean --learning-rate\?$"):
        parse_args(ScriptArguments, TrainConfig, argv=["--learning-rte", "0.1"])
    path = tmp_path / "c.yaml"
    path.write_text("lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate'; did you mean 'learning_rate'\?$"):
        parse_args(ScriptArguments, TrainConfig, argv=["--config", str(path)])
    with pytest.raises(ConfigError, match=r"unknown option --zzz$"):  # nothing close: no suggestion
        parse_args(RunConfig, argv=["--zzz"])
    with pytest.raises(ConfigError, match="did you mean 'full'"):
        parse_args(TrainConfig, argv=["--trainable", "ful"])


def test_booleans():
    parse = lambda *argv: parse_args(TrainConfig, argv=list(argv))[0].fallback  # noqa: E731
    assert parse() is True
    assert parse("--no-fallback") is False
    assert parse("--fallback") is True
    assert parse("--fallback", "false") is False  # HfArgumentParser's spelling still works
    assert parse("--fallback=no") is False
    with pytest.raises(ConfigError, match="expected true or false"):
        parse("--fallback=maybe")


def test_lists_and_optionals(tmp_path):
    (cfg,) = parse_args(RunConfig, argv=["--positions", "3", "5", "--max-examples", "none"])
    assert cfg.positions == [3, 5] and cfg.max_examples is None
    path = tmp_path / "c.yaml"
    path.write_text("positions: 4\nprobe_max_batches: null\nlearning_rate: 1e-3\n")  # YAML 1.1 reads 1e-3 as a string
    (cfg,) = load_config(path, RunConfig)
    assert cfg.positions == [4] and cfg.probe_max_batches is None and cfg.learning_rate == 0.001


def test_wrong_types_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^argument --learning-rate: expected a float, got 'fast'$"):
        parse_args(RunConfig, argv=["--learning-rate", "fast"])
    path = tmp_path / "c.yaml"
    for text, message in [
        ("learning_rate: fast\n", "learning_rate: expected a float, got 'fast'"),
        ("train_steps: 2.5\n", "train_steps: expected an int, got 2.5"),
        ("positions: [1, x]\n", "positions: expected an int, got 'x'"),
        ("progress: 3\n", "progress: expected true or false, got 3"),
        ("- 1\n", "expected a mapping"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message) as err:
            load_config(path, RunConfig)
        assert "\n" not in str(err.value)


def test_missing_required_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="missing --data"):
        parse_args(ProbeArguments, argv=["--model", "model", "--output-dir", "o"])
    with pytest.raises(FileNotFoundError, match="no such config file"):
        parse_args(RunConfig, argv=["--config", str(tmp_path / "nope.yaml")])


def test_snake_case_flags_are_deprecated_aliases():
    with pytest.warns(FutureWarning) as caught:
        (config,) = parse_args(TrainConfig, argv=["--max_steps", "3", "--progress_bar", "false"])
    assert config.max_steps == 3 and config.progress_bar is False
    # The snake_case spelling of an old flag warns twice: once for the underscores, once for the old name.
    assert [str(w.message) for w in caught] == [
        "--max_steps, --progress_bar: snake_case flags are deprecated; use --max-steps, --progress-bar",
        "--progress-bar is deprecated, use --progress",
    ]


def test_field_names_must_not_clash():
    with pytest.raises(TypeError, match="clashes"):
        ConfigParser([RunConfig, TrainConfig])


def test_validation_errors_of_the_dataclass_come_through():
    with pytest.raises(ValueError, match="block must be one of"):
        parse_args(RunConfig, argv=["--block", "huge"])
