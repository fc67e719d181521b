"""One config system: dataclasses -> command-line flags and YAML, for every command and recipe.

A settings dataclass documents each field with `metadata={"help": ...}` (optionally `"choices"`,
`"aliases"`, `"positional"`, `"flag"` (a flag named otherwise than the field), `"hidden"` (a flag that
works but is left out of `--help`: test and debugging hooks), `"deprecated"` (old flags, hidden, that warn) and
`"deprecated_positional"` (a flag that still accepts the value as a
positional argument, with a warning)). From such dataclasses this module builds

- the flags: `--kebab-case` for every field, types from the annotations (`int`, `float`, `str`,
  `bool` -> `--x/--no-x`, `list[int]` -> several values, `X | None` -> also accepts `none`);
- `--config file.yaml`, a flat mapping of field names to values; flags given on the command line win;
- one-line errors: an unknown flag or key names the nearest valid one, a value of the wrong type says
  which type was expected.

Several dataclasses can share one parser (`hf-depthgrow train` is `ScriptArguments` + `TrainConfig`).
`--snake_case` spellings of the flags (the `HfArgumentParser` style of earlier releases) still work as
hidden, deprecated aliases, as does `--flag true|false` for a boolean. A deprecated spelling warns with a
`FlagDeprecation` (a `FutureWarning`; the commands print it as one line naming the new flag).

The options every command shares (the model, the data, the output folder, `--overwrite`, `--trust-remote-code`,
the block size, the dtype, ...) are declared once, by `shared_field`: one help text, one meaning; a command picks
its default. `hf_depthgrow.cli.spelling` holds the names each concept may go by, and a test checks every command
against it.

Example:
    ```python
    >>> from hf_depthgrow.config import parse_args
    >>> from hf_depthgrow.training.config import TrainConfig
    >>> (config,) = parse_args(TrainConfig, argv=["--learning-rate", "1e-3", "--no-fallback"])
    >>> config.learning_rate, config.fallback
    (0.001, False)
    ```
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import types
import typing
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from .utils import check_int, kind_of, read_structured

__all__ = [
    "TORCH_DTYPES", "ConfigError", "ConfigParser", "FlagDeprecation", "ScriptArguments", "flag_words", "load_config", "option_name",
    "parse_args", "shared_field",
]

_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}
_NONE_WORDS = ("none", "null")


# The dtypes a model's weights load in, for every command that takes --dtype.
TORCH_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A bad flag, YAML key or value; the message is one line meant for a person."""


class FlagDeprecation(FutureWarning):
    """An old spelling of a flag or key was used; the message names the new one."""


# One help text per option that several commands take; `shared_field` declares the field.
SHARED_HELP = {
    "model": "A saved model folder (grown or not), a Hub id, or 'smollm2' (the embedded SmolLM2-135M-Instruct).",
    "data": "shakespeare, tweets, fashion_mnist, digits, python_docs, a local file/folder, or a Hub dataset id.",
    "output_dir": "Output folder: new or empty, or one hf-depthgrow wrote (with --overwrite).",
    "overwrite": "Replace what hf-depthgrow wrote at the output; a folder holding anything else is refused, never emptied.",
    "trust_remote_code": "Run Python code shipped with the model (off unless given).",
    "block_size": "Tokens per causal-LM example (padded length for classifiers).",
    "max_examples": "Load at most this many examples (before any split); none: all.",
    "dtype": "Torch dtype the weights load in: float32, bfloat16 or float16.",
    "progress": "Show progress bars.",
    "batch_size": "Examples per batch (per device).",
    # The split: one scheme in every command (`hf_depthgrow.data.split_fractions`), so that the same shares and seed
    # give the same parts in `run`, `train`, `eval` and `compare`.
    "train_fraction": "Share of the loaded examples to train on, dealt first from the seeded order of the split; "
                      "none: what the held-out and test shares leave.",
    "held_out_fraction": "Share held out from training, dealt next.",
    "test_fraction": "Share kept for the final test, dealt last, never trained or chosen on.",
    "split_seed": "Seed of the train / held-out / test split (and of which examples load, where --max-examples samples them).",
    "split_by": "A column whose values never straddle train / held-out / test, e.g. document (whole documents per part); "
                "none: examples are split.",
}


def shared_field(name: str, default=MISSING, *, more: str = "", **metadata):
    """The field of an option several commands share: its one help text (`SHARED_HELP`), plus `more` for this command.

    Args:
        name: The field name, a key of `SHARED_HELP` (`"model"`, `"output_dir"`, ...).
        default: The command's default; left out, the option is required.
        more: A sentence the command adds to the shared help (what its output folder holds, ...).
        **metadata: More field metadata (`deprecated`, `deprecated_positional`, `flag`, ...).

    Example:
        ```python
        >>> @dataclass
        ... class Args:
        ...     model: str = shared_field("model")
        ...     output_dir: str = shared_field("output_dir", more="probe.json and probe.png go here.")
        ```
    """
    help_ = SHARED_HELP[name] + (f" {more}" if more else "")
    metadata = {"help": help_, **metadata}
    if name == "dtype":
        metadata.setdefault("choices", list(TORCH_DTYPES))
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def option_name(name: str) -> str:
    """The flag of a field: `learning_rate` -> `--learning-rate`."""
    return "--" + name.replace("_", "-")


def _flag(spec) -> str:
    """The flag of a field, where `metadata["flag"]` may name it otherwise (`dataset` -> `--data`)."""
    return spec.metadata.get("flag") or option_name(spec.name)


def _nearest(word: str, candidates, quote: bool = False) -> str:
    """`"; did you mean X?"` for the closest candidate (difflib), or `""` when none is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return (f"; did you mean {match[0]!r}?" if quote else f"; did you mean {match[0]}?") if match else ""


@dataclass
class _Spec:
    """What one field accepts: the base type, whether it is a list, whether None is allowed."""

    name: str
    kind: type
    is_list: bool
    optional: bool
    default: object
    required: bool
    metadata: dict

    def convert(self, value, where: str):
        """`value` (from YAML or a flag's string) as this field's type, or a `ConfigError` naming `where`."""
        if value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS and self.optional):
            if self.optional or self.default is None:
                return None
            raise ConfigError(f"{where}: needs a value of type {self.type_name()}, got None")
        if self.is_list:
            items = value if isinstance(value, (list, tuple)) else [value]
            return [self.convert_one(v, where) for v in items]
        return self.convert_one(value, where)

    def convert_one(self, value, where: str):
        kind, bad = self.kind, f"{where}: expected {self.type_name(scalar=True)}, got {value!r}"
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOL_WORDS:
                return _BOOL_WORDS[value.lower()]
            raise ConfigError(bad)
        if kind in (int, float):
            if isinstance(value, bool):
                raise ConfigError(bad)
            if isinstance(value, str):  # flags, and YAML 1.1 reading `1e-3` as a string
                try:
                    value = kind(value)
                except ValueError:
                    raise ConfigError(bad) from None
            if kind is int and not isinstance(value, int):
                raise ConfigError(bad)
            if kind is float and isinstance(value, (int, float)):
                value = float(value)
            if not isinstance(value, kind):
                raise ConfigError(bad)
        elif kind is str and not isinstance(value, str):
            raise ConfigError(bad)
        choices = self.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}{_nearest(str(value), map(str, choices), quote=True)}")
        return value

    def type_name(self, scalar: bool = False) -> str:
        base = {int: "an int", float: "a float", str: "a string", bool: "true or false"}.get(self.kind, self.kind.__name__)
        return base if scalar or not self.is_list else f"a list of {base.split(' ', 1)[-1]}s"


def _spec(f, hint) -> _Spec:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    is_list = typing.get_origin(hint) in (list, tuple)
    kind = typing.get_args(hint)[0] if is_list else hint
    if kind not in (int, float, str, bool):
        raise TypeError(f"field {f.name}: unsupported type {hint!r} for a flag")
    required = f.default is MISSING and f.default_factory is MISSING
    default = None if required else (f.default if f.default is not MISSING else f.default_factory())
    return _Spec(f.name, kind, is_list, optional, default, required, dict(f.metadata))


class ConfigParser(argparse.ArgumentParser):
    """An `argparse` parser generated from settings dataclasses, with `--config file.yaml`.

    Args:
        dataclass_types: One or more dataclasses; their field names must not clash (they are also the YAML keys).
        config_flag: Add `--config FILE` (a YAML mapping of field names to values).
        **kwargs: Passed to `argparse.ArgumentParser` (`prog`, `description`, ...).

    Example:
        ```python
        >>> parser = ConfigParser([ScriptArguments, TrainConfig], prog="hf-depthgrow train")
        >>> args, config = parser.parse(["--model", "smollm2", "--max-steps", "10"])
        ```
    """

    def __init__(self, dataclass_types, *, config_flag: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(allow_abbrev=False, **kwargs)
        self.dataclass_types = tuple(dataclass_types)
        self.specs: dict[str, _Spec] = {}
        self.owner: dict[str, type] = {}
        self.deprecated: dict[str, str] = {}  # old flag -> its field's flag
        self.flags: dict[str, str] = {}  # a field's flag -> the field's name
        self.key_aliases: dict[str, tuple[str, bool]] = {}  # YAML key -> (field name, deprecated)
        self.config_flag = config_flag
        if config_flag:
            self.add_argument("--config", default=None, help="YAML file setting any option below; flags given here win")
        for cls in self.dataclass_types:
            hints = typing.get_type_hints(cls)
            for f in fields(cls):
                if not f.init:
                    continue
                if f.name in self.specs:
                    raise TypeError(f"{cls.__name__}.{f.name} clashes with {self.owner[f.name].__name__}.{f.name}")
                self.specs[f.name], self.owner[f.name] = _spec(f, hints[f.name]), cls
                self._add_field(self.specs[f.name])

    def _add_field(self, spec: _Spec) -> None:
        help_ = spec.metadata.get("help", "")
        help_ += " (required)" if spec.required else f" (default: {spec.default})"
        if spec.metadata.get("hidden"):
            help_ = argparse.SUPPRESS
        if spec.metadata.get("positional"):
            self.add_argument(spec.name, nargs="?", default=argparse.SUPPRESS, type=self._caster(spec), help=help_)
            return
        names = [_flag(spec), *spec.metadata.get("aliases", [])]
        self.flags[_flag(spec)] = spec.name
        if spec.kind is bool and not spec.is_list:
            self.add_argument(*names, dest=spec.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
            self._add_old_spellings(spec)
            return
        metavar = spec.name.upper()
        self.add_argument(*names, dest=spec.name, type=self._caster(spec), nargs="+" if spec.is_list else None,
                          default=argparse.SUPPRESS, metavar=metavar, help=help_)
        self._add_old_spellings(spec)

    def _add_old_spellings(self, spec: _Spec) -> None:
        """Hidden flags (and YAML keys) that still work with a warning, and a flag's own name as a YAML key."""
        if spec.metadata.get("flag"):
            self.key_aliases[spec.metadata["flag"][2:].replace("-", "_")] = (spec.name, False)
        for old in spec.metadata.get("deprecated", []):
            self.deprecated[old] = _flag(spec)
            self.key_aliases[old[2:].replace("-", "_")] = (spec.name, True)
            if spec.kind is bool and not spec.is_list:  # `--old` and `--no-old`, rewritten to the new flag before parsing
                self.deprecated["--no-" + old[2:]] = "--no-" + _flag(spec)[2:]
                continue
            self.add_argument(old, dest=spec.name, type=self._caster(spec), nargs="+" if spec.is_list else None,
                              default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if spec.metadata.get("deprecated_positional"):
            self.add_argument(f"{spec.name}__positional", nargs="?", type=self._caster(spec), default=argparse.SUPPRESS,
                              help=argparse.SUPPRESS)

    @staticmethod
    def _caster(spec: _Spec):
        def cast(text: str):
            if spec.optional and text.lower() in _NONE_WORDS:
                return None
            try:
                return spec.convert_one(text, _flag(spec))
            except ConfigError as err:
                raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None

        cast.__name__ = spec.kind.__name__
        return cast

    def error(self, message: str):  # argparse would print usage and exit; callers decide instead
        raise ConfigError(message)

    def _normalise(self, argv: list[str]) -> list[str]:
        """Deprecated `--snake_case` -> `--kebab-case`; `--flag true|false` / `--flag=false` for booleans."""
        known = {s for a in self._actions for s in a.option_strings}
        out, i, renamed, old = [], 0, [], []
        while i < len(argv):
            token = argv[i]
            if token == "--":
                out += argv[i:]
                break
            name, eq, value = token.partition("=")
            kebab = name.replace("_", "-")
            if name.startswith("--") and "_" in name and name not in known and (kebab in known or kebab in self.deprecated):
                renamed.append(name)
                name = kebab
            if name in self.deprecated:
                old.append(name)
                name = self.deprecated[name]
            spec = self.specs.get(name[2:].replace("-", "_")) if name.startswith("--") else None
            if spec is None and name in self.flags:
                spec = self.specs[self.flags[name]]
            if spec is not None and spec.kind is bool and not spec.is_list and _flag(spec) == name:
                if not eq and i + 1 < len(argv) and argv[i + 1].lower() in _BOOL_WORDS:
                    eq, value, i = "=", argv[i + 1], i + 1
                if eq:
                    truth = _BOOL_WORDS.get(value.lower())
                    if truth is None:
                        raise ConfigError(f"argument {name}: expected true or false, got {value!r}")
                    out.append(name if truth else "--no-" + name[2:])
                    i += 1
                    continue
            out.append(name + eq + value)
            i += 1
        if renamed:
            warnings.warn(f"{', '.join(renamed)}: snake_case flags are deprecated; use {', '.join(r.replace('_', '-') for r in renamed)}",
                          FlagDeprecation, stacklevel=3)
        for name in dict.fromkeys(old):
            warnings.warn(f"{name} is deprecated, use {self.deprecated[name]}", FlagDeprecation, stacklevel=3)
        return out

    def _move_positionals(self, given: dict) -> None:
        """A value given the old way, as a positional argument, moved to its flag (with a warning)."""
        for name, spec in self.specs.items():
            value = given.pop(f"{name}__positional", None)
            if value is None:
                continue
            warnings.warn(f"a positional {name.upper()} is deprecated, use {_flag(spec)} {name.upper()}", FlagDeprecation, stacklevel=3)
            if name in given and given[name] != value:
                raise ConfigError(f"{name} given twice: {value!r} (positional) and {_flag(spec)} {given[name]!r}")
            given[name] = value

    def parse(self, argv: list[str] | None = None) -> tuple:
        """Parse `argv` (default: `sys.argv[1:]`) and `--config` into one instance per dataclass."""
        argv = self._normalise(list(sys.argv[1:] if argv is None else argv))
        namespace, unknown = self.parse_known_args(argv)
        if unknown:
            flag = unknown[0].split("=", 1)[0]
            if flag.startswith("-"):
                options = [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")]
                raise ConfigError(f"unknown option {flag}{_nearest(flag, options)}")
            raise ConfigError(f"unexpected argument {flag!r}")
        given = vars(namespace)
        self._move_positionals(given)
        path = given.pop("config", None)
        values = self.read_yaml(path) if path else {}
        values.update(given)
        return self.build(values)

    def read_yaml(self, path: str | os.PathLike) -> dict:
        """The checked, converted values of a YAML file (keys are field names)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such config file: {path}")
        expected = "a mapping of option names to values"
        try:
            data = read_structured(path, expected=expected)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        data = {} if data is None else data  # an empty file sets nothing
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected {expected}, got {kind_of(data)}")
        return self.check(data, source=str(path))

    def check(self, values: dict, *, source: str = "config") -> dict:
        """Refuse unknown keys (naming the nearest) and convert every value to its field's type."""
        out = {}
        for key, value in values.items():
            spec = self.specs.get(str(key).replace("-", "_"))
            if spec is None and str(key) in self.key_aliases:
                name, deprecated = self.key_aliases[str(key)]
                spec = self.specs[name]
                if deprecated:
                    warnings.warn(f"{source}: {key} is deprecated, use {name}", FlagDeprecation, stacklevel=3)
            if spec is None:
                raise ConfigError(f"{source}: unknown key {key!r}{_nearest(str(key), self.specs, quote=True)}")
            out[spec.name] = spec.convert(value, f"{source}: {spec.name}")
        return out

    def build(self, values: dict) -> tuple:
        """One instance per dataclass from checked values; dataclass defaults fill the rest."""
        missing = [n for n, s in self.specs.items() if s.required and n not in values]
        if missing:
            spec = self.specs[missing[0]]
            name = spec.name if spec.metadata.get("positional") else _flag(spec)
            raise ConfigError(f"missing {name}" + (f" (or `{spec.name}:` in --config)" if self.config_flag else ""))
        out = []
        for cls in self.dataclass_types:
            try:
                out.append(cls(**{f.name: values[f.name] for f in fields(cls) if f.init and f.name in values}))
            except ValueError as err:  # the dataclass's own checks name fields; on the command line they are flags
                raise ConfigError(self.flagged(str(err))) from None
        return tuple(out)

    def flagged(self, message: str) -> str:
        """`message` with this parser's field names written as their flags (`max_steps` -> `--max-steps`).

        The dataclasses' checks speak to Python users (`max_steps must be ...`, `pass source_gguf=`); a command
        shows the same text with its own flags. See `flag_words`.
        """
        return flag_words(message, self.specs)


def flag_words(message: str, specs: dict) -> str:
    """Field names in `message` written as flags: `max_steps` -> `--max-steps`, `overwrite=True` -> `--overwrite`,
    `stepping_stone=False` -> `--no-stepping-stone`, `dtype='source'` -> `--dtype source`, `source_gguf=` -> `--source-gguf`.

    `specs` maps field names to `_Spec`s (`ConfigParser.specs`). A one-word field is rewritten only where it is
    followed by `=` (as an argument) or opens the message (`seed must be ...`); in prose ("growth arm") it stays a word. Names inside other words, after a
    dot (`cfg.max_steps`) or a dash (already a flag) are left alone.

    Example:
        ```python
        >>> flag_words("max_steps must be >= 1; pass stepping_stone=True", ConfigParser([ScriptArguments, TrainConfig]).specs)
        '--max-steps must be >= 1; pass --stepping-stone'
        ```
    """
    if not specs:
        return message
    names = "|".join(sorted(map(re.escape, specs), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.\-`/])({names})(=(True|False|'[^']*'|\"[^\"]*\"|[\w.+\-]+)?)?(?![\w(])")

    def replace(match: re.Match) -> str:
        name, eq, value = match.group(1), match.group(2), match.group(3)
        spec = specs[name]
        at_start = match.start() == 0 and message[match.end():].startswith(" must ")
        if not eq and "_" not in name and not at_start:
            return match.group(0)
        flag = _flag(spec)
        if spec.kind is bool and not spec.is_list and value in ("True", "False"):
            return flag if value == "True" else "--no-" + flag[2:]
        if value is None:
            return flag
        return f"{flag} {value.strip(chr(39) + chr(34))}"

    return pattern.sub(replace, message)


def parse_args(*dataclass_types, argv: list[str] | None = None, **parser_kwargs) -> tuple:
    """Parse the command line (and `--config file.yaml`) into one instance of each dataclass.

    Example:
        ```python
        >>> args, config = parse_args(ScriptArguments, TrainConfig, argv=["--config", "run.yaml", "--max-steps", "5"])
        ```
    """
    return ConfigParser(dataclass_types, **parser_kwargs).parse(argv)


def load_config(path: str | os.PathLike, *dataclass_types, **overrides) -> tuple:
    """One instance of each dataclass from a YAML file; `overrides` (field names) win over the file.

    Example:
        ```python
        >>> (cfg,) = load_config("run.yaml", RunConfig, train_steps=9)
        ```
    """
    parser = ConfigParser(dataclass_types, config_flag=False)
    values = parser.read_yaml(path)
    values.update(parser.check(overrides, source="overrides"))
    return parser.build(values)


@dataclass
class ScriptArguments:
    """What `hf-depthgrow train` and the recipes train on: model, growth and data (the training itself is `TrainConfig`).

    Example:
        ```python
        >>> from hf_depthgrow.training.config import TrainConfig
        >>> args, config = parse_args(ScriptArguments, TrainConfig, argv=["--model", "smollm2", "--positions", "24"])
        >>> args.positions
        [24]
        ```
    """

    # Defaulted here (a Python user may build the arguments bit by bit); `hf-depthgrow train` requires it.
    model: str | None = shared_field("model", None, more="Required, on the command line or in --config.")
    positions: list[int] | None = field(default=None, metadata={"help": "Grow at these positions k first (omit for a grown model)."})
    block: str = field(default="auto", metadata={"help": "Block kind for growth: auto, native or adapter."})
    init: str = field(default="copy", metadata={"help": "Native block init: copy or random."})
    growth_seed: int = field(default=0, metadata={"help": "Seed of the new blocks' random parts."})
    # The flag is --data, as in every other command (--dataset still works, with a warning); the YAML key and the
    # attribute stay `dataset`, which recipes and their configs use (`data:` is accepted too).
    dataset: str | None = shared_field("data", None, more="Or a save_to_disk folder. Required.", flag="--data", deprecated=["--dataset"])
    block_size: int = shared_field("block_size", 256)
    streaming: bool = field(
        default=False,
        metadata={"help": "Stream --data (a Hub id, a .jsonl/.txt file or a folder of shards) instead of loading it: "
                          "blocks are tokenized as training reaches them, in stream order (needs --max-steps)."},
    )
    held_out_blocks: int = field(
        default=64, metadata={"help": "With --streaming: the stream's first blocks, kept as held-out data (0: none)."}
    )
    max_examples: int | None = shared_field("max_examples", None)
    # With these defaults `--eval-fraction F` (the old spelling of --held-out-fraction) gives the split it names:
    # 1 - F trains, F is held out, nothing is kept for a test.
    train_fraction: float | None = shared_field("train_fraction", None)
    held_out_fraction: float = shared_field("held_out_fraction", 0.1, more="Here: evaluation during training and the fallback rule; 0: none.",
                                            deprecated=["--eval-fraction"])
    test_fraction: float = shared_field("test_fraction", 0.0, more="0: none; give it (and the same shares to hf-depthgrow eval) to keep a test part training never sees.")
    split_seed: int = shared_field("split_seed", 0)
    split_by: str | None = shared_field("split_by", None)
    dtype: str = shared_field("dtype", "float32")
    quantize: str | None = field(
        default=None,
        metadata={"help": "Load the base quantised by bitsandbytes, 4bit (NF4) or 8bit, as a frozen base: only the new blocks (in --dtype) train."},
    )
    stepping_stone: bool = field(default=False, metadata={"help": "Build f~_S (one position) for the fallback rule."})
    stepping_stone_max_batches: int | None = field(default=None, metadata={"help": "Batches of training data f~_S is built on."})
    trust_remote_code: bool = shared_field("trust_remote_code", False)

    def __post_init__(self):
        check_int("held_out_blocks", self.held_out_blocks, 0)
        if self.block not in ("auto", "native", "adapter"):
            raise ValueError(f"block must be auto, native or adapter, got {self.block!r}")
        if self.init not in ("copy", "random"):
            raise ValueError(f"init must be copy or random, got {self.init!r}")
        from .data.sources import split_fractions

        split_fractions(self.train_fraction, self.held_out_fraction, self.test_fraction)  # checked before anything loads
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in ("4bit", "8bit"):
            raise ValueError(f"quantize must be 4bit or 8bit, got {self.quantize!r}")
        if self.positions is not None and (not self.positions or not all(isinstance(k, int) and not isinstance(k, bool) for k in self.positions)):
            raise ValueError(f"positions must be a non-empty list of ints, got {self.positions!r}")
        if self.stepping_stone and self.positions is not None and len(self.positions) != 1:
            raise ValueError("stepping_stone=True needs exactly one growth position")

    def parts(self, dataset) -> dict:
        """The parts of `dataset` by the three shares, `split_seed` and `split_by` (`hf_depthgrow.data.split_parts`):
        the same parts `eval` and `compare` make with the same settings. A share of 0 makes no part."""
        from .data.sources import split_parts

        return split_parts(dataset, self.train_fraction, self.held_out_fraction, self.test_fraction, seed=self.split_seed,
                           by=self.split_by)

    def split(self, dataset):
        """`(train, held_out or None)`: what training reads of `parts(dataset)`; the test part is left out."""
        parts = self.parts(dataset)
        return parts["train"], parts.get("held_out")
