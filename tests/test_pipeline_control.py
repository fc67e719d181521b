"""`hf-depthgrow run` trains an equal-parameter control beside the growth and measures retention."""

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_depthgrow.cli import main
from hf_depthgrow.comparison.arms import matched_layers
from hf_depthgrow.data.sources import load_data, split_dataset
from hf_depthgrow.evaluation import compare_models
from hf_depthgrow.growth.placement import resolve_positions
from hf_depthgrow.pipeline import RunConfig, run_pipeline

from tiny_lm import make_tiny_lm

# What the secondary runs need only to reach the control: the smallest probe, stones and training.
QUICK = dict(max_examples=64, probe_max_batches=2, stone_max_batches=1, stone_refine_steps=0, train_steps=2, eval_steps=1,
             selection_max_examples=16, route_max_examples=8, positions=[2])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_tiny_lm(tmp_path_factory.mktemp("control"))


def _config(workdir, out, **overrides):
    settings = dict(
        model=str(workdir / "tiny"), data=str(workdir / "sample.txt"), output_dir=str(out), block_size=32, max_examples=96,
        batch_size=8, train_steps=6, eval_steps=3, stone_max_batches=2, learning_rate=3e-3, progress=False, loss_bound=10.0,
    )
    settings.update(overrides)
    return RunConfig(**settings)


@pytest.fixture(scope="module")
def run(workdir):
    cfg = _config(workdir, workdir / "out", retention_data="python_docs", retention_max_examples=16)
    assert cfg.control == "auto"  # the default: layers for native blocks (this Llama), else LoRA
    return cfg, run_pipeline(cfg, command="hf-depthgrow run (test)")


def test_control_has_the_growth_budget(run):
    cfg, result = run
    out = Path(cfg.output_dir)
    summary = json.loads((out / "summary.json").read_text())
    control = summary["control"]
    # The existing layers the new blocks copy (the tiny Llama has 4).
    assert control["kind"] == "layers" and control["layers"] == matched_layers(resolve_positions(summary["positions"], 4), 4)
    assert control["trainable_parameters"]["control"] == control["trainable_parameters"]["growth"] > 0
    assert control["units_seen"]["control"] == control["units_seen"]["growth"] > 0 and control["unit"] == "tokens"
    assert control["steps"] == {"growth": cfg.train_steps, "control": cfg.train_steps}
    # The same TrainConfig, but for what trains (and where it writes).
    grown = json.loads((out / "train" / "train_config.json").read_text())
    ctrl = json.loads((out / "control" / "train_config.json").read_text())
    differ = {k for k in grown if grown[k] != ctrl[k]}
    assert differ <= {"trainable", "trainable_layers", "output_dir"} and ctrl["trainable"] == "layers"
    # Both start from the original: the control took the growth's step-0 losses instead of recomputing them.
    grown_result = json.loads((out / "train" / "train_result.json").read_text())
    ctrl_result = json.loads((out / "control" / "train_result.json").read_text())
    assert ctrl_result["original_losses"] == grown_result["original_losses"]
    assert ctrl_result["eval_loss_before"] == grown_result["eval_loss_before"] == grown_result["original_losses"]["held_out"]


def test_sentence_matches_an_independent_comparison(run, workdir):
    cfg, result = run
    out = Path(cfg.output_dir)
    control = result.summary["control"]
    from hf_depthgrow import load_pretrained
    from hf_depthgrow.hub.loading import load_tokenizer

    grown = load_pretrained(out / "model").eval()
    data = load_data(cfg.data, model=grown, tokenizer=load_tokenizer(out / "model"), block_size=cfg.block_size,
                     max_examples=cfg.max_examples, seed=cfg.seed)
    test = split_dataset(data, {"train": cfg.train_fraction, "held_out": cfg.held_out_fraction, "test": cfg.test_fraction}, seed=cfg.seed)["test"]
    again = compare_models(result.control_model, grown, test, delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size)
    assert control["test"]["delta"] == pytest.approx(again.delta, rel=1e-4, abs=1e-6)
    low, high = again.intervals["bootstrap"]
    assert control["test"]["intervals"]["bootstrap"] == pytest.approx([low, high], rel=1e-4, abs=1e-6)
    sentence = control["sentence"]
    assert sentence.startswith("Growth beat" if low > 0 else "Growth did NOT beat")
    assert f"{again.delta:+.3f} nats/token [{low:.3f}, {high:.3f}] (bootstrap, 95%)" in sentence
    assert f"{control['trainable_parameters']['control']:,} parameters" in sentence and f"same {cfg.train_steps} steps" in sentence
    for path in (out / "summary.md", out / "eval" / "report.md", out / "model" / "report.md"):
        assert sentence in path.read_text(), path
    assert json.loads((out / "eval" / "report.json").read_text())["control"]["sentence"] == sentence
    card = ModelCard.load(out / "model" / "README.md").text
    assert sentence in card and str(workdir) not in card


def test_retention_is_reported(run):
    cfg, result = run
    retention = result.summary["retention"]
    assert retention["data"] == "python_docs" and retention["num_examples"] == 16
    for side in ("growth", "control"):
        assert set(retention[side]) >= {"forgetting", "intervals", "verdict"}
    assert retention["sentence"].startswith("Forgetting on python_docs (16 examples")
    # two blocks from each of 8 pages, resampled page by page
    assert result.summary["data_parts"]["retention"] == {"blocks": 16, "documents": 8, "resampled": "documents"}
    out = Path(cfg.output_dir)
    assert retention["sentence"] in (out / "summary.md").read_text() and (out / "eval" / "retention.json").is_file()
    assert retention["sentence"] in ModelCard.load(out / "model" / "README.md").text


def test_control_none_trains_nothing_extra(workdir, tmp_path, monkeypatch):
    import hf_depthgrow.training.trainer as trainer

    calls = []
    real = trainer.train
    monkeypatch.setattr(trainer, "train", lambda *a, **k: calls.append(k["config"].trainable) or real(*a, **k))
    result = run_pipeline(_config(workdir, tmp_path / "o", control="none", **QUICK))
    assert calls == ["new"] and result.control_model is None
    assert "control" not in result.summary and "retention" not in result.summary
    assert not (tmp_path / "o" / "control").exists() and not (tmp_path / "o" / "eval" / "control").exists()
    assert not any(k.startswith("control") for k in result.summary["timings_s"])


def test_lora_control(workdir, tmp_path):
    result = run_pipeline(_config(workdir, tmp_path / "o", control="lora", **QUICK))
    control = result.summary["control"]
    assert control["kind"] == "lora" and control["lora_r"] >= 1 and control["layers"] is None
    params = control["trainable_parameters"]
    # Matched to the nearest rank: within one rank step of the new blocks' count.
    step = params["control"] // control["lora_r"]
    assert abs(params["control"] - params["growth"]) <= step / 2
    assert control["units_seen"]["control"] == control["units_seen"]["growth"]
    assert f"LoRA rank {control['lora_r']}" in control["sentence"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--controls", "bogus"], "hf-depthgrow run: --controls must be one of ('auto', 'layers', 'lora') or none, got 'bogus'"),
        (["--retention-data", "nowhere/docs.txt"], "hf-depthgrow run: no such retention data file or folder: nowhere/docs.txt"),
        (["--controls", "layers", "--trainable", "full"],
         "hf-depthgrow run: control 'layers' is matched to the new blocks, so it needs --trainable new (got 'full'); pass control: none"),
    ],
)
def test_bad_control_or_retention_is_one_line(workdir, tmp_path, capsys, extra, message):
    argv = ["run", "--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), "--output-dir", str(tmp_path / "o"), "--no-progress"]
    assert main(argv + extra) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert list(tmp_path.iterdir()) == []


def test_unreadable_retention_set_fails_before_the_probe(workdir, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.pipeline.stages as stages

    (tmp_path / "empty.txt").write_text("")
    monkeypatch.setattr(stages, "_probe", lambda run: pytest.fail("the probe ran before the retention set was read"))
    argv = ["run", "--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), "--output-dir", str(tmp_path / "o"),
            "--retention-data", str(tmp_path / "empty.txt"), "--block-size", "32", "--no-progress"]
    assert main(argv) == 2
    assert "fewer than one block of 32" in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]
