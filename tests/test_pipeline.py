"""`hf-depthgrow run` end to end on a tiny model and a small real text sample (Shakespeare)."""

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
import yaml
from huggingface_hub import ModelCard, constants

from hf_depthgrow.cli.run import main as run_main
from hf_depthgrow.data.sources import load_data, split_dataset
from hf_depthgrow.evaluation.paired import evaluate_delta
from hf_depthgrow.hub.model_card import validate_card_metadata
from hf_depthgrow.pipeline import RunConfig, run_pipeline

from fake_hub import FakeHub
from tiny_lm import make_tiny_lm

TOKEN = "hf_pipeline_test_token"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer trained on a Shakespeare sample, saved to disk."""
    return make_tiny_lm(tmp_path_factory.mktemp("pipeline"))


def _config(workdir, out, **overrides):
    settings = dict(
        model=str(workdir / "tiny"),
        data=str(workdir / "sample.txt"),
        output_dir=str(out),
        block_size=32,
        max_examples=96,
        batch_size=8,
        train_steps=6,
        eval_steps=3,
        stone_max_batches=2,
        learning_rate=3e-3,
        progress=False,
        loss_bound=10.0,
    )
    settings.update(overrides)
    return RunConfig(**settings)


@pytest.fixture(scope="module")
def run(workdir):
    cfg = _config(workdir, workdir / "out")
    return cfg, run_pipeline(cfg, command="hf-depthgrow run (test)")


def test_pipeline_writes_every_artifact(run):
    cfg, result = run
    out = Path(cfg.output_dir)
    for name in [
        "config.yaml",
        "summary.md",
        "summary.json",
        "probe/probe.json",
        "probe/probe.png",
        "stepping_stones.json",
        "train/train_result.json",
        "train/loss.png",
        "eval/report.json",
        "eval/report.md",
        "model/config.json",
        "model/model.safetensors",
        "model/README.md",
        "model/report.json",
        "model/tokenizer.json",
    ]:
        assert (out / name).is_file(), name
    assert not list(out.rglob("*.bin")) and not list(out.rglob("*.pkl"))
    # The resolved config reproduces the run.
    assert RunConfig(**yaml.safe_load((out / "config.yaml").read_text())) == cfg
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decision"] == "grew" and summary["selected"] in ("new", "stepping_stone", "old")
    # sample.txt is one document: every part names it, and the test part's bootstrap resampled blocks
    assert summary["data_parts"] == {"train": {"blocks": 67, "documents": 1}, "held_out": {"blocks": 14, "documents": 1},
                                     "test": {"blocks": 14, "documents": 1, "resampled": "blocks"}}
    assert "| data | Data: train 67 blocks of 1 document;" in (out / "summary.md").read_text()
    probe = json.loads((out / "probe/probe.json").read_text())
    assert probe["positions"] == list(range(5)) and len(probe["signal"]) == 5


def test_saved_model_loads_with_plain_transformers_and_matches(run):
    cfg, result = run
    loaded = transformers.AutoModelForCausalLM.from_pretrained(Path(cfg.output_dir) / "model").eval()
    assert loaded.config.depth_growth["native_indices"] == [summary_k for summary_k in result.summary["positions"]]
    ids = torch.randint(3, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - result.model.eval()(ids).logits).abs().max().item() <= 1e-6


def test_card_renders_with_valid_metadata(run):
    cfg, result = run
    card = ModelCard.load(Path(cfg.output_dir) / "model" / "README.md")
    meta = validate_card_metadata(card)
    assert meta["library_name"] == "transformers"
    assert "hf_depthgrow" in meta["tags"] and "depth-growth" in meta["tags"]
    assert "base_model" not in meta  # a local path is not a Hub id: named in the text instead
    text = card.text
    assert str(result.summary["positions"][0]) in text
    assert "train_steps: 6" in text  # the reproducing config, verbatim


def test_report_numbers_match_the_evaluator(run, workdir):
    cfg, result = run
    report = json.loads((Path(cfg.output_dir) / "eval" / "report.json").read_text())
    # Re-evaluate the saved model on the same test split: the same numbers.
    from hf_depthgrow import load_pretrained
    from hf_depthgrow.hub.loading import load_tokenizer

    model = load_pretrained(Path(cfg.output_dir) / "model").eval()
    tokenizer = load_tokenizer(Path(cfg.output_dir) / "model")
    data = load_data(cfg.data, model=model, tokenizer=tokenizer, block_size=cfg.block_size, max_examples=cfg.max_examples, seed=cfg.seed)
    test = split_dataset(data, {"train": cfg.train_fraction, "held_out": cfg.held_out_fraction, "test": cfg.test_fraction}, seed=cfg.seed)["test"]
    again = evaluate_delta(model, test, delta=cfg.delta, loss_bound=cfg.loss_bound, seed=cfg.seed, batch_size=cfg.batch_size)
    assert report["loss_old"] == pytest.approx(again.loss_old, rel=1e-5)
    assert report["loss_new"] == pytest.approx(again.loss_new, rel=1e-5)
    assert report["delta"] == pytest.approx(again.delta, rel=1e-4, abs=1e-6)
    assert result.summary["test"]["delta"] == pytest.approx(report["delta"], rel=1e-9)
    for name, (low, high) in again.intervals.items():
        assert report["intervals"][name] == pytest.approx([low, high], rel=1e-4, abs=1e-6)


def test_existing_output_folder_is_refused_without_overwrite(run, workdir, capsys):
    cfg, _ = run
    before = sorted(p.name for p in Path(cfg.output_dir).iterdir())
    code = run_main(["--model", cfg.model, "--data", cfg.data, "--output-dir", cfg.output_dir, "--no-progress"])
    assert code == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in Path(cfg.output_dir).iterdir()) == before


def test_unknown_model_id_offline_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code = run_main(["--model", "nobody/no-such-model", "--output-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "could not be loaded from the Hugging Face Hub (HF_HUB_OFFLINE is set)" in err
    assert "Pass a local folder" in err


def test_push_needs_a_repo_id(tmp_path, capsys):
    code = run_main(["--push-to-hub", " ", "--output-dir", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "--push-to-hub needs a repo id" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_yaml_config_with_flag_overrides(tmp_path):
    from hf_depthgrow.cli.run import build_parser

    path = tmp_path / "run.yaml"
    path.write_text("train_steps: 7\nlearning_rate: 0.01\npositions: [1, 2]\n")
    cfg = RunConfig.from_yaml(path, train_steps=9)
    assert (cfg.train_steps, cfg.learning_rate, cfg.positions) == (9, 0.01, [1, 2])
    path.write_text("train_stepz: 7\n")
    with pytest.raises(ValueError, match="unknown key 'train_stepz'; did you mean 'train_steps'"):
        RunConfig.from_yaml(path)
    (cfg,) = build_parser().parse(["--positions", "3", "4", "--no-progress", "--overwrite"])
    assert cfg == RunConfig(positions=[3, 4], progress=False, overwrite=True)
    path.write_text("train_steps: 7\nlearning_rate: 0.01\n")
    (cfg,) = build_parser().parse(["--config", str(path), "--max-steps", "9"])
    assert (cfg.train_steps, cfg.learning_rate) == (9, 0.01)
    with pytest.warns(FutureWarning, match="--train-steps is deprecated, use --max-steps"):
        (cfg,) = build_parser().parse(["--train-steps", "5"])
    assert cfg.train_steps == 5


def test_pipeline_pushes_every_file_to_the_hub(workdir, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    huggingface_hub.close_session()
    with FakeHub() as hub:
        cfg = _config(workdir, tmp_path / "o", positions=[2], train_steps=2, push_to_hub="me/grown-tiny", hub_endpoint=hub.endpoint)
        result = run_pipeline(cfg)
        files = hub.files("me/grown-tiny")
    huggingface_hub.close_session()
    model_dir = Path(cfg.output_dir) / "model"
    on_disk = {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in model_dir.rglob("*") if p.is_file()}
    assert files == on_disk
    assert TOKEN in hub.tokens()
    assert result.summary["pushed"]


def test_outputs_name_no_local_absolute_path(run, workdir):
    """Card, summary and reports name inputs by Hub id or folder name, never by a path on this machine."""
    cfg, result = run
    out = Path(cfg.output_dir)
    assert (out / ".hf_depthgrow_run").is_file()
    assert result.summary["base_model"] == "./tiny" and result.summary["artifacts"]["model"] == "model"
    # train/train_config.json is the trainer's local reproduction config, as config.yaml is the run's.
    texts = [p for p in out.rglob("*") if p.suffix in (".md", ".json") and p.name != "train_config.json"]
    assert len(texts) >= 6 and [p.relative_to(out).as_posix() for p in texts if str(workdir) in p.read_text()] == []


def test_failed_run_leaves_the_old_output_untouched(workdir, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.pipeline.stages as stages

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    (out / ".hf_depthgrow_run").write_text("hf_depthgrow\n")
    (out / "summary.json").write_text("{}")

    def boom(run):
        raise ValueError("probe exploded")

    monkeypatch.setattr(stages, "_probe", boom)
    code = run_main(["--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), "--output-dir", "o", "--overwrite", "--no-progress"])
    err = capsys.readouterr().err  # transformers' progress bars come first
    assert code == 2 and err.strip().splitlines()[-1] == "hf-depthgrow run: probe exploded" and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temp folder left behind
    assert sorted(p.name for p in out.iterdir()) == [".hf_depthgrow_run", "summary.json"]


def test_overwrite_replaces_a_folder_this_tool_wrote(workdir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / ".hf_depthgrow_run").write_text("hf_depthgrow\n")
    (out / "stale.txt").write_text("old run")
    run_pipeline(_config(workdir, out, positions=[2], train_steps=1, overwrite=True))
    assert not (out / "stale.txt").exists() and (out / "summary.json").is_file() and (out / ".hf_depthgrow_run").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_push_prerequisites_are_checked_before_the_run(workdir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), "--output-dir", str(tmp_path / "o"), "--push-to-hub", "me/x"]
    assert run_main(argv) == 2
    assert capsys.readouterr().err.strip() == "hf-depthgrow run: cannot push to me/x: HF_HUB_OFFLINE is set"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert run_main(argv) == 2
    assert capsys.readouterr().err.strip() == "hf-depthgrow run: cannot push to me/x: no Hugging Face token (set HF_TOKEN or run `hf auth login`)"
    assert list(tmp_path.iterdir()) == []


def test_push_failure_keeps_the_run_and_says_so(workdir, tmp_path, monkeypatch, capsys):
    import hf_depthgrow.hub.push as push
    import hf_depthgrow.pipeline.stages as stages

    monkeypatch.setattr(stages, "check_run", lambda cfg: None)  # the Hub passes the up-front check, then fails

    def refuse(*args, **kwargs):
        raise OSError("503 Service Unavailable")

    monkeypatch.setattr(push, "push_to_hub", refuse)
    out = tmp_path / "o"
    argv = ["--model", str(workdir / "tiny"), "--data", str(workdir / "sample.txt"), "--output-dir", str(out), "--positions", "2",
            "--max-steps", "1", "--block-size", "32", "--max-examples", "96", "--push-to-hub", "me/x", "--no-progress"]
    assert run_main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-depthgrow run: the run finished and its outputs and summary are in {out}, but pushing to me/x failed: 503 Service Unavailable"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["push_error"] == "503 Service Unavailable" and (out / "model" / "model.safetensors").is_file()


def test_population_stone_is_measured_then_freed_before_training(workdir, tmp_path, monkeypatch):
    # f~_pop is a whole copy of the model and only Delta_R needs it: it must not be held through training.
    import gc
    import importlib
    import weakref

    # By module path: `hf_depthgrow.probe.stepping_stone` the attribute is the function of that name.
    stone_module = importlib.import_module("hf_depthgrow.probe.stepping_stone")
    trainer_module = importlib.import_module("hf_depthgrow.training.trainer")

    seen = {}
    real_stones, real_train = stone_module.stepping_stones, trainer_module.train

    def stones(model, k, train, held_out, **kwargs):
        made = real_stones(model, k, train, held_out, **kwargs)
        pop = made["held_out"][0]
        seen["pop"] = weakref.ref(pop)
        seen["delta_r"] = evaluate_delta(pop, held_out, metrics=False, n_bootstrap=1, batch_size=kwargs["batch_size"]).mean_delta
        return made

    def train(*args, **kwargs):
        gc.collect()
        seen["alive_in_training"] = seen["pop"]() is not None
        return real_train(*args, **kwargs)

    monkeypatch.setattr(stone_module, "stepping_stones", stones)
    monkeypatch.setattr(trainer_module, "train", train)
    cfg = _config(workdir, tmp_path / "out", control=None)
    run_pipeline(cfg)
    assert seen["alive_in_training"] is False
    report = json.loads((tmp_path / "out" / "eval" / "report.json").read_text())
    terms = report["routes"]["terms"]
    assert terms["delta_r"] == pytest.approx(seen["delta_r"], rel=1e-9, abs=1e-12)
    assert terms["sources"]["delta_r"].startswith("measured here")


def test_summary_names_the_placement_policy_and_its_track_record(run):
    from hf_depthgrow.probe.placement_policy import DEFAULT_PLACEMENT, track_record_line

    cfg, result = run
    assert result.summary["placement_policy"]["policy"] == DEFAULT_PLACEMENT
    assert result.summary["probe"]["recommendation"]["policy"] == DEFAULT_PLACEMENT
    assert f"| placement policy | {track_record_line()} |" in (Path(cfg.output_dir) / "summary.md").read_text()
