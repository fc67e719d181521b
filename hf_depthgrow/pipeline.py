"""The whole job in one call: probe -> grow -> stepping stones -> train -> select -> evaluate -> report -> save.

`run_pipeline(RunConfig())` runs the embedded default offline (SmolLM2-135M on Shakespeare)
and writes everything a person wants to read or reuse into `output_dir`:

    config.yaml            the resolved configuration (feed it back with --config)
    summary.md / .json     where it grew and why, losses, delta with interval, verdict, artifacts
    probe/                 probe.json and the signal plot
    stepping_stones.json   f~_S (train direction) and f~_pop (held-out direction)
    train/                 train_result.json and the loss curve
    eval/                  report.json, report.md and plots
    model/                 the selected model (safetensors), tokenizer, README.md model card, report
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import yaml

from .growth.engine import BLOCK_KINDS, INITS, grow_depth
from .plots import plot_training

EMBEDDED_MODELS = ("smollm2",)


@dataclass
class RunConfig:
    """Settings of `hf-depthgrow run`. Every field is also a command-line flag and a YAML key.

    Example:
        ```python
        >>> cfg = RunConfig(output_dir="runs/demo", train_steps=50)
        >>> result = run_pipeline(cfg)
        ```
    """

    model: str = field(default="smollm2", metadata={"help": "'smollm2' (embedded SmolLM2-135M), a local folder, or a Hub id."})
    data: str = field(default="shakespeare", metadata={"help": "'shakespeare', 'tweets', 'fashion_mnist', 'digits', a local file/folder, or a Hub dataset id."})
    output_dir: str = field(default="runs/smollm2-shakespeare", metadata={"help": "Where every artifact goes."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty output_dir."})
    block_size: int = field(default=64, metadata={"help": "Tokens per causal-LM example (padded length for classifiers)."})
    max_examples: int | None = field(default=640, metadata={"help": "Use at most this many examples in all."})
    train_fraction: float = field(default=0.7, metadata={"help": "Share of examples to train on."})
    held_out_fraction: float = field(default=0.15, metadata={"help": "Share for evaluation during training and f~_pop."})
    test_fraction: float = field(default=0.15, metadata={"help": "Share for the final paired test."})
    positions: list[int] | None = field(default=None, metadata={"help": "Grow here instead of where the probe recommends."})
    num_blocks: int = field(default=1, metadata={"help": "How many of the probe's best positions to grow at."})
    force: bool = field(default=False, metadata={"help": "Grow at the best signal even when the probe says 'do not grow'."})
    block: str = field(default="auto", metadata={"help": "native, adapter or auto."})
    init: str = field(default="copy", metadata={"help": "copy or random (native blocks)."})
    probe_max_batches: int | None = field(default=16, metadata={"help": "Probe on at most this many training batches (None: all)."})
    stone_max_batches: int | None = field(default=4, metadata={"help": "Batches of each stepping stone's line search and of f~_pop's held-out direction (f~_S reuses the probe's G_S)."})
    selection_max_examples: int | None = field(default=128, metadata={"help": "Training examples on which the fallback rule compares f_new with f~_S (a seeded sample; None: all)."})
    stone_refine_steps: int = field(default=2, metadata={"help": "Golden-section steps of each stepping stone's line search after bracketing."})
    route_max_examples: int | None = field(default=64, metadata={"help": "Training examples for rho and B_a of the route terms (None: all; a sample maximum either way)."})
    batch_size: int = field(default=8, metadata={"help": "Batch size of probe, training and evaluation."})
    train_steps: int = field(default=80, metadata={"help": "Optimizer steps."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak learning rate of the new blocks."})
    trainable: str = field(default="new", metadata={"help": "new, new+lora or full."})
    eval_steps: int = field(default=40, metadata={"help": "Evaluate on the held-out split every N steps."})
    delta: float = field(default=0.05, metadata={"help": "Failure probability of each interval (confidence 1 - delta)."})
    loss_bound: float | None = field(default=None, metadata={"help": "A-priori bound B of a per-example loss (None: from the data, with a warning)."})
    seed: int = field(default=0, metadata={"help": "Seeds splits, blocks, training and the bootstrap."})
    push_to_hub: str | None = field(default=None, metadata={"help": "Push the result to this repo id (explicit; never pushed otherwise)."})
    hub_private: bool | None = field(default=None, metadata={"help": "Create the Hub repo as private."})
    hub_endpoint: str | None = field(default=None, metadata={"help": "Another Hub endpoint (default: HF_ENDPOINT or huggingface.co)."})
    license: str | None = field(default=None, metadata={"help": "License id for the model card (a grown model inherits its base's)."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})

    def __post_init__(self):
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        fractions = (self.train_fraction, self.held_out_fraction, self.test_fraction)
        if any(not 0 < f < 1 for f in fractions) or sum(fractions) > 1 + 1e-9:
            raise ValueError(f"train/held_out/test fractions must be in (0, 1) and sum to at most 1, got {fractions}")
        for name in ("route_max_examples", "selection_max_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.stone_refine_steps < 0:
            raise ValueError(f"stone_refine_steps must be >= 0, got {self.stone_refine_steps}")
        for name in ("block_size", "batch_size", "train_steps", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.push_to_hub is not None and not str(self.push_to_hub).strip():
            raise ValueError("push_to_hub needs a repo id such as 'me/grown-smollm2'")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "RunConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
        data.update(overrides)
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)


class HubUnreachable(ValueError):
    """A Hub id was given but the Hub cannot be reached."""


def load_model(name: str):
    """`(model, tokenizer, base_model_name)` for the embedded default, a local folder or a Hub id."""
    from transformers import AutoConfig

    from .cli.common import load_tokenizer_if_any
    from .hub.serialization import load_pretrained

    if name == "smollm2":
        from .data.embedded import load_smollm2, smollm2_path

        model, tokenizer = load_smollm2()
        return model, tokenizer, str(smollm2_path())
    if Path(name).exists():
        return load_pretrained(name), load_tokenizer_if_any(name), name
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        raise HubUnreachable(
            f"{name!r} is not a local folder and could not be loaded from the Hugging Face Hub"
            + (" (HF_HUB_OFFLINE is set)" if offline else " (the Hub is unreachable or the id does not exist)")
            + f": {type(err).__name__}. Pass a local folder saved with save_pretrained, or 'smollm2' for the embedded model."
        ) from err
    return load_pretrained(name), load_tokenizer_if_any(name), name


def _prepare_output(path: Path, overwrite: bool) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty; pass --overwrite to replace it")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def _log(cfg: RunConfig, message: str) -> None:
    if cfg.progress:
        print(f"[hf-depthgrow] {message}", file=sys.stderr, flush=True)


@dataclass
class RunResult:
    """What `run_pipeline` did; `summary` is what `summary.json` holds."""

    output_dir: Path
    summary: dict
    model: object = None


def run_pipeline(cfg: RunConfig, *, command: str | None = None) -> RunResult:
    """Run the whole job; see the module docstring for what lands in `cfg.output_dir`."""
    from .data.sources import load_data, split_dataset
    from .evaluation.paired import evaluate_delta, route_inputs
    from .hub.model_card import CardInfo, render_model_card
    from .plots import plot_probe
    from .probe.signal import probe
    from .evaluation.report import write_report
    from .hub.serialization import save_pretrained
    from .probe.stepping_stone import stepping_stone
    from .training.trainer import train

    out = Path(cfg.output_dir)
    _prepare_output(out, cfg.overwrite)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 1)
        clock = now

    torch.manual_seed(cfg.seed)
    _log(cfg, f"loading model {cfg.model!r}")
    model, tokenizer, base_name = load_model(cfg.model)
    model.eval()
    num_layers = model.config.num_hidden_layers
    data = load_data(cfg.data, model=model, tokenizer=tokenizer, block_size=cfg.block_size, max_examples=cfg.max_examples, seed=cfg.seed)
    splits = split_dataset(
        data, {"train": cfg.train_fraction, "held_out": cfg.held_out_fraction, "test": cfg.test_fraction}, seed=cfg.seed
    )
    train_ds, held_ds, test_ds = splits["train"], splits["held_out"], splits["test"]
    lap("load")

    # 1. Probe: where can a block help, and can it at all at this data size?
    _log(cfg, f"probing all {num_layers + 1} positions on {len(train_ds)} training examples")
    grow_kwargs = dict(block=cfg.block, init=cfg.init, seed=cfg.seed)
    # keep_gradients: the stepping stones reuse G_S instead of a second pass over the training data.
    probe_result = probe(
        model, train_ds, batch_size=cfg.batch_size, max_batches=cfg.probe_max_batches, progress=cfg.progress,
        keep_gradients=True, **grow_kwargs,
    )
    probe_dir = out / "probe"
    probe_dir.mkdir()
    probe_result.to_json(probe_dir / "probe.json")
    plot_probe(probe_result, probe_dir / "probe.png", title=f"{Path(base_name).name}: first-order signal by depth")
    lap("probe")

    recommendation = probe_result.recommendation
    if cfg.positions:
        positions, why = list(cfg.positions), "given by the user"
    elif recommendation.get("grow") or cfg.force:
        ranked = recommendation.get("positions") or [int(max(range(len(probe_result.signal)), key=probe_result.signal.__getitem__))]
        positions = sorted(ranked[: cfg.num_blocks])
        why = recommendation.get("reason", "") + (" (forced)" if not recommendation.get("grow") else "")
    else:
        summary = {
            "decision": "do not grow",
            "reason": recommendation.get("reason"),
            "probe": _probe_summary(probe_result),
            "timings_s": timings,
        }
        _write_summary(out, summary, cfg)
        _log(cfg, "the probe found no observable first-order signal: not growing (pass --force to grow anyway)")
        return RunResult(out, summary, model)

    # 2. Stepping stones at the chosen position: f~_S (train direction), f~_pop (held-out direction).
    stones, stone_model, pop_model = {}, None, None
    if len(positions) == 1:
        _log(cfg, f"stepping stones at k = {positions[0]}")
        g_train = probe_result.gradients[probe_result.positions.index(positions[0])]
        stone_model, stone_s = stepping_stone(
            model, positions[0], train_ds, batch_size=cfg.batch_size, max_batches=cfg.stone_max_batches,
            gradient=g_train, refine_steps=cfg.stone_refine_steps, progress=cfg.progress, **grow_kwargs,
        )
        pop_model, stone_pop = stepping_stone(
            model,
            positions[0],
            train_ds,
            direction_data=held_ds,
            batch_size=cfg.batch_size,
            max_batches=cfg.stone_max_batches,
            gradient=g_train,
            refine_steps=cfg.stone_refine_steps,
            progress=cfg.progress,
            **grow_kwargs,
        )
        stones = {"train": stone_s.to_dict(), "held_out": stone_pop.to_dict()}
        (out / "stepping_stones.json").write_text(json.dumps(stones, indent=2))
    probe_result.gradients = None  # free them before training
    lap("stepping_stones")

    # 3. Grow and train the new blocks; the fallback rule picks the better of f_new and f~_S.
    _log(cfg, f"growing at {positions} and training for {cfg.train_steps} steps")
    grow_depth(model, positions, **grow_kwargs)
    train_result = train(
        model,
        train_ds,
        eval_data=held_ds,
        stepping_stone=stone_model,
        max_steps=cfg.train_steps,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        eval_steps=cfg.eval_steps,
        trainable=cfg.trainable,
        seed=cfg.seed,
        output_dir=str(out / "train"),
        save_final_model=False,
        selection_max_examples=cfg.selection_max_examples,
        progress_bar=cfg.progress,
    )
    model = train_result.model
    (out / "train").mkdir(exist_ok=True)
    (out / "train" / "train_result.json").write_text(json.dumps(train_result.to_dict(), indent=2, default=str))
    plot_training(train_result, out / "train" / "loss.png")
    lap("train")

    # 4. Paired evaluation on the test split, with the Route A/B terms.
    _log(cfg, f"paired evaluation on {len(test_ds)} test examples")
    routes = route_inputs(
        model,
        n_train=len(train_ds),
        train_result=train_result,
        stone_pop=pop_model,
        held_out=held_ds if stones else None,
        stone=stone_model,
        test_data=test_ds if stone_model is not None else None,
        block_data=train_ds if cfg.route_max_examples is None else train_ds.select(range(min(len(train_ds), cfg.route_max_examples))),
        batch_size=cfg.batch_size,
    )
    eval_result = evaluate_delta(
        model, test_ds, delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size, routes=routes, progress=cfg.progress
    )
    paths = write_report(eval_result, out / "eval", title=f"{Path(base_name).name} grown at {positions}", command=command)
    lap("evaluate")

    # 5. Save the selected model with its card and report.
    summary = {
        "decision": "grew",
        "base_model": base_name,
        "data": cfg.data,
        "positions": positions,
        "why": why,
        "probe": _probe_summary(probe_result),
        "stepping_stones": {k: {key: v[key] for key in ("eta", "grad_norm", "loss_old", "loss_stone") if key in v} for k, v in stones.items()},
        "selected": train_result.selected,
        "train_losses": train_result.train_losses,
        "delta_erm": train_result.delta_erm,
        "held_out_loss": {"before": train_result.eval_loss_before, "after": train_result.eval_loss_after},
        "test": {
            "loss_old": eval_result.loss_old,
            "loss_new": eval_result.loss_new,
            "delta": eval_result.delta,
            "intervals": {k: list(v) for k, v in eval_result.intervals.items()},
            "certified": getattr(eval_result, "certified", None),
            "verdict": getattr(eval_result, "verdict", None),
        },
        "timings_s": timings,
    }
    card = render_model_card(
        CardInfo.from_model(
            model,
            base_model=base_name,
            base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct" if cfg.model == "smollm2" else None,
            repo_id=cfg.push_to_hub,
            probe=probe_result,
            training=train_result,
            evaluation=eval_result,
            config=cfg.to_dict(),
            command=command,
            datasets=[cfg.data],
            license=cfg.license,
        )
    )
    model_dir = save_pretrained(model, out / "model", tokenizer=tokenizer)
    card.save(str(model_dir / "README.md"))
    for name in ("json", "markdown"):
        shutil.copy(paths[name], model_dir / Path(paths[name]).name)
    summary["artifacts"] = {
        "model": str(model_dir),
        "report": str(paths["markdown"]),
        "probe_plot": str(probe_dir / "probe.png"),
        "loss_plot": str(out / "train" / "loss.png"),
    }
    lap("save")
    if cfg.push_to_hub:
        from .hub.push import push_to_hub

        summary["pushed"] = push_to_hub(model_dir, cfg.push_to_hub, private=cfg.hub_private, endpoint=cfg.hub_endpoint)
    summary["timings_s"] = timings
    _write_summary(out, summary, cfg)
    return RunResult(out, summary, model)


def _probe_summary(result) -> dict:
    best = result.recommendation.get("best")
    i = result.positions.index(best) if best in result.positions else None
    return {
        "recommendation": result.recommendation,
        "best": best,
        "best_signal": result.signal[i] if i is not None else None,
        "best_z": result.z[i] if i is not None else None,
        "num_improvable": int(sum(result.improvable)),
        "num_positions": len(result.positions),
    }


def _fmt(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def summary_markdown(summary: dict) -> str:
    """The closing table a person reads first."""
    if summary["decision"] != "grew":
        probe = summary["probe"]
        return (
            "| | |\n|---|---|\n"
            f"| decision | **do not grow** |\n| why | {summary.get('reason')} |\n"
            f"| positions with an observable signal | {probe['num_improvable']} of {probe['num_positions']} |\n"
        )
    test, probe = summary["test"], summary["probe"]
    rows = [
        ("grew at", f"k = {summary['positions']} ({summary['why']})"),
        ("probe", f"best k = {probe['best']}, signal {_fmt(probe['best_signal'])}, z = {_fmt(probe['best_z'], 1)}; "
                  f"{probe['num_improvable']} of {probe['num_positions']} positions improvable"),
        ("selected (fallback rule)", f"{summary['selected']}, Delta_ERM = {_fmt(summary['delta_erm'])}"),
        ("train loss", ", ".join(f"{k} {_fmt(v)}" for k, v in summary["train_losses"].items())),
        ("held-out loss", f"{_fmt(summary['held_out_loss']['before'])} -> {_fmt(summary['held_out_loss']['after'])}"),
        ("test loss old -> new", f"{_fmt(test['loss_old'])} -> {_fmt(test['loss_new'])}"),
        ("test delta (old - new)", _fmt(test["delta"])),
    ]
    rows += [(f"interval ({name})", f"[{_fmt(lo)}, {_fmt(hi)}]") for name, (lo, hi) in test["intervals"].items()]
    if test.get("verdict"):
        rows.append(("verdict", str(test["verdict"])))
    rows += [(f"artifact: {k}", f"`{v}`") for k, v in summary.get("artifacts", {}).items()]
    if summary.get("pushed"):
        rows.append(("pushed", summary["pushed"]))
    rows.append(("time (s)", ", ".join(f"{k} {v}" for k, v in summary["timings_s"].items())))
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def _write_summary(out: Path, summary: dict, cfg: RunConfig) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text("# hf-depthgrow run\n\n" + summary_markdown(summary))
