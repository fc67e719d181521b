"""`hf-depthgrow compare`: growth plans against equal-budget controls, paired, corrected across arms.

    hf-depthgrow compare                                   # SmolLM2 on Shakespeare, retention on Python docs
    hf-depthgrow compare --growth probe:1 interleave:2 top:1 --controls layers lora --max-steps 40 --max-examples 640
    hf-depthgrow compare --oracle-positions 0 10 20 30 --oracle-seeds 0 1 2   # also validate the probe
    hf-depthgrow compare --budgets 10 20 40 80 160 --max-examples 2400 --max-forgetting 0.05 --trials-dir runs/sweep-trials   # budgets as an axis

Every arm trains with the same steps, batch size, data order and schedule, its learning rate chosen on the
held-out split from its kind's own grid (extended x3 past an edge), and is scored on the same test examples;
with `--budgets` at every budget as if trained alone (a warmup-stable-decay schedule branched per budget); with
`--retention-data` also on a general-domain set (forgetting). Every step draws new training blocks: a largest
budget that needs more blocks than the training split holds is refused unless `--allow-repeated-data` (then a
warning, and the epochs of every budget in compare.md/json). `--oracle-positions` adds the probe
validation: one single-block arm per position and seed, and how well each predictor ranks them.
Writes `compare.json`, `compare.md`, `compare.png`, `compare_frontier.png`, `compare_curves.png` (3+ budgets) and
`probe_validation.*` into `--output-dir`; `--trials-dir` stores every finished trial: the same command again
resumes, training only the trials not stored, each from its start; with `--resume` each unfinished trial
continues from the checkpoint it left there (after its last scored budget or rung), and a folder with nothing
of this sweep is refused;
with `--report-to tensorboard` (or `wandb`) the trackers' logs go to `<output-dir>/logs/` (or `--logging-dir`).

Exit codes: 0 done; 2 bad input (one line on stderr, before anything loads or changes on disk).
"""

from __future__ import annotations

import contextlib
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..comparison import CompareConfig
from ..config import ConfigParser, shared_field
from ..evaluation.formatting import scrub_paths
from ..training.tracking import active_trackers
from ..utils import interrupt_hint, interrupt_stage
from .common import run_command


@dataclass
class CompareScript:
    """Model, data and output of `hf-depthgrow compare` (the arms and budget are `CompareConfig`)."""

    model: str = shared_field("model", "smollm2", more="Or 'minilm' (the embedded all-MiniLM-L6-v2 encoder).")
    data: str = shared_field("data", "shakespeare", more="The training domain.")
    retention_data: str | None = field(
        default="auto",
        metadata={"help": "General-domain set for forgetting; auto: python_docs (for a text classifier labelled with the original's own decisions), none for images."},
    )
    retention_split: str = field(default="test", metadata={"help": "Split of the retention source where it has one (fashion_mnist)."})
    retention_max_examples: int = field(default=128, metadata={"help": "Examples of the retention set."})
    retention_blocks_per_document: int | None = field(
        default=None,
        metadata={"help": "Blocks sampled from each document of the retention set (seeded, across many documents); none: the "
                          "source's default (python_docs: 2 per page), 0: consecutive blocks from the start."},
    )
    blocks_per_document: int | None = field(
        default=None,
        metadata={"help": "Blocks sampled from each document of --data (seeded, across many documents); none: the source's "
                          "default (consecutive blocks from the start; python_docs: 2 per page), 0: consecutive blocks."},
    )
    output_dir: str = shared_field("output_dir", "runs/compare", more="compare.json, .md and .png go here.")
    overwrite: bool = shared_field("overwrite", False)
    block_size: int = shared_field("block_size", 64)
    max_examples: int | None = shared_field("max_examples", 320)
    train_fraction: float | None = shared_field("train_fraction", 0.6)
    held_out_fraction: float = shared_field("held_out_fraction", 0.15, more="Here: it chooses learning rates and the best control.")
    test_fraction: float = shared_field("test_fraction", 0.25, more="Here: every arm is scored on it.")
    split_seed: int | None = shared_field("split_seed", None, more="none: --seed.")
    split_by: str | None = shared_field("split_by", None)
    oracle_positions: list[int] | None = field(default=None, metadata={"help": "Probe validation: one single-block arm per position."})
    oracle_seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Data-order seeds of the oracle sweep."})
    trials_dir: str | None = field(
        default=None, metadata={"help": "Store every finished trial here; the same command again resumes (reruns only what is missing)."}
    )
    resume: bool = field(
        default=False,
        metadata={"help": "Continue an interrupted sweep in --trials-dir: stored trials are reused, unfinished ones continue "
                          "from their last checkpoint (without it they start over); refused if there is nothing to resume."},
    )
    gather: str | None = field(
        default=None, metadata={"help": "Rebuild the result from the trials stored in this folder (a --trials-dir), training nothing; from the folder alone "
                                   "(no model or data loaded) where it records its comparison, as compare --trials-dir now does."}
    )
    trust_remote_code: bool = shared_field("trust_remote_code", False)

    def __post_init__(self):
        # Checked before anything loads: the oracle sweep runs after the (long) comparison.
        positions = self.oracle_positions
        if positions is not None and (len(set(positions)) < 4 or len(set(positions)) != len(positions) or min(positions) < 0):
            raise ValueError(f"oracle_positions needs at least 4 distinct positions >= 0, got {positions}")
        if not self.oracle_seeds or len(set(self.oracle_seeds)) != len(self.oracle_seeds):
            raise ValueError(f"oracle_seeds must be distinct and non-empty, got {self.oracle_seeds}")
        from ..data.sources import split_fractions

        split_fractions(self.train_fraction, self.held_out_fraction, self.test_fraction, every_part="compare")
        if self.split_seed is not None and self.split_seed < 0:
            raise ValueError(f"split_seed must be >= 0, got {self.split_seed}")
        for name in ("blocks_per_document", "retention_blocks_per_document"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0: consecutive blocks) or none (the source's default), got {value}")


def _per_document(value: int | None):
    """The CLI's blocks-per-document (none: the source's default, 0: consecutive blocks) as `load_data` takes it."""
    return "auto" if value is None else (value or None)


def _check_trials_dir(script: CompareScript) -> None:
    """The trial store outlives the output folder (which --overwrite replaces): never inside it, never a file, never
    `/`, the home folder or a folder the run reads (the model's, the data's)."""
    if script.trials_dir is None:
        return
    from ..comparison.store import check_trials_dir

    trials, out = Path(script.trials_dir).resolve(), Path(script.output_dir).resolve()
    if trials == out or out in trials.parents:
        raise ValueError(f"trials_dir {script.trials_dir} lies inside output_dir {script.output_dir}, which --overwrite replaces: put it beside it")
    if trials.exists() and not trials.is_dir():
        raise ValueError(f"trials_dir {script.trials_dir} exists and is not a folder")
    check_trials_dir(script.trials_dir, inputs={"model": script.model, "data": script.data, "retention data": script.retention_data})


def _check_resume(script: CompareScript) -> None:
    """`--resume` needs a trials folder holding something: one line before anything loads (what matches is checked later)."""
    if not script.resume:
        return
    if script.gather is not None:
        raise ValueError("resume continues training and gather trains nothing: drop one of --resume and --gather")
    if script.trials_dir is None:
        raise ValueError("resume continues the trials stored in --trials-dir: add --trials-dir DIR (the interrupted run's)")
    from ..comparison.store import CHECKPOINTS, KIND

    # A stored trial or a checkpoint: not the temporary folder of an interrupted write, nor what the store set aside.
    trials, checkpoints = Path(script.trials_dir) / KIND, Path(script.trials_dir) / CHECKPOINTS
    stored = trials.is_dir() and any(not p.name.startswith(".") for p in trials.iterdir())
    keys = [k for k in checkpoints.iterdir() if k.is_dir() and not k.name.startswith(".")] if checkpoints.is_dir() else []
    if not stored and not any(c.name.isdigit() for k in keys for c in k.iterdir()):
        raise ValueError(f"resume: nothing to resume in {script.trials_dir}: no stored trial and no checkpoint (drop --resume to start the sweep)")


def _resume_hint(script: CompareScript) -> str:
    """How an interrupted comparison goes on: from its stored trials when it has a --trials-dir."""
    if script.gather is not None:
        return f"{script.output_dir} was not changed; the same command gathers again"
    if script.trials_dir is None:
        return (f"{script.output_dir} was not changed and no trial was stored (no --trials-dir): the same command starts over; "
                "add --trials-dir DIR to keep finished trials")
    again = "the same command" + ("" if script.resume else " with --resume")
    return f"{script.output_dir} was not changed; the finished trials are in {script.trials_dir}: {again} continues"


def _ray_first(stack, cfg: CompareConfig) -> None:
    """`--engine ray`: join (or start) Ray and check the resources per trial before the model loads; held for the whole run."""
    if cfg.engine == "ray":
        from ..comparison.ray_engine import ray_cluster

        stack.enter_context(ray_cluster(cfg.ray_address, cfg.resources_per_trial))


def build_parser() -> ConfigParser:
    """The parser of `hf-depthgrow compare`: `CompareScript` and `CompareConfig`, plus `--config`."""
    return ConfigParser([CompareScript, CompareConfig], prog="hf-depthgrow compare", description=__doc__)


def _load(script: CompareScript, cfg: CompareConfig):
    from ..data.retention import load_retention
    from ..data.sources import load_data, split_parts
    from ..hub.loading import load_model

    model, tokenizer = load_model(script.model, trust_remote_code=script.trust_remote_code)
    model.eval()
    seed = cfg.seed if script.split_seed is None else script.split_seed
    data = load_data(script.data, model=model, tokenizer=tokenizer, block_size=script.block_size,
                     max_examples=script.max_examples, seed=seed, blocks_per_document=_per_document(script.blocks_per_document))
    splits = split_parts(data, script.train_fraction, script.held_out_fraction, script.test_fraction, seed=seed,
                         by=script.split_by)
    retention = load_retention(script.retention_data, model, tokenizer, block_size=script.block_size,
                               max_examples=script.retention_max_examples, split=script.retention_split, seed=cfg.seed,
                               blocks_per_document=_per_document(script.retention_blocks_per_document))
    return model, splits, retention


def _logs(cfg: CompareConfig, out: Path, sub: str = "") -> CompareConfig:
    """`cfg` with the trackers' folder: `--logging-dir` (or `<out>/logs`), then `sub`; unchanged without `--report-to`."""
    if not active_trackers(cfg.report_to):
        return cfg
    return replace(cfg, logging_dir=str(Path(cfg.logging_dir or out / "logs") / sub))


def _run(argv: list[str]) -> int:
    # Everything the command will run is imported now: a long run never picks up code edited meanwhile.
    from ..comparison import compare_plans
    from ..comparison.gather import gathering, recorded_in
    from ..comparison.validation import validate_probe
    from ..growth.towers import resolve_family
    from ..pipeline.output import check_output_dir, staged_output
    from ..plots import plot_comparison, plot_validation
    from ..probe import baselines, lookahead

    del compare_plans, validate_probe, resolve_family, staged_output  # loaded now, used in _compare
    del plot_comparison, plot_validation, baselines, lookahead  # loaded, not used here

    script, cfg = build_parser().parse(argv)
    if cfg.max_forgetting is not None and script.retention_data is None:
        raise ValueError("--max-forgetting is a forgetting budget and needs a retention set to measure forgetting on: "
                         "give --retention-data (not none) or drop --max-forgetting")
    interrupt_stage("the comparison")
    interrupt_hint(_resume_hint(script))
    _check_resume(script)
    if script.gather is not None:
        script, cfg = gathering(script, cfg)
    check_output_dir(script.output_dir, overwrite=script.overwrite, inputs={"model": script.model, "data": script.data})
    _check_trials_dir(script)
    if script.gather is not None and recorded_in(script.gather):
        return _gathered(script, cfg, argv)
    with contextlib.ExitStack() as stack:
        _ray_first(stack, cfg)  # an unreachable --ray-address or resources Ray lacks: one line, nothing loaded
        return _compare(script, cfg, argv)


def _gathered(script: CompareScript, cfg: CompareConfig, argv: list[str]) -> int:
    """`--gather DIR` on a folder that records its comparison: rebuilt from the folder alone (no model or data loaded).
    A comparison setting given here that differs from the recorded one is refused: it names another comparison."""
    from dataclasses import fields

    from ..comparison.gather import gather_comparison
    from ..pipeline.output import staged_output
    from ..utils import json_safe

    result = gather_comparison(script.gather)
    default, ignored = CompareConfig(), {"engine", "ray_address", "max_concurrent_trials", "resources_per_trial",
                                         "workers_per_trial", "accelerate_config", "progress", "report_to", "logging_dir",
                                         "project_name", "gradient_checkpointing"}
    differ = [f.name for f in fields(CompareConfig) if f.name not in ignored and getattr(cfg, f.name) != getattr(default, f.name)
              and json_safe(getattr(cfg, f.name)) != result.config.get(f.name)]
    if differ:
        shown = ", ".join(f"{n} {getattr(cfg, n)!r} (recorded: {result.config.get(n)!r})" for n in differ)
        raise ValueError(f"gather {script.gather}: {shown} differ from the comparison recorded there; drop them to rebuild it")
    with staged_output(script.output_dir) as tmp:
        result.save(tmp)
        (tmp / "command.txt").write_text(scrub_paths("hf-depthgrow compare " + shlex.join(argv)) + "\n")
    print(result.to_markdown())
    print(f"Everything is in {script.output_dir}/ (rebuilt from {script.gather} alone)")
    return 0


def _compare(script: CompareScript, cfg: CompareConfig, argv: list[str]) -> int:
    from ..comparison import compare_plans
    from ..comparison.fresh_data import data_plan
    from ..comparison.validation import validate_probe
    from ..growth.towers import resolve_family
    from ..pipeline.output import record_outputs, staged_output

    model, splits, retention = _load(script, cfg)
    data_plan(cfg, len(splits["train"]))  # budgets that would repeat training blocks: one line before the output is staged
    depth = len(resolve_family(model)[1])
    if script.oracle_positions and max(script.oracle_positions) > depth:
        raise ValueError(f"oracle_positions go up to {max(script.oracle_positions)}, but the model has {depth} layers (positions 0..{depth})")
    # The comparison is on disk before the (longer) probe validation starts; tracker logs default to
    # <output_dir>/logs, written into the staged folder so that they move into place with it.
    with staged_output(script.output_dir) as tmp:
        result = compare_plans(model, splits["train"], splits["held_out"], splits["test"], config=_logs(cfg, tmp), retention_data=retention,
                                trials_dir=script.trials_dir, resume=script.resume)
        if result.config["logging_dir"] and not cfg.logging_dir:
            result.config["logging_dir"] = "logs"  # relative to the output folder: the staged path is gone after the move
        result.save(tmp)
        # Reports are public: local absolute paths cut to their last part.
        (tmp / "command.txt").write_text(scrub_paths("hf-depthgrow compare " + shlex.join(argv)) + "\n")
    print(result.to_markdown())
    if script.oracle_positions:
        interrupt_stage("the oracle sweep")
        again = " ".join(["the same command with --overwrite", *(["--resume"] if script.trials_dir and not script.resume else [])])
        interrupt_hint(f"the comparison is saved in {script.output_dir}; {again} runs the oracle sweep again"
                               + (" (the comparison's trials are reused)" if script.trials_dir else ""))
        validation = validate_probe(
            model, splits["train"], splits["held_out"], splits["test"], positions=script.oracle_positions,
            seeds=script.oracle_seeds, config=_logs(cfg, Path(script.output_dir), "probe_validation"), probe_result=None,
            # The rate the grid chose (on held-out) for the best growth arm: one rate for every position.
            learning_rate=result.arm(result.statistics["best_growth"]).learning_rate,
        )
        record_outputs(script.output_dir, validation.save(script.output_dir).values())  # --overwrite may replace them later
        print(validation.to_markdown())
    print(f"Everything is in {script.output_dir}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow compare`; an input error is one line on stderr and exit code 2."""
    return run_command("compare", _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
