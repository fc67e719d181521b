"""`run_pipeline`, one function per stage: load, probe, choose, stepping stones, train, evaluate, save.

The stages share one `_Run` that carries what each produced to the next; their order, seeds and
arguments are those of the single function they were cut from, so a run's numbers do not change.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..growth.engine import grow_depth
from ..hub.loading import EMBEDDED_HUB_IDS, public_name
from ..plots import plot_training
from ..training import tracking
from . import control, reuse
from .checks import check_run
from .config import RunConfig
from .output import staged_output
from .summary import grown_summary, probe_summary, write_summary


class PushFailed(RuntimeError):
    """The run succeeded and its outputs are on disk; only the push to the Hub failed."""


@dataclass
class RunResult:
    """What `run_pipeline` did; `summary` is what `summary.json` holds; `control_model`: the trained control (not saved)."""

    output_dir: Path
    summary: dict
    model: object = None
    control_model: object = None


@dataclass
class _Run:
    """The state one run passes from stage to stage."""

    cfg: RunConfig
    out: Path
    command: str | None
    timings: dict = field(default_factory=dict)
    clock: float = field(default_factory=time.perf_counter)
    model: object = None
    tokenizer: object = None
    base_name: str = ""
    splits: dict = field(default_factory=dict)
    probe_result: object = None
    positions: list = field(default_factory=list)
    placement: list = field(default_factory=list)  # PlacementEntry per new block, when cfg.placement is set
    why: str = ""
    placement_policy: str | None = None  # the policy that placed the blocks, when the probe's recommendation did
    stones: dict = field(default_factory=dict)
    stone_model: object = None
    margin: tuple | None = None  # (Delta_R, how it was measured): f~_pop against the original on the held-out split
    train_config: object = None  # the growth's TrainConfig: the control trains with it, but another trainable set
    train_result: object = None
    eval_result: object = None
    report_paths: dict = field(default_factory=dict)
    retention_data: object = None
    control_model: object = None  # the original's copy before growth; after `control.train_control`, the trained control
    control_plan: dict | None = None
    control_result: object = None
    test_losses: object = None  # the test split's per-example losses (original, grown, stone): reused by the control
    control: dict | None = None  # summary.json's "control"
    retention: dict | None = None  # summary.json's "retention"
    tracking: object = tracking.NO_TRACKING  # the "grown" tracker run (report_to), shared with the trainer
    cache: object = None  # the evidence cache (`reuse.open_cache`)
    fingerprints: dict = field(default_factory=dict)  # the original's and the splits' hashes, the cache's keys
    reused: dict = field(default_factory=dict)  # kind -> key of what an identical earlier run computed (summary.json)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self.clock, 1)
        self.clock = now

    def log(self, message: str) -> None:
        if self.cfg.progress:
            print(f"[hf-depthgrow] {message}", file=sys.stderr, flush=True)

    @property
    def trackers(self) -> dict:
        """Where this run's trackers log: `logging_dir`, else `logs/` in the (staged) output folder (none without trackers)."""
        cfg = self.cfg
        logs = cfg.logging_dir or (str(self.out / "logs") if tracking.active_trackers(cfg.report_to) else None)
        return {"report_to": cfg.report_to, "logging_dir": logs, "project_name": cfg.project_name}

    @property
    def grow_kwargs(self) -> dict:
        return dict(block=self.cfg.block, init=self.cfg.init, seed=self.cfg.seed)


def public_command(command: str | None) -> str | None:
    """The command line with every local absolute path cut to its last part (cards and reports are public)."""
    if not command:
        return command

    def cut(token: str) -> str:
        flag, eq, value = token.partition("=") if token.startswith("--") else ("", "", token)
        if value.startswith(("/", "~")) or Path(value).is_absolute():
            value = Path(value).expanduser().name or value
        return flag + eq + value

    return shlex.join(cut(t) for t in shlex.split(command))


def _load(run: _Run) -> None:
    """Model, tokenizer and the seeded train / held-out / test splits."""
    from ..data.sources import load_data, split_parts
    from ..hub.loading import load_model

    cfg = run.cfg
    torch.manual_seed(cfg.seed)
    run.log(f"loading model {cfg.model!r}")
    run.model, run.tokenizer = load_model(cfg.model, trust_remote_code=cfg.trust_remote_code, quantize=cfg.quantize)
    run.base_name = public_name(cfg.model)
    run.model.eval()
    data = load_data(cfg.data, model=run.model, tokenizer=run.tokenizer, block_size=cfg.block_size, max_examples=cfg.max_examples,
                     seed=cfg.resolved_split_seed)
    run.splits = split_parts(data, cfg.train_fraction, cfg.held_out_fraction, cfg.test_fraction, seed=cfg.resolved_split_seed,
                             by=cfg.split_by)
    control.load_retention(run)
    run.lap("load")


def _probe(run: _Run) -> None:
    """Where can a block help, and can it at all at this data size?"""
    from ..probe.signal import probe

    cfg, train_ds = run.cfg, run.splits["train"]
    reuse.open_cache(run)
    run.probe_result = reuse.load_probe(run)
    if run.probe_result is None:
        run.log(f"probing all {run.model.config.num_hidden_layers + 1} positions on {len(train_ds)} training examples")
        # keep_gradients: the stepping stones reuse G_S instead of a second pass over the training data.
        run.probe_result = probe(
            run.model, train_ds, batch_size=cfg.batch_size, max_batches=cfg.probe_max_batches, progress=cfg.progress,
            keep_gradients=True, **run.grow_kwargs,
        )
        reuse.store_probe(run)
    probe_dir = run.out / "probe"
    probe_dir.mkdir()
    run.probe_result.to_json(probe_dir / "probe.json")
    tracking.log_probe_run(run.probe_result, **run.trackers)
    run.lap("probe")


def _plot_probe(run: _Run, grown: bool) -> None:
    """probe.png, with the positions the run grows at marked (drawn once they are chosen)."""
    from ..probe.plots import plot_probe

    plot_probe(run.probe_result, run.out / "probe" / "probe.png", title=f"{Path(run.base_name).name}: first-order signal by depth",
               chosen=run.positions if grown else [])


def _choose_positions(run: _Run) -> bool:
    """Set `run.positions` and `run.why`; `False` when the probe says not to grow (and nothing forces it)."""
    cfg, result = run.cfg, run.probe_result
    recommendation = result.recommendation
    if cfg.positions:
        run.positions, run.why = list(cfg.positions), "given by the user"
        return True
    if cfg.placement:
        from ..growth.placement import resolve_positions

        run.placement = resolve_positions(cfg.placement, run.model.config.num_hidden_layers, probe_result=result)
        run.positions, run.why = [e.at for e in run.placement], f"placement {public_name(cfg.placement)!r}"  # summary: no local path
        return True
    if recommendation.get("grow") or cfg.force:
        ranked = recommendation.get("positions") or [int(max(range(len(result.signal)), key=result.signal.__getitem__))]
        run.positions = sorted(ranked[: cfg.num_blocks])
        run.why = recommendation.get("reason", "") + (" (forced)" if not recommendation.get("grow") else "")
        run.placement_policy = recommendation.get("policy", "z")  # a stored probe result without the key ranked by z
        return True
    return False


def _stepping_stones(run: _Run) -> None:
    """f~_S (train direction) and f~_pop (held-out direction) at the one chosen position."""
    from ..probe.stepping_stone import stepping_stones

    cfg, result = run.cfg, run.probe_result
    # A block with its own copy source or init is not the one the probe and stepping stone reason about.
    if len(run.positions) == 1 and all(e.is_default for e in run.placement):
        k = run.positions[0]
        stored = reuse.load_stones(run, k)
        if stored is not None:
            (run.stone_model, stone_s), (pop_model, stone_pop) = stored
        else:
            run.log(f"stepping stones at k = {k}")
            if result.gradients is None:  # a probe from the cache keeps no G_S: the same probe again, with it
                run.probe_result = result = reuse.probe_again(run)
            common = dict(batch_size=cfg.batch_size, max_batches=cfg.stone_max_batches, gradient=result.gradients[result.positions.index(k)],
                          refine_steps=cfg.stone_refine_steps, progress=cfg.progress, **run.grow_kwargs)
            # One line-search set-up for both: the prefix below k and L_S(f_old) are computed once.
            stones = stepping_stones(run.model, k, run.splits["train"], run.splits["held_out"], **common)
            (run.stone_model, stone_s), (pop_model, stone_pop) = stones["train"], stones["held_out"]
            reuse.store_stones(run, k, stone_s, stone_pop)
        run.stones = {"train": stone_s.to_dict(), "held_out": stone_pop.to_dict()}
        (run.out / "stepping_stones.json").write_text(json.dumps(run.stones, indent=2))
        # Delta_R now, not after training: f~_pop is a whole copy of the model, needed for nothing else,
        # and is freed when this stage returns instead of being held through training and evaluation.
        run.margin = _population_margin(run, pop_model)
    result.gradients = None  # free them before training
    run.lap("stepping_stones")


def _grow_and_train(run: _Run) -> None:
    """Grow and train the new blocks; the fallback rule picks the better of f_new and f~_S."""
    from ..training.config import TrainConfig
    from ..training.trainer import train

    cfg = run.cfg
    run.log(f"growing at {run.positions} and training for {cfg.train_steps} steps")
    spec = cfg.placement if run.placement else run.positions
    control.keep_original(run)
    grow_depth(run.model, spec, probe_result=run.probe_result, **run.grow_kwargs)
    control.plan_control(run)  # parameter counts checked before anything trains
    run.train_config = TrainConfig(
        max_steps=cfg.train_steps, learning_rate=cfg.learning_rate, per_device_train_batch_size=cfg.batch_size,
        eval_steps=cfg.eval_steps, trainable=cfg.trainable, seed=cfg.seed, output_dir=str(run.out / "train"),
        save_final_model=False, selection_max_examples=cfg.selection_max_examples, progress_bar=cfg.progress,
        gradient_checkpointing=cfg.gradient_checkpointing, **run.trackers,
    )
    # One tracker run holds the training and, after it, the test evaluation: the trainer writes into it.
    run.tracking = tracking.tracking_run(run_name="grown", config=cfg.to_dict(), **run.trackers)
    run.train_result = train(
        run.model, run.splits["train"], config=run.train_config, eval_data=run.splits["held_out"], stepping_stone=run.stone_model,
        accelerator=run.tracking.accelerator, original_losses=reuse.load_original_losses(run, run.train_config),
    )
    reuse.store_original_losses(run, run.train_config, run.train_result.original_losses)
    run.model = run.train_result.model
    (run.out / "train").mkdir(exist_ok=True)
    (run.out / "train" / "train_result.json").write_text(json.dumps(run.train_result.to_dict(), indent=2, default=str))
    plot_training(run.train_result, run.out / "train" / "loss.png", title=f"{Path(run.base_name).name} grown at k = "
                  f"{', '.join(map(str, run.positions))}: training")
    run.lap("train")


def _evaluate(run: _Run) -> None:
    """Paired evaluation on the test split, with the Route A/B terms; writes `eval/`."""
    from ..evaluation.paired import evaluate_delta
    from ..evaluation.route_terms import route_inputs
    from ..evaluation.report import write_report

    cfg, train_ds, test_ds = run.cfg, run.splits["train"], run.splits["test"]
    run.log(f"paired evaluation on {len(test_ds)} test examples")
    # One pass over the test split: the prefix once per batch, then the original, the grown model and the
    # stepping stone f~_S (same position) from it; the control's comparison later reuses the grown losses.
    stone = {"stone": run.stone_model} if run.stone_model is not None else None
    run.test_losses = reuse.paired_losses(run, "test", test_ds, extra=stone)
    block_data = train_ds if cfg.route_max_examples is None else train_ds.select(range(min(len(train_ds), cfg.route_max_examples)))
    routes = route_inputs(
        run.model, n_train=len(train_ds), train_result=run.train_result, stone_pop=run.margin[0] if run.margin else None,
        stone=_stone_margin(run.test_losses) if stone else None, block_data=block_data, batch_size=cfg.batch_size,
    )
    if run.margin:
        routes.sources["delta_r"] = run.margin[1]
    if stone:
        reused = run.reused.get("test_losses")
        routes.sources["delta_r_test"] = f"mean per-example delta of the stepping stone vs the original on {len(test_ds)} test examples " + (
            f"(their losses by an identical earlier run: evidence cache entry {reused})" if reused else "(measured here, in the evaluation's pass)"
        )
    run.eval_result = evaluate_delta(
        run.model, test_ds, delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size, routes=routes,
        losses=run.test_losses,
    )
    run.tracking.log_evaluation(run.eval_result, cfg.train_steps)
    for side, name in (("old", f"{run.base_name} (new blocks bypassed)"), ("new", f"{run.base_name} grown at {run.positions}")):
        run.eval_result.models.setdefault(side, {})["name_or_path"] = name  # not a local path
    title = f"{Path(run.base_name).name} grown at {run.positions}"
    run.report_paths = write_report(run.eval_result, run.out / "eval", title=title, command=run.command)
    run.lap("evaluate")


def _population_margin(run: _Run, pop_model) -> tuple[float, str]:
    """`Delta_R`: the original's held-out loss minus f~_pop's (paired, per example), and how it was obtained."""
    from ..evaluation.route_terms import stone_margin

    margin = reuse.load_margin(run)
    if margin is None:
        what = "Delta_R (population stepping stone, held-out split)"
        margin = stone_margin(pop_model, run.splits["held_out"], what=what, batch_size=run.cfg.batch_size)
        reuse.store_margin(run, *margin)
    return margin


def _stone_margin(losses) -> float:
    """`Delta^R_test`: mean over test examples of the original's loss minus the stepping stone's."""
    return float((losses.cat("old").per_example - losses.cat("stone").per_example).mean())


def _save(run: _Run, summary: dict) -> None:
    """The selected model with its card and report in `model/` (and on the Hub when asked)."""
    from ..hub.model_card import CardInfo, render_model_card
    from ..hub.serialization import save_pretrained
    from ..training.result import save_quantized_blocks

    cfg = run.cfg
    # The card is public: inputs by Hub id or folder name, never a path on this machine.
    config = {**cfg.to_dict(), "model": run.base_name, "data": public_name(cfg.data), "output_dir": Path(cfg.output_dir).resolve().name}
    for name in ("retention_data", "evidence_cache"):
        if getattr(cfg, name) is not None:
            config[name] = public_name(getattr(cfg, name))
    # The card's evaluation section prints the control's and retention's sentences (hub.card_sections).
    evaluation = run.eval_result
    if run.control or run.retention:
        evaluation = {**run.eval_result.to_dict(), "control": run.control, "retention": run.retention}
    card = render_model_card(
        CardInfo.from_model(
            run.model, base_model=run.base_name, base_model_id=EMBEDDED_HUB_IDS.get(cfg.model),
            repo_id=cfg.push_to_hub, probe=run.probe_result, training=run.train_result, evaluation=evaluation,
            config=config, command=run.command, datasets=[public_name(cfg.data)], license=cfg.license,
        )
    )
    model_dir = save_pretrained(run.model, run.out / "model", tokenizer=run.tokenizer)  # a quantised base: merged, dequantised
    blocks_dir = save_quantized_blocks(run.model, run.out / "blocks")
    card.save(str(model_dir / "README.md"))
    for name in ("json", "markdown"):
        shutil.copy(run.report_paths[name], model_dir / Path(run.report_paths[name]).name)
    # Relative to the output folder: the run is written in a temp folder and moved into place.
    summary["artifacts"] = {"model": "model", "report": "eval/report.md", "probe_plot": "probe/probe.png", "loss_plot": "train/loss.png"}
    if blocks_dir is not None:
        summary["artifacts"]["blocks"] = "blocks"
    if run.control:
        summary["artifacts"]["control_report"] = run.control["report"]
    if run.retention:
        summary["artifacts"]["retention"] = "eval/retention.json"
    run.lap("save")


def _push(cfg: RunConfig, out: Path, summary: dict) -> None:
    """Push `out/model`; on failure the summary records it and `PushFailed` says where the outputs are."""
    from ..hub.push import push_to_hub

    try:
        summary["pushed"] = push_to_hub(out / "model", cfg.push_to_hub, private=cfg.hub_private, endpoint=cfg.hub_endpoint)
    except Exception as err:
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        summary["push_error"] = reason
        write_summary(out, summary)
        raise PushFailed(f"the run finished and its outputs and summary are in {cfg.output_dir}, but pushing to {cfg.push_to_hub} failed: {reason}") from err
    write_summary(out, summary)


def run_pipeline(cfg: RunConfig, *, command: str | None = None) -> RunResult:
    """Run the whole job; see `hf_depthgrow.pipeline` for what lands in `cfg.output_dir`.

    Args:
        cfg (`RunConfig`): every setting of the run.
        command (`str`, *optional*): the command line, quoted in the report and the model card.

    Example:
        ```python
        >>> from hf_depthgrow.pipeline import RunConfig, run_pipeline, summary_markdown
        >>> result = run_pipeline(RunConfig(output_dir="runs/demo", train_steps=20))
        >>> print(summary_markdown(result.summary))
        ```
    """
    check_run(cfg)  # everything that can be checked before the model loads and the output folder changes
    tracking.check_available(cfg.report_to)
    out = Path(cfg.output_dir)
    with staged_output(out) as tmp:
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        run = _Run(cfg, tmp, public_command(command))
        try:
            with _one_loss_bound_note(cfg):
                summary = _stages(run)
        finally:
            run.tracking.finish()  # the tracker files are closed before the folder moves into place
        write_summary(tmp, summary)
    if cfg.push_to_hub and summary["decision"] == "grew":
        _push(cfg, out, summary)
    return RunResult(out, summary, run.model, run.control_model if run.control_result is not None else None)


@contextmanager
def _one_loss_bound_note(cfg: RunConfig):
    """Without `loss_bound` every paired evaluation of a run (grown, control, stones, retention) would warn the
    same, with a source line each: one line up front instead. The reports carry the note too."""
    if cfg.loss_bound is not None:
        yield
        return
    print("[hf-depthgrow run] loss_bound not given: B is each evaluation's largest per-example loss, so the Hoeffding "
          "and Bernstein intervals are indicative, not guarantees (the bootstrap ones are unaffected); --loss-bound B "
          "sets an a-priori bound", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="loss_bound not given")
        yield


def _stages(run: _Run) -> dict:
    """Every stage in order, writing into `run.out`; returns the summary."""
    _load(run)
    _probe(run)
    grown = _choose_positions(run)
    _plot_probe(run, grown)
    if not grown:
        run.log("the probe found no observable first-order signal: not growing (pass --force to grow anyway)")
        return {
            "decision": "do not grow",
            "reason": run.probe_result.recommendation.get("reason"),
            "probe": probe_summary(run.probe_result),
            **({"reused": run.reused} if run.reused else {}),
            "timings_s": run.timings,
        }
    _stepping_stones(run)
    _grow_and_train(run)
    _evaluate(run)
    control.run_control(run)  # the equal-budget control and retention (nothing when both are off)
    summary = grown_summary(run)
    _save(run, summary)
    summary["timings_s"] = run.timings
    return summary
