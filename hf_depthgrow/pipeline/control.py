"""The control arm of `hf-depthgrow run`: what training the same number of *existing* parameters gives.

Most of a grown model's gain over the original can be adaptation to the domain, which training as
many existing parameters for the same steps may give as well. So by default the run also trains a copy
of the original (before growth) with exactly the growth's training settings, except what trains:

- `"layers"`: the existing layers the new blocks copy (`comparison.matched_layers`), the same parameter count;
- `"lora"`: LoRA on every linear layer of the stack, the rank closest in parameters (`comparison.lora_rank_for`);

and evaluates the grown model against it, paired on the same test examples (`delta = loss(control) -
loss(grown)`, positive = growth better). With `retention_data` the forgetting of both against the original
is measured too. Each stage takes the pipeline's `_Run` and records what it produced on it.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from ..growth.engine import new_block_parameters
from ..hub.loading import public_name
from ..utils import json_safe
from . import reuse
from .summary import control_sentence, retention_sentence


def load_retention(run) -> None:
    """Read `retention_data` at load time, so a bad source fails before anything trains."""
    from ..data.sources import load_data

    cfg = run.cfg
    if cfg.retention_data is None:
        return
    run.retention_data = load_data(
        cfg.retention_data, model=run.model, tokenizer=run.tokenizer, block_size=cfg.block_size,
        max_examples=cfg.retention_max_examples, seed=cfg.seed,
    )


def keep_original(run) -> None:
    """A copy of the original model before `grow_depth` changes it in place: the control trains this copy."""
    if run.cfg.control is not None:
        run.control_model = copy.deepcopy(run.model)


def plan_control(run) -> None:
    """What the control trains and how many parameters, checked against the new blocks before anything trains.

    Raises:
        ValueError: a `"layers"` control whose layers do not have the new blocks' parameter count
            (adapter blocks, or a block copying a layer of another shape).
    """
    from ..comparison.arms import lora_rank_for, matched_layers
    from ..growth.towers import resolve_family
    from ..growth.placement import resolve_positions

    kind, original = run.cfg.control, run.control_model
    if kind is None:
        return
    stack = resolve_family(original)[1]
    growth = sum(p.numel() for _, p in new_block_parameters(run.model))
    placement = run.placement or resolve_positions(run.positions, len(stack))
    layers = matched_layers(placement, len(stack))
    count = sum(p.numel() for i in layers for p in stack[i].parameters())
    if kind == "auto":  # whole layers where they match the new blocks exactly (native blocks), else LoRA
        kind = "layers" if count == growth else "lora"
    plan = {"kind": kind, "layers": None, "lora_r": None, "growth_parameters": growth}
    if kind == "layers":
        plan["layers"], plan["parameters"] = layers, count
        if plan["parameters"] != growth:
            raise ValueError(
                f"control 'layers' would train layers {plan['layers']} ({plan['parameters']:,} parameters), but the new blocks "
                f"have {growth:,}: the counts must match; use control: lora or none"
            )
    else:
        plan["lora_r"], plan["parameters"] = lora_rank_for(original, growth)
    run.control_plan = plan


def train_control(run) -> None:
    """Train the control with the growth's `TrainConfig` but another trainable set; the budgets must be equal."""
    from ..training.trainer import train

    plan = run.control_plan
    if plan is None:
        return
    # The stepping stones were needed for the growth's fallback rule and routes only: free them first.
    run.stone_model = None
    extra = {"trainable_layers": plan["layers"]} if plan["kind"] == "layers" else {"lora_r": plan["lora_r"], "lora_alpha": 2 * plan["lora_r"]}
    config = dataclasses.replace(run.train_config, trainable=plan["kind"], output_dir=str(run.out / "control"), **extra)
    run.log(f"training the equal-budget control ({_describe(plan)}) for {config.max_steps} steps")
    # The control starts from the original, as the growth did: the growth's step-0 losses are the control's.
    result = train(run.control_model, run.splits["train"], config=config, eval_data=run.splits["held_out"],
                   original_losses=run.train_result.original_losses)
    run.control_model, run.control_result = result.model, result
    # loss.png was drawn after the growth trained: again, with the control's curves beside the growth's.
    from ..plots import plot_training

    plot_training(run.train_result, run.out / "train" / "loss.png", control=result, control_label=f"control ({_describe(plan)})",
                  title=f"grown at k = {', '.join(map(str, run.positions))} against the equal-budget control")
    grown = run.train_result
    expected = grown.num_trainable_parameters if plan["kind"] == "layers" else plan["parameters"]
    if result.num_trainable_parameters != expected:
        raise RuntimeError(f"the control trained {result.num_trainable_parameters:,} parameters, {expected:,} were planned")
    # A run stopped on a non-finite loss sees fewer tokens; that is recorded, anything else is a bug.
    if result.units_seen != grown.units_seen and not (result.nonfinite or grown.nonfinite):
        raise RuntimeError(f"the control saw {result.units_seen:,} {result.unit}, the growth {grown.units_seen:,}: the budgets differ")
    (run.out / "control" / "train_result.json").write_text(json.dumps(result.to_dict(), indent=2, default=str))
    run.lap("control_train")


def evaluate_control(run) -> None:
    """Grown model vs the control, paired on the test split; `eval/control/` holds the full report."""
    from ..evaluation.paired import compare_models
    from ..evaluation.report import write_report

    cfg = run.cfg
    if run.control_result is None:
        return
    run.log(f"paired evaluation: grown model vs the control on {len(run.splits['test'])} test examples")
    # The grown model's test losses are the evaluation's: only the control runs here.
    reuse = {"new": (run.test_losses, "new")} if run.test_losses is not None else None
    result = compare_models(
        run.control_model, run.model, run.splits["test"], delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed,
        batch_size=cfg.batch_size, progress=cfg.progress, reuse=reuse,
    )
    result.models["old"]["name_or_path"] = f"{run.base_name} control ({_describe(run.control_plan)})"
    result.models["new"]["name_or_path"] = f"{run.base_name} grown at {run.positions}"
    title = f"Growth at {run.positions} vs the equal-parameter control"
    write_report(result, run.out / "eval" / "control", title=title, command=run.command)
    run.control = control_summary(run, result)
    run.lap("control_eval")


def control_summary(run, result) -> dict:
    """The control's part of `summary.json`, with the sentence every output prints."""
    plan, trained, grown = run.control_plan, run.control_result, run.train_result
    name = "bootstrap" if "bootstrap" in result.intervals else next(iter(result.intervals))
    low, high = result.intervals[name]
    summary = {
        "kind": plan["kind"],
        "layers": plan["layers"],
        "lora_r": plan["lora_r"],
        "trainable_parameters": {"growth": grown.num_trainable_parameters, "control": trained.num_trainable_parameters},
        "units_seen": {"growth": grown.units_seen, "control": trained.units_seen},
        "unit": trained.unit,
        "steps": {"growth": grown.global_step, "control": trained.global_step},
        "selected": trained.selected,
        "growth_selected": grown.selected,
        "growth_vs_original": run.eval_result.delta,  # test delta of the growth against the original
        "test": {
            "loss_control": result.loss_old,
            "loss_grown": result.loss_new,
            "delta": result.delta,
            "mean_delta": result.mean_delta,
            "intervals": {k: list(v) for k, v in result.intervals.items()},
            "interval": name,
            "confidence": result.confidence,
            "unit": "nats/token" if result.task == "causal_lm" else "nats/example",
        },
        "outcome": "beat" if low > 0 else "worse" if high < 0 else "tie",
        "growth_beat_control": bool(low > 0),
        "report": "eval/control/report.md",
    }
    summary["sentence"] = control_sentence(summary)
    return summary


def measure_retention(run) -> None:
    """Forgetting on `retention_data` of the grown model, and of the control, against the original."""
    from ..evaluation.retention import evaluate_retention
    from ..growth.bypass import bypass_new_blocks

    cfg = run.cfg
    if run.retention_data is None:
        return
    run.log(f"retention: forgetting on {len(run.retention_data)} examples of {public_name(cfg.retention_data)}")
    kwargs = dict(delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size)
    losses = reuse.paired_losses(run, "retention", run.retention_data)
    _, grown = evaluate_retention(run.model, run.retention_data, losses=losses, **kwargs)
    control = None
    if run.control_result is not None:
        # The grown model with its new blocks bypassed *is* the original (what the growth is measured against);
        # its retention losses were just computed, so only the control runs.
        with bypass_new_blocks(run.model):
            _, control = evaluate_retention(
                run.control_model, run.retention_data, base=run.model, reuse={"old": (losses, "old")}, progress=cfg.progress, **kwargs
            )
    run.retention = {"data": public_name(cfg.retention_data), "num_examples": len(run.retention_data), "growth": grown, "control": control}
    run.retention["sentence"] = retention_sentence(run.retention)
    (run.out / "eval").mkdir(exist_ok=True)
    (run.out / "eval" / "retention.json").write_text(json.dumps(json_safe(run.retention), indent=2))
    run.lap("retention")


def add_to_report(run) -> None:
    """The control and retention sentences in `eval/report.md` (before "How to read this") and `report.json`."""
    sections = []
    if run.control is not None:
        sections.append(("control", "Against the equal-parameter control", run.control))
    if run.retention is not None:
        sections.append(("retention", "Retention (forgetting on a general-domain set)", run.retention))
    if not sections:
        return
    paths = run.report_paths
    data = json.loads(paths["json"].read_text())
    text = "".join(f"## {title}\n\n{part['sentence']}\n\n" for _, title, part in sections)
    markdown = paths["markdown"].read_text()
    anchor = "## How to read this"
    markdown = markdown.replace(anchor, text + anchor, 1) if anchor in markdown else markdown + "\n" + text
    paths["markdown"].write_text(markdown)
    data.update({key: json_safe(part) for key, _, part in sections})
    paths["json"].write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def run_control(run) -> None:
    """Every stage of this module after the growth is evaluated: train, compare, retention, report."""
    train_control(run)
    evaluate_control(run)
    measure_retention(run)
    add_to_report(run)


def _describe(plan: dict) -> str:
    if plan["kind"] == "layers":
        return f"layers {plan['layers']} of the original"
    return f"LoRA rank {plan['lora_r']} on every linear layer of the original"
