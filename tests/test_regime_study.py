"""Regime study recipe: its YAML configs load and validate, the plateau check's arithmetic, the base's
vocabulary and data split, bad input (one line, exit 2, nothing written), and `--smoke` end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs" / "regime_study"
FULL_STUDY = "python recipes/regime_study.py --config recipes/configs/regime_study/default.yaml --engine ray"


def load_recipe():
    spec = importlib.util.spec_from_file_location("recipe_regime_study", REPO / "recipes" / "regime_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


def _umask():
    from hf_depthgrow.utils import umask

    return umask()


def parse(argv):
    from hf_depthgrow.config import parse_args

    return parse_args(recipe.RegimeStudyConfig, argv=argv)[0]


@pytest.mark.parametrize("name", ["default.yaml", "smoke.yaml"])
def test_config_loads_and_validates(name):
    path = CONFIGS / name
    cfg = parse(["--config", str(path)])
    values = yaml.safe_load(path.read_text())
    for key, value in values.items():  # every key of the file reached the dataclass
        assert getattr(cfg, key) == value, key
    for seed in cfg.seeds:  # the continued training's CompareConfig builds for every seed
        compare = cfg.compare_config(seed)
        assert compare.seed == seed and compare.sweep == cfg.budgets and compare.scheduler == "wsd"
    assert cfg.oracle_config().sweep == cfg.oracle_budgets and cfg.oracle_budgets[1] >= 8 * cfg.oracle_budgets[0]
    assert "python recipes/regime_study.py" in path.read_text()


def test_default_config_reaches_the_regime():
    """default.yaml: budgets span >= 32x and the largest is >= 100 tokens per parameter of the one-block arm (the oracle's
    larger budget too); every arm and predictor the study names."""
    cfg = parse(["--config", str(CONFIGS / "default.yaml")])
    model = recipe.build_base(cfg, vocab_size=100)
    fig = recipe.regime_figures(cfg, model)
    assert fig["span"] >= 32
    assert fig["tokens_per_parameter"][-1] >= 100 and fig["oracle_tokens_per_parameter"][-1] >= 100
    assert fig["block_parameters"] == sum(p.numel() for p in model.model.layers[0].parameters())
    assert set(cfg.growth) >= {"top:1", "probe:1"} and any(g.startswith("interleave:") for g in cfg.growth)
    assert {"layers", "lora", "full"} <= set(cfg.controls) and cfg.lookahead_arm
    assert set(cfg.oracle_predictors) == {"z", "signal", "lookahead", "block_influence", "depth", "adept", "midas"}
    assert len(cfg.seeds) >= 2 and cfg.max_forgetting is not None and cfg.num_layers >= 4
    assert recipe.__doc__.split("\n\n")[1].strip() == FULL_STUDY


def test_plateau_check_flat_and_not_flat():
    # 11 evaluations over 100 steps; the window is steps >= 80: 80, 90, 100
    flat = [(s, 4.0) for s in range(0, 80, 10)] + [(80, 2.015), (90, 1.99), (100, 2.0)]
    out = recipe.plateau_check(flat, tolerance=0.01, window=0.2)
    assert out["flat"] and out["points"] == 3 and out["window_start"] == 80
    assert out["max_deviation"] == pytest.approx(0.0075)  # |2.015 - 2| / 2
    assert out["drop"] == pytest.approx(0.0075) and "FLAT" in out["text"]
    # the same curve still falling by 2% over the window is not flat
    falling = flat[:-3] + [(80, 2.04), (90, 2.02), (100, 2.0)]
    out = recipe.plateau_check(falling, tolerance=0.01, window=0.2)
    assert not out["flat"] and out["max_deviation"] == pytest.approx(0.02) and "NOT flat" in out["text"]
    assert recipe.plateau_check(falling, tolerance=0.025, window=0.2)["flat"]
    # a bump inside the window counts too, not only the drop from its first point
    bump = flat[:-3] + [(80, 2.0), (90, 2.05), (100, 2.0)]
    out = recipe.plateau_check(bump)
    assert not out["flat"] and out["drop"] == 0.0 and out["max_deviation"] == pytest.approx(0.025)
    # the window follows the final step: at 50 steps it is steps >= 40
    assert recipe.plateau_check(flat[:6], window=0.2)["window_start"] == 40
    # fewer than 3 evaluations in the window cannot show a plateau
    sparse = [(0, 4.0), (50, 2.0), (100, 2.0)]
    out = recipe.plateau_check(sparse)
    assert not out["flat"] and out["points"] == 1 and "too few" in out["text"]
    with pytest.raises(ValueError, match="empty"):
        recipe.plateau_check([])


def test_char_tokenizer_and_disjoint_pages():
    tok = recipe.char_tokenizer(["def f(x):\n    return x", "def f(x):\n    return x  # k"], min_count=2)
    text = "def f(x):\n    return x"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok(text).input_ids) == len(text)  # one token per character
    assert tok.convert_ids_to_tokens(tok("Z").input_ids) == ["<unk>"]  # never seen
    assert tok.convert_ids_to_tokens(tok("k").input_ids) == ["<unk>"]  # seen once (< min_count)
    assert tok.convert_tokens_to_ids(["<pad>", "<eos>", "<unk>"]) == [0, 1, 2]
    cfg = parse(["--config", str(CONFIGS / "smoke.yaml")])
    split = recipe.page_split(497, cfg)
    parts = [set(v) for v in split.values()]
    assert sum(map(len, parts)) == 497 and len(set().union(*parts)) == 497  # disjoint, complete
    assert split == recipe.page_split(497, cfg)  # seeded


def run_main(argv, capsys):
    rc = recipe.main(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seeds", "0"], "seeds must be at least 2 distinct"),
        (["--budgets", "16", "8"], "budgets must be strictly increasing"),
        (["--growth", "middle:1"], "unknown growth arm 'middle:1'"),
        (["--base-min-steps", "50", "--base-max-steps", "40"], "exceeds the cap"),
        (["--plateau-tolerance", "1.5"], "--plateau-tolerance must be in (0, 1)"),
        (["--hidden-size", "15"], "multiple of --num-heads"),
        (["--oracle-budgets", "4", "16"], "the second >= 8x the first"),
        (["--oracle-positions", "0", "1", "9"], "at least 4 distinct positions in 0..num_layers"),
        (["--lernig-rate", "1"], "unknown option --lernig-rate"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "study"
    rc, err = run_main(["--smoke", "--output-dir", str(out), *flags], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_a_base_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "study"
    (out / "base").mkdir(parents=True)
    (out / "base" / "notes.txt").write_text("mine")
    rc, err = run_main(["--smoke", "--output-dir", str(out)], capsys)
    assert rc == 2 and "it was not written by hf-depthgrow (no .hf_depthgrow_run file)" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in (out / "base").iterdir()] == ["notes.txt"] and sorted(p.name for p in out.iterdir()) == ["base"]


def test_smoke_and_config_together_is_refused(capsys):
    rc, err = run_main(["--smoke", "--config", str(CONFIGS / "default.yaml")], capsys)
    assert rc == 2 and "give one of them" in err


def test_smoke_end_to_end(tmp_path, capsys):
    """`--smoke` as CI runs it: base, plateau check, compare at every budget for two seeds, the summary."""
    out = tmp_path / "study"
    # The wall-time limit only catches a hang (on a shared machine wall time was 10-20x the CPU time); the smoke size's
    # cost is a figure for the docs, not an assertion: speed is measured in benchmarks, never in timed tests.
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "regime_study.py"), "--smoke", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    assert "plateau check: held-out losses" in printed and "tokens per trainable parameter of the one-block growth arm" in printed
    assert "seeds (data order of the continued training and of the oracle sweep): [0, 1]" in printed
    assert "look-ahead (held-out loss drop" in printed and "oracle sweep:" in printed
    summary = json.loads((out / "study.json").read_text())
    cfg = parse(["--config", str(CONFIGS / "smoke.yaml")])
    assert summary["seeds"] == cfg.seeds
    assert set(summary["per_seed"]) == {str(s) for s in cfg.seeds}
    for seed in cfg.seeds:
        per = summary["per_seed"][str(seed)]
        assert [b["steps"] for b in per["budgets"]] == cfg.budgets and per["verdict"]
        assert per["crossover"] and per["validation"]  # 6 budgets: the fits, the crossover and its out-of-sample check
        half = per["half"]  # fitted on the 3 smaller budgets, checked against the 3 larger
        assert half["fit_steps"] == cfg.budgets[:3] and [m["steps"] for m in half["measured"]] == cfg.budgets[3:]
        for m in half["measured"]:
            assert m["interval"][0] <= m["lead"] <= m["interval"][1]
        assert half["predicted"] and f"fitted on {cfg.budgets[:3]} steps only" in (out / "study.md").read_text()
        assert (out / f"seed{seed}" / "compare.json").is_file()
    arms = {row["arm"] for row in summary["table"]}
    pick = summary["lookahead"]
    assert pick["arm"] == f"at:{pick['pick']}" and pick["pick"] == int(np.argmax(pick["scores"]))
    assert arms == set(cfg.growth) | set(cfg.controls) | ({pick["arm"]} if not pick["same_as"] else set())
    oracle = summary["oracle"]
    assert [v["budget"] for v in oracle["budgets"]] == cfg.oracle_budgets and oracle["positions"] == list(range(cfg.num_layers + 1))
    for view in oracle["budgets"]:
        assert {r["predictor"] for r in view["table"]} >= set(cfg.oracle_predictors) and len(view["forgetting"]) == len(oracle["positions"])
    assert oracle["across_budgets"]["budgets"] == cfg.oracle_budgets and (out / "oracle" / "probe_validation.json").is_file()
    assert len(summary["table"]) == len(arms) * len(cfg.budgets)
    for row in summary["table"]:
        means = [row["gain"][str(s)]["mean"] for s in cfg.seeds]
        assert row["gain_spread"] == pytest.approx(max(means) - min(means))
    assert summary["base"]["plateau"]["text"] in (out / "study.md").read_text()
    assert (out.parent / "study-trials").is_dir() and any((out.parent / "study-trials").iterdir())  # the sibling trial store
    base = out / "base"
    assert {"config.json", "model.safetensors", "tokenizer.json", "settings.json"} <= {p.name for p in base.iterdir()}
    assert stat.S_IMODE(base.stat().st_mode) == 0o777 & ~_umask()  # not mkdtemp's 0700
    assert not [p for p in out.iterdir() if p.name.startswith(".base.")]  # no temp folder left

    # Reused: the same settings load the saved base (it still loads with plain transformers), nothing retrains.
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(base).config.hidden_size == cfg.hidden_size
    before = (base / "model.safetensors").read_bytes()
    # The reruns call the recipe's main in process: the subprocess above already runs the script as a user does, and
    # each further launch only paid for another interpreter and its imports.
    capsys.readouterr()
    rc = recipe.main(["--smoke", "--output-dir", str(out), "--base-only", "--resume"])
    printed = capsys.readouterr().out
    assert rc == 0 and "reusing the base" in printed and "base step" not in printed
    # Other base settings: refused in one line, the saved base untouched.
    rc, err = run_main(["--smoke", "--output-dir", str(out), "--base-only", "--resume", "--base-learning-rate", "0.01"], capsys)
    assert rc == 2 and "other settings (base_learning_rate)" in err
    assert len(err.strip().splitlines()) == 1
    assert (base / "model.safetensors").read_bytes() == before


def test_the_recipe_modules_use_the_public_api_only():
    """recipes/regime/*.py as test_cli checks recipes/*.py: hf_depthgrow's public modules and subpackages, no private name."""
    import ast

    public = {"hf_depthgrow", "hf_depthgrow.config", "hf_depthgrow.losses", "hf_depthgrow.chunked_loss", "hf_depthgrow.utils", "hf_depthgrow.comparison",
              "hf_depthgrow.data", "hf_depthgrow.probe"}
    offenders = []
    for path in (REPO / "recipes" / "regime").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_depthgrow"):
                names = [a.name for a in node.names]
                if node.module not in public or any(n.startswith("_") for n in names):
                    offenders.append(f"{path.name}: from {node.module} import {names}")
    assert not offenders
