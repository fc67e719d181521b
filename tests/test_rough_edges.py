"""Rough edges a new user hit: settings silently ignored, messages naming the wrong thing, API arguments unchecked.

Each case is one clear line (exit code 2 in the CLI, a `ValueError`/`TypeError` naming the argument in the API) or
the behaviour a user expects.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hf_depthgrow.cli import main
from hf_depthgrow.comparison import CompareConfig

# compare's refusals below come from parsing (or right after it): no model or data is needed on disk.
COMPARE = ["compare", "--model", "nowhere", "--data", "nowhere.txt", "--growth", "top:1", "--controls", "layers",
           "--budgets", "4", "8", "16"]


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"hf-depthgrow {command}: "), err
    return err


# ---------------------------------------------------------------- Ray settings on the serial engine


@pytest.mark.parametrize("flag", [["--max-concurrent-trials", "2"], ["--resources-per-trial", "4"]])
def test_ray_settings_without_ray_are_refused(flag, capsys, tmp_path):
    """Before: the serial engine ran one trial at a time and ignored them without a word (exit 0)."""
    assert main([*COMPARE, "--output-dir", str(tmp_path / "o"), *flag]) == 2
    err = _one_line(capsys, "compare")
    assert f"{flag[0]} is a Ray Tune setting, but engine is 'serial'" in err and "use --engine ray or drop it" in err, err
    assert not (tmp_path / "o").exists()


def test_ray_settings_refused_in_the_api_with_field_names():
    with pytest.raises(ValueError, match="max_concurrent_trials is a Ray Tune setting, but engine is 'serial'"):
        CompareConfig(max_concurrent_trials=2)
    with pytest.raises(ValueError, match="resources_per_trial is a Ray Tune setting"):
        CompareConfig(resources_per_trial=2)
    CompareConfig(resources_per_trial=1)  # the default stays accepted


# ---------------------------------------------------------------- the learning-rate cap


def test_max_learning_rate_is_checked_against_the_arms_in_the_run_only():
    """Before: refused because of the lora grid (top 1e-2) in a run without a lora arm."""
    cfg = CompareConfig(growth=["top:1"], controls=["layers"], growth_learning_rates=[1e-3], max_learning_rate=2e-3)
    assert cfg.max_learning_rate == 2e-3
    with pytest.raises(ValueError, match=r"below the largest rate of the lora arms' grid \(0.01\)"):
        CompareConfig(growth=["top:1"], controls=["lora:4"], growth_learning_rates=[1e-3], max_learning_rate=2e-3)


# ---------------------------------------------------------------- a forgetting budget needs a retention set


def test_max_forgetting_without_retention_is_refused(capsys, tmp_path):
    """Before: accepted, and the verdict silently had no forgetting budget."""
    assert main([*COMPARE, "--output-dir", str(tmp_path / "o"), "--retention-data", "none", "--max-forgetting", "0.05"]) == 2
    err = _one_line(capsys, "compare")
    assert "--max-forgetting is a forgetting budget and needs a retention set" in err, err


def test_compare_plans_arguments_are_checked():
    from hf_depthgrow.comparison import compare_plans
    from hf_depthgrow.testing import tiny_model, tiny_rows

    with pytest.raises(TypeError, match="model must be a torch nn.Module .*got NoneType"):
        compare_plans(None, [], [], [], growth=["top:1"], controls=["layers"])
    model = tiny_model("llama")
    rows = tiny_rows(model, 4)
    with pytest.raises(TypeError, match="probe_result must be a ProbeResult .*got str"):
        compare_plans(model, rows, rows, rows, growth=["top:1"], controls=["layers"], probe_result="junk")
    with pytest.raises(ValueError, match="max_forgetting is a forgetting budget and needs a retention set"):
        compare_plans(model, rows, rows, rows, growth=["top:1"], controls=["layers"], max_forgetting=0.05)


@pytest.mark.parametrize("field", ["growth", "controls"])
def test_a_string_is_one_arm(field):
    """Before: CompareConfig(growth="top:1") said "unknown growth arm 't'" (the string was read letter by letter)."""
    value = {"growth": "top:1", "controls": "layers"}[field]
    cfg = CompareConfig(**{field: value})
    assert getattr(cfg, field) == [value]
    with pytest.raises(ValueError, match="unknown growth arm 'middle:1'"):
        CompareConfig(growth="middle:1")


# ---------------------------------------------------------------- crossover: ties and settings


def _flat_sweep(offsets):
    base = np.random.default_rng(0).uniform(4.0, 6.0, 50)
    tokens = [1000, 2000, 4000, 8000]
    return tokens, {"g": [base + d for d in offsets], "c": [base.copy() for _ in tokens]}


def test_flat_curves_a_hair_apart_are_a_tie_not_a_crossover():
    """Before: "growth is already ahead at the largest budget (g fitted 5.0537 < c 5.0537)" on a 6e-8-nat difference."""
    from hf_depthgrow.comparison.crossover import TIE_NATS, predict_crossover

    tokens, losses = _flat_sweep((3e-8, 2e-8, 1e-8, -6e-8))
    out = predict_crossover(tokens, losses, growth=["g"], controls=["c"], best_growth="g", best_control="c", n_bootstrap=20)
    assert out["on_gain"]["status"] == "tie", out["on_gain"]["text"]
    assert out["on_gain"]["text"].startswith(f"no crossover: the fitted curves of g and c stay within {TIE_NATS:g} nats")
    # A real gap is still a crossover.
    tokens, losses = _flat_sweep((0.3, 0.2, 0.1, 0.05))
    out = predict_crossover(tokens, losses, growth=["g"], controls=["c"], best_growth="g", best_control="c", n_bootstrap=0)
    assert out["on_gain"]["status"] == "crossover" and out["on_gain"]["multiple"] > 1


@pytest.mark.parametrize("kwargs, match", [
    ({"n_bootstrap": 2.5}, "n_bootstrap must be an int >= 0"),
    ({"n_bootstrap": math.nan}, "n_bootstrap must be an int >= 0"),
    ({"n_bootstrap": "10"}, "n_bootstrap must be an int >= 0"),
    ({"horizon": math.inf}, "horizon must be a finite number > 1"),
    ({"seed": -1}, "seed must be an int >= 0"),
])
def test_predict_crossover_settings_are_checked(kwargs, match):
    from hf_depthgrow.comparison.crossover import predict_crossover

    tokens, losses = _flat_sweep((0.3, 0.2, 0.1, 0.05))
    with pytest.raises(ValueError, match=match):
        predict_crossover(tokens, losses, growth=["g"], controls=["c"], best_growth="g", best_control="c", **kwargs)


def test_validate_fit_settings_are_checked():
    """Before: validate_fit(n_bootstrap="10") failed deep inside with a TypeError comparing str and int."""
    from hf_depthgrow.comparison.crossover import validate_fit

    tokens, losses = _flat_sweep((0.3, 0.2, 0.1, 0.05))
    with pytest.raises(ValueError, match=r"n_bootstrap must be an int >= 0 \(replicates\), got '10'"):
        validate_fit(tokens, losses, n_bootstrap="10")


def test_check_int_refuses_what_is_not_an_int_at_least_low():
    """The one check behind every "X must be an int >= N" setting: a bool is refused though Python counts it as an int."""
    from hf_depthgrow.utils import check_int

    for value, kwargs in ((1, {}), (7, {}), (None, {"allow_none": True}), (np.int64(3), {"numpy": True})):
        check_int("steps", value, 1, **kwargs)
    for value, kwargs, message in (
        (True, {}, "steps must be an int >= 1, got True"),
        (0, {}, "steps must be an int >= 1, got 0"),
        (2.0, {}, "steps must be an int >= 1, got 2.0"),
        ("3", {}, "steps must be an int >= 1, got '3'"),
        (None, {}, "steps must be an int >= 1, got None"),
        (np.int64(3), {}, f"steps must be an int >= 1, got {np.int64(3)!r}"),
        (np.bool_(True), {"numpy": True}, f"steps must be an int >= 1, got {np.bool_(True)!r}"),
        (0, {"allow_none": True}, "steps must be an int >= 1 or None, got 0"),
        (-1, {"what": " (replicates)"}, "steps must be an int >= 1 (replicates), got -1"),
    ):
        with pytest.raises(ValueError) as err:
            check_int("steps", value, 1, **kwargs)
        assert str(err.value) == message


# ---------------------------------------------------------------- `make run` twice


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from tiny_lm import make_tiny_lm

    return make_tiny_lm(tmp_path_factory.mktemp("again"), max_chars=30_000)


def _run_argv(tiny_lm, out, cache, *extra):
    return ["run", "--model", str(tiny_lm / "tiny"), "--data", str(tiny_lm / "sample.txt"), "--output-dir", str(out),
            "--block-size", "32", "--max-examples", "64", "--batch-size", "8", "--max-steps", "2", "--eval-steps", "1",
            "--stepping-stone-max-batches", "1", "--learning-rate", "3e-3", "--no-progress", "--controls", "layers",
            "--force", "--evidence-cache", str(cache), *extra]


def test_the_same_run_again_replaces_its_own_output_and_reuses_the_evidence(tiny_lm, tmp_path, capsys, monkeypatch):
    """Before: the second `make run` stopped with "exists and is not empty; pass --overwrite" (exit 2), though the
    README promises that a second run reuses the evidence."""
    import json
    import warnings

    import hf_depthgrow.plots as plots
    from hf_depthgrow.probe import plots as probe_plots

    figures, save = {}, plots.save_figure

    def recorded(fig, path, **kwargs):
        figures[Path(path).name] = fig
        return save(fig, path, **kwargs)

    for module in (plots, probe_plots):  # loss.png is drawn by the one, probe.png by the other
        monkeypatch.setattr(module, "save_figure", recorded)
    out, cache = tmp_path / "out", tmp_path / "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(_run_argv(tiny_lm, out, cache)) == 0
    first = json.loads((out / "summary.json").read_text())
    # The figures a run draws (before: no k marked, no title, no control curve): probe.png marks the k grown at;
    # loss.png has a title and the control's curves.
    marks = [line.get_label() for ax in figures["probe.png"].axes for line in ax.get_lines() if line.get_label().startswith("grown at")]
    assert marks == [f"grown at k = {', '.join(map(str, first['positions']))}"]
    loss = figures["loss.png"].axes[0]
    assert loss.get_title().endswith("against the equal-budget control")
    assert any(line.get_label().startswith("control (layers") for line in loss.get_lines())
    monkeypatch.undo()
    # Before: numpy's "Degrees of freedom <= 0" (a std of one bootstrap resample) and one "loss_bound not given"
    # warning with its source line per paired evaluation; now one line, once.
    shown = [str(w.message) for w in caught if "Degrees of freedom" in str(w.message) or "loss_bound" in str(w.message)]
    assert shown == []
    assert capsys.readouterr().err.count("loss_bound not given") == 1
    assert main(_run_argv(tiny_lm, out, cache)) == 0
    assert "holds this run's own earlier output (same settings): replacing it" in capsys.readouterr().err
    second = json.loads((out / "summary.json").read_text())
    assert "probe" in second["reused"] and "reused" not in first
    assert second["test"] == first["test"]
    # Other settings, or a file someone added since: still refused, and nothing changes.
    assert main(_run_argv(tiny_lm, out, cache, "--max-steps", "3")) == 2
    assert "exists and is not empty; pass --overwrite to replace it" in capsys.readouterr().err
    (out / "my_notes.txt").write_text("mine")
    assert main(_run_argv(tiny_lm, out, cache)) == 2
    assert "it holds files hf-depthgrow did not write (my_notes.txt)" in capsys.readouterr().err  # --overwrite would not help
    assert (out / "my_notes.txt").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text()) == second


# ---------------------------------------------------------------- progress bars


def test_stepping_stone_bars_have_a_total_and_end_full(monkeypatch):
    """Before: the line search's bar had no total (a bare counter)."""
    import tqdm.auto

    from hf_depthgrow.probe.line_search import most_evaluations
    from hf_depthgrow.probe.stepping_stone import stepping_stone
    from hf_depthgrow.testing import tiny_model, tiny_rows

    bars = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": open("/dev/null", "w")})
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    model = tiny_model("llama")
    stepping_stone(model, 1, tiny_rows(model, 8), batch_size=4, max_expand=3, refine_steps=1, progress=True)
    stones = [b for b in bars if str(b.desc).startswith("stepping stone")]
    assert stones, [b.desc for b in bars]
    for bar in stones:
        assert bar.total is not None and 1 <= bar.n == bar.total <= most_evaluations(None, {"max_expand": 3, "refine_steps": 1})


# ---------------------------------------------------------------- push: checked before anything is written


def test_push_model_to_hub_without_a_token_writes_nothing(monkeypatch):
    """Before: the model's shards were saved to a temporary folder, then the push found there was no token."""
    import huggingface_hub

    import hf_depthgrow.hub.push as push
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_model

    from fake_hub import FakeHub, use_fake_hub_env

    use_fake_hub_env(monkeypatch, "unused")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(push, "get_token", lambda: None)

    def no_save(*args, **kwargs):
        raise AssertionError("the model was written before the push was known to be possible")

    monkeypatch.setattr(push, "save_pretrained", no_save)
    model = tiny_model("llama")
    grow_depth(model, [1])
    huggingface_hub.close_session()
    with FakeHub() as hub:
        with pytest.raises(ValueError, match="no Hugging Face token"):
            push.push_model_to_hub(model, "me/grown", endpoint=hub.endpoint)
        with pytest.raises(ValueError, match="create_pr=True opens the pull request against the default branch"):
            push.push_model_to_hub(model, "me/grown", endpoint=hub.endpoint, token="t", create_pr=True, revision="dev")
        with pytest.raises(ValueError, match="namespace"):
            push.push_model_to_hub(model, "grown", endpoint=hub.endpoint)
        assert hub.requests == []
    huggingface_hub.close_session()


def test_the_probe_figure_marks_the_probe_pick_and_the_training_figure_has_a_title():
    """Before: probe.png marked no k, loss.png had no title."""
    from types import SimpleNamespace

    from hf_depthgrow.plots import training_figure
    from hf_depthgrow.probe.plots import probe_figure
    from hf_depthgrow.probe.signal import probe
    from hf_depthgrow.testing import tiny_model, tiny_rows

    model = tiny_model("llama")
    result = probe(model, tiny_rows(model, 8), batch_size=4)
    labels = [line.get_label() for ax in probe_figure(result).axes for line in ax.get_lines()]
    best = result.recommendation.get("best")
    assert (f"the probe's pick: k = {best}" in labels) == (best is not None)
    assert not any("k =" in label for ax in probe_figure(result, chosen=[]).axes for label in map(lambda l: l.get_label(), ax.get_lines()))
    assert "grown at k = 1, 3" in [line.get_label() for line in probe_figure(result, chosen=[3, 1]).axes[1].get_lines()]
    run = SimpleNamespace(history=[{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], eval_history=[{"step": 2, "eval_loss": 1.7}])
    alone = training_figure(run).axes[0]
    assert alone.get_title() == "training of the grown model" and len(alone.get_lines()) == 2
    both = training_figure(run, control=run, control_label="control (layers [1])").axes[0]
    assert [line.get_label() for line in both.get_lines()][2:] == ["control (layers [1]): train loss", "control (layers [1]): held-out loss"]


# ---------------------------------------------------------------- --help


@pytest.mark.parametrize("command", [[], ["eval"], ["export-gguf"]])
def test_help_imports_no_torch_and_hides_debug_flags(command):
    """Before: `hf-depthgrow --help` imported torch (3.2 s idle) though cli/__init__ says it stays fast."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom hf_depthgrow.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try: main({command!r} + ['--help'])\n    except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_train_help_hides_the_debugging_flag_which_still_works(capsys):
    from hf_depthgrow.cli.train import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse(["--help"])
    assert "--stop-after-step" not in capsys.readouterr().out
    _, config, _ = build_parser().parse(["--stop-after-step", "3"])
    assert config.stop_after_step == 3


def test_export_gguf_names_its_own_flags(tmp_path, capsys):
    """Before: "... pass source_gguf= to copy the vocabulary" (the library's argument; the flag is --source-gguf)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_depthgrow.testing import tiny_model

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    model = tiny_model("llama", vocab_size=len(vocab))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main(["export-gguf", "--model", str(tmp_path / "m"), "--output", str(tmp_path / "m.gguf"), "--gguf-type", "f32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bars
    assert err.startswith("hf-depthgrow export-gguf: ") and "pass --source-gguf to copy the vocabulary" in err and "source_gguf=" not in err, err
    assert not (tmp_path / "m.gguf").exists()
