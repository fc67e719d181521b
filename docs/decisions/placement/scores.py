"""Placement predictors scored on a committed oracle task, without re-running the oracle's training.

The committed probe validations (`docs/decisions/<task>/probe_validation.json`) hold the realized gain of a block at
each position and the scores of the predictors that ran then. This script adds the predictors a task lacks (ADEPT,
MIDAS, the per-layer gradient norm), computed on the same model, data and positions as that oracle, and writes
`placement_scores.json` next to it. It recomputes block influence too (a forward pass) and stores its largest
difference from the committed scores: 0 up to float noise says the model and data are the oracle's.

    python docs/decisions/placement/scores.py smollm2-shakespeare
    python docs/decisions/placement/scores.py vit-fashion-mnist-to-digits --model runs/bases/vit/base/model
    python docs/decisions/placement/scores.py minilm-tweets --layers 6          # MIDAS only: the trained base is not committed
    python docs/decisions/placement/scores.py regime-v2

`smollm2-shakespeare`, `vit-fashion-mnist-to-digits` and `minilm-tweets` re-load what their committed `compare`
command loaded (its `command.txt`; `--model` replaces the base folder). The committed runs predate per-document
retention sampling, so the retention set is read as then: consecutive blocks (`--retention-blocks-per-document 0`).
`regime-v2` loads the re-run regime study's committed base (`docs/decisions/regime-v2/base`; never re-trained here: a
base whose settings differ from `recipes/configs/regime_study/default.yaml` is refused) and builds the training blocks
and retention set the study built from that config; their counts are checked against the study's own.
`docs/decisions/placement/track_record.py` turns the scores into the policy table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the track-record script beside it names the tasks

from track_record import REPO, TASKS  # noqa: E402
# How the base of a task was made, where it is not in the repository (docs/decisions.md gives the same commands).
BASES = {
    "vit-fashion-mnist-to-digits": "python recipes/image_classification.py --config "
    "recipes/configs/image_classification/vit_fashion_mnist.yaml --output-dir runs/bases/vit --max-steps 1 (its base stage)",
    "minilm-tweets": "docs/decisions/minilm-tweets/command.txt, step 1 (not re-created here: 1,130 s of training)",
    "regime-v2": "recipes/regime_study.py's base (recipes/configs/regime_study/default.yaml), committed in docs/decisions/regime-v2/base",
}
MISSING = {  # what each committed task lacks
    "smollm2-shakespeare": ("adept", "midas"),
    "minilm-tweets": ("adept", "midas"),
    "vit-fashion-mnist-to-digits": ("adept", "midas"),
    "regime-v2": ("gradient_norm",),
}
REGIME = REPO / "docs" / "decisions" / "regime-v2"  # the study's folder: base/ (reused as it is) and seed0/compare.json


def _compare_argv(folder: Path, model: str | None) -> list[str]:
    """The committed `hf-depthgrow compare` arguments, with `model` as the base and retention read as then."""
    line = next(line for line in (folder / "command.txt").read_text().splitlines() if "hf-depthgrow compare" in line)
    argv = shlex.split(line.split("hf-depthgrow compare", 1)[1])
    if model is not None:
        argv = [*argv[: argv.index("--model")], "--model", model, *argv[argv.index("--model") + 2 :]] if "--model" in argv else [*argv, "--model", model]
    return [*argv, "--retention-blocks-per-document", "0"]


def _compare_inputs(folder: Path, model: str | None):
    """`(model, train rows, retention rows, batch size, argv)` as the committed comparison loaded them."""
    from hf_depthgrow.cli.compare import _load, build_parser

    argv = _compare_argv(folder, model)
    script, cfg = build_parser().parse(argv)
    loaded, splits, retention = _load(script, cfg)
    return loaded, splits["train"], retention, cfg.batch_size, argv


def _regime_inputs():
    """`(model, train rows, retention rows, batch size, base info)` of the re-run regime study: its committed base and its
    Shakespeare training blocks and retention set, built from the study's config as `recipes/regime_study.py` built them."""
    sys.path.insert(0, str(REPO / "recipes"))
    from regime.base import prepare_base
    from regime.config import RegimeStudyConfig
    from regime.study import shakespeare_rows

    from hf_depthgrow.config import parse_args

    if not (REGIME / "base" / "settings.json").is_file():  # prepare_base would train a new base into docs/
        raise SystemExit(f"error: {(REGIME / 'base').relative_to(REPO)} holds no committed base (settings.json)")
    config = REPO / "recipes" / "configs" / "regime_study" / "default.yaml"
    (cfg,) = parse_args(RegimeStudyConfig, argv=["--config", str(config), "--output-dir", str(REGIME)])
    model, tokenizer, retention, base = prepare_base(cfg)  # reuses the base only when its settings are the config's
    print(base["plateau"]["text"], f"({base.get('steps')} steps)")
    train, _, _ = shakespeare_rows(cfg, tokenizer)
    study = json.loads((REGIME / "seed0" / "compare.json").read_text())["num_examples"]
    if (len(train), len(retention)) != (study["train"], study["retention"]):
        raise SystemExit(f"error: {len(train)} training and {len(retention)} retention rows, where the study used {study['train']} "
                         f"and {study['retention']}: the config is not the one the study ran")
    return model, train, retention, cfg.batch_size, base


def _midas_only(folder: Path, layers: int) -> dict:
    from hf_depthgrow.probe.placement_rules import midas_rule

    positions = json.loads((folder / "probe_validation.json").read_text())["positions"]
    return {"positions": positions, "scores": {"midas": midas_rule(layers, positions)}, "seconds": {"midas": 0.0}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--model", help="the base folder of a compare task (default: the committed command's)")
    parser.add_argument("--layers", type=int, help="score MIDAS only, from the base's layer count (no model is loaded)")
    parser.add_argument("--predictors", nargs="+", help="default: what the task lacks")
    parser.add_argument("--output", help="where the JSON goes (default: placement_scores.json beside the oracle's)")
    args = parser.parse_args(argv)
    folder = TASKS[args.task]
    committed = json.loads((folder / "probe_validation.json").read_text())
    which = tuple(args.predictors or MISSING[args.task])
    record = {"command": "python docs/decisions/placement/scores.py " + shlex.join(argv if argv is not None else sys.argv[1:])}
    if args.task in BASES:
        record["base_made_by"] = BASES[args.task]
    started = time.perf_counter()
    if args.layers is not None:
        out = _midas_only(folder, args.layers)
        record["model"] = f"none loaded: MIDAS from the base's {args.layers} layers"
    else:
        from hf_depthgrow.probe.baselines import predictor_scores

        if args.task == "regime-v2":
            model, train, retention, batch_size, base = _regime_inputs()
            record["base"] = {"folder": str((REGIME / "base").relative_to(REPO)), "steps": base.get("steps"),
                              "plateau_last": base["plateau"]["last"]}
        else:
            model, train, retention, batch_size, compare_argv = _compare_inputs(folder, args.model)
            record["compare_arguments"] = compare_argv
        positions = committed["positions"]
        out = predictor_scores(model, train, positions, which=(*which, "block_influence"), batch_size=batch_size,
                               **({"retention_data": retention} if "adept" in which else {}))
        check = out["scores"].pop("block_influence")
        out["seconds"].pop("block_influence")
        diff = max(abs(a - b) for a, b in zip(check, committed["scores"]["block_influence"]))
        record["same_model_check"] = {"block_influence_max_abs_diff": diff, "block_influence": check}
        if diff > 1e-4:  # float noise is ~1e-9 (SmolLM2); a re-trained base differs by ~1e-2
            print(f"warning: block influence differs from the committed oracle's by up to {diff:.3g}: this is not the oracle's "
                  "model (or not its data); the scores are of a re-created one")
        import torch

        record["torch_threads"] = torch.get_num_threads()  # float reductions, so the last digits, depend on it
        record["retention_examples"] = len(retention) if retention is not None else None
        record["train_examples"] = len(train)
    record.update(positions=out["positions"], scores=out["scores"], seconds=out["seconds"], total_seconds=time.perf_counter() - started)
    path = Path(args.output) if args.output else folder / "placement_scores.json"
    from hf_depthgrow.evaluation.formatting import scrub_paths
    from hf_depthgrow.utils import write_json

    write_json(path, scrub_paths(record))  # public: local absolute paths cut to their last part
    print(json.dumps({k: record[k] for k in ("scores", "seconds", "total_seconds")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
