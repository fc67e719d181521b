"""One name and one meaning per option across every command: the table the commands' flags are checked against.

Each `Concept` names the one flag an option goes by, what it means, the settings fields (`Class.field`) that hold
it in some command, and spellings no command may show (earlier names, still accepted for one release where a
command had them: hidden from `--help`, with a one-line warning naming the new flag). `check_spelling` finds every
departure; `tests/test_cli_spelling.py` runs it on every command's parser, and `docs/cli.md` shows the table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Concept:
    """An option several commands take: its flag, its meaning, the fields that hold it, the spellings it must not have."""

    name: str
    flag: str
    meaning: str
    fields: tuple[str, ...]
    old: tuple[str, ...] = ()


CONCEPTS = (
    Concept("model", "--model", "the model to load: a saved folder, a Hub id, or 'smollm2'",
            ("RunConfig.model", "ScriptArguments.model", "GrowArguments.model", "ProbeArguments.model", "EvalArguments.model",
             "CompareScript.model", "ExportArguments.model", "EstimateArguments.model"), ("--model-name-or-path",)),
    Concept("data", "--data", "the training (or evaluation) data: an embedded name, a file or folder, a Hub dataset id",
            ("RunConfig.data", "ScriptArguments.dataset", "ProbeArguments.data", "EvalArguments.data", "CompareScript.data"),
            ("--dataset",)),
    Concept("output folder", "--output-dir", "the folder a command fills: new or empty, or one it wrote (with --overwrite)",
            ("RunConfig.output_dir", "TrainConfig.output_dir", "GrowArguments.output_dir", "ProbeArguments.output_dir",
             "EvalArguments.output_dir", "CompareScript.output_dir", "DemoArguments.output_dir"), ("--out", "--save")),
    Concept("output file", "--output", "the one file a command writes", ("ExportArguments.output", "DemoArguments.output")),
    Concept("JSON on stdout", "--json", "print the result as JSON instead of a table (a switch, never a file)", ("EstimateArguments.json",)),
    Concept("overwrite", "--overwrite", "replace what hf-depthgrow wrote at the output; anything else there is refused",
            ("RunConfig.overwrite", "TrainOutput.overwrite", "GrowArguments.overwrite", "ProbeArguments.overwrite",
             "EvalArguments.overwrite", "CompareScript.overwrite", "ExportArguments.overwrite", "DemoArguments.overwrite")),
    Concept("remote code", "--trust-remote-code", "run Python code shipped with the model (off unless given)",
            ("RunConfig.trust_remote_code", "ScriptArguments.trust_remote_code", "GrowArguments.trust_remote_code",
             "ProbeArguments.trust_remote_code", "EvalArguments.trust_remote_code", "CompareScript.trust_remote_code",
             "ExportArguments.trust_remote_code")),
    Concept("steps", "--max-steps", "optimizer steps of the training",
            ("RunConfig.train_steps", "TrainConfig.max_steps", "CompareConfig.max_steps"), ("--train-steps", "--steps", "--num-steps")),
    Concept("batch size", "--batch-size", "examples per batch, per device",
            ("RunConfig.batch_size", "TrainConfig.per_device_train_batch_size", "CompareConfig.batch_size", "ProbeArguments.batch_size",
             "EvalArguments.batch_size", "EstimateArguments.batch_size"),
            ("--per-device-train-batch-size", "--batch", "--train-batch-size")),
    Concept("evaluation batch size", "--eval-batch-size", "examples per evaluation batch, where it differs from --batch-size",
            ("TrainConfig.per_device_eval_batch_size",), ("--per-device-eval-batch-size",)),
    Concept("block size", "--block-size", "tokens per causal-LM example (padded length for classifiers)",
            ("RunConfig.block_size", "ScriptArguments.block_size", "ProbeArguments.block_size", "EvalArguments.block_size",
             "CompareScript.block_size", "EstimateArguments.block_size"), ("--seq", "--seq-len", "--max-length")),
    Concept("examples", "--max-examples", "load at most this many examples, before any split",
            ("RunConfig.max_examples", "ScriptArguments.max_examples", "ProbeArguments.max_examples", "EvalArguments.max_examples",
             "CompareScript.max_examples"), ("--num-examples",)),
    Concept("progress", "--progress", "progress bars (--no-progress: none)",
            ("RunConfig.progress", "TrainConfig.progress_bar", "CompareConfig.progress", "ProbeArguments.progress", "EvalArguments.progress"),
            ("--progress-bar",)),
    Concept("stepping-stone batches", "--stepping-stone-max-batches", "batches a stepping stone is built on",
            ("RunConfig.stone_max_batches", "ScriptArguments.stepping_stone_max_batches"), ("--stone-max-batches",)),
    Concept("stepping-stone refinement", "--stepping-stone-refine-steps", "line-search steps of a stepping stone after bracketing",
            ("RunConfig.stone_refine_steps",), ("--stone-refine-steps",)),
    Concept("seed", "--seed", "the seed of the command's own randomness: data order, initialisation, the bootstrap "
            "(run and compare: every seed of the job)",
            ("RunConfig.seed", "TrainConfig.seed", "CompareConfig.seed", "EvalArguments.seed")),
    Concept("growth seed", "--growth-seed", "the seed of the new blocks' random parts",
            ("GrowthConfig.seed", "ScriptArguments.growth_seed"), ("--block-seed",)),
    Concept("train share", "--train-fraction", "the share of the loaded examples to train on, dealt first from the split's "
            "seeded order (none: what the other shares leave); the same three shares and seed give the same parts everywhere",
            ("RunConfig.train_fraction", "ScriptArguments.train_fraction", "EvalArguments.train_fraction", "CompareScript.train_fraction"),
            ("--splits",)),
    Concept("held-out share", "--held-out-fraction", "the share held out from training (evaluated during it, chooses between models)",
            ("RunConfig.held_out_fraction", "ScriptArguments.held_out_fraction", "EvalArguments.held_out_fraction",
             "CompareScript.held_out_fraction"), ("--eval-fraction",)),
    Concept("test share", "--test-fraction", "the share kept for the final test, never trained or chosen on",
            ("RunConfig.test_fraction", "ScriptArguments.test_fraction", "EvalArguments.test_fraction", "CompareScript.test_fraction")),
    Concept("split seed", "--split-seed", "the seed of the train / held-out / test split (run and compare: --seed unless given)",
            ("RunConfig.split_seed", "ScriptArguments.split_seed", "EvalArguments.split_seed", "CompareScript.split_seed")),
    Concept("split by", "--split-by", "a column (document) whose values never straddle two parts of the split",
            ("RunConfig.split_by", "ScriptArguments.split_by", "EvalArguments.split_by", "CompareScript.split_by")),
    Concept("data seed", "--data-seed", "the seed of the order (and subset) of the examples the probe reads", ("ProbeArguments.data_seed",)),
    Concept("positions", "--positions", "insertion points k (0 <= k <= L), or a preset such as interleave:8 where the command grows",
            ("RunConfig.positions", "ScriptArguments.positions", "GrowArguments.positions", "ProbeArguments.positions",
             "EstimateArguments.positions", "DemoArguments.position"), ("--position", "--insert-at")),
    Concept("controls", "--controls", "equal-budget control arms (run trains one)", ("RunConfig.control", "CompareConfig.controls"),
            ("--control",)),
    Concept("resume", "--resume", "continue an interrupted run in its folder from its last checkpoint",
            ("CompareScript.resume", "TrainOutput.resume")),
    Concept("dtype", "--dtype", "the torch dtype the weights load in: float32, bfloat16 or float16",
            ("ScriptArguments.dtype", "ProbeArguments.dtype", "EvalArguments.dtype", "ExportArguments.dtype", "EstimateArguments.dtype"),
            ("--load-dtype", "--torch-dtype")),
    Concept("GGUF tensor type", "--gguf-type", "the tensor type of a written GGUF file (f16, q8_0, ..., source)", ("ExportArguments.gguf_type",),
            ("--outtype",)),
)

# Commands that load a model (so take --trust-remote-code) and commands that write (so take --overwrite). `demo` loads
# only the embedded SmolLM2, and `estimate` reads a config, never code or weights.
LOADS_MODEL = ("run", "grow", "probe", "train", "eval", "compare", "export-gguf")
WRITES = ("run", "demo", "grow", "probe", "train", "eval", "compare", "export-gguf")


def visible_flags(parser) -> dict[str, str]:
    """`{flag: "Class.field"}` of what `--help` shows (the `--no-x` of a switch left out)."""
    return {flag: f"{parser.owner[name].__name__}.{name}" for flag, name in parser.flags.items() if not parser.specs[name].metadata.get("hidden")}


def check_spelling(parsers: dict) -> list[str]:
    """Every departure from `CONCEPTS` in `{command: ConfigParser}`, one line each (`[]`: one spelling everywhere)."""
    by_field = {f: c for c in CONCEPTS for f in c.fields}
    old = {o: c for c in CONCEPTS for o in c.old}
    problems, seen = [], set()
    for command, parser in parsers.items():
        flags = visible_flags(parser)
        for flag, where in flags.items():
            seen.add(where)
            if flag in old:
                problems.append(f"{command}: {flag} ({where}) is an old spelling of {old[flag].name}: use {old[flag].flag}")
            concept = by_field.get(where)
            if concept is not None and flag != concept.flag:
                problems.append(f"{command}: {where} is {concept.name} but its flag is {flag}: use {concept.flag}")
        missing = [f for f, needed in (("--trust-remote-code", command in LOADS_MODEL), ("--overwrite", command in WRITES)) if needed]
        problems += [f"{command}: no {f}" for f in missing if f not in flags]
    problems += [f"{where} (in the table of {by_field[where].name}) is in no command" for where in by_field if where not in seen]
    return problems
