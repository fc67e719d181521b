"""Arms at an equal budget (exactly matched controls), corrected paired statistics, retention, the CLI."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.comparison import CompareConfig, build_arms, compare_plans, lora_rank_for, matched_layers, resolve_growth
from hf_depthgrow.comparison.arms import as_plan
from hf_depthgrow.comparison.result import ArmResult, CompareResult
from hf_depthgrow.growth.placement import resolve_positions
from hf_depthgrow.testing import tiny_inputs, tiny_model
from hf_depthgrow.training import train
from hf_depthgrow.training.trainable import layer_parameters

NATIVE = ["llama", "qwen2", "mistral", "gemma"]


def lm_rows(model, n: int, seed: int, seq: int = 12) -> list[dict]:
    batch = tiny_inputs(model, batch=n, seq=seq, seed=seed)
    batch["labels"] = batch["input_ids"].clone()
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


# --------------------------------------------------------------------------- arms


@pytest.mark.parametrize("family", NATIVE)
@pytest.mark.parametrize("spec", ["top:1", "at:2", "interleave:2", "bottom:1", [{"at": 3, "copy_from": 0}]])
def test_layers_control_matches_the_growth_arm_exactly(family, spec):
    model = tiny_model(family)
    arms = {a.name: a for a in build_arms(model, [spec], ["layers"])}
    growth = next(a for a in arms.values() if a.kind == "growth")
    grown = grow_depth(copy.deepcopy(model), as_plan(growth.placement))
    added = sum(p.numel() for _, p in new_block_parameters(grown))
    control = sum(p.numel() for _, p in layer_parameters(model, arms["layers"].layers))
    assert growth.trainable_parameters == added == control == arms["layers"].trainable_parameters
    assert arms["layers"].matched_to == growth.name


def test_matched_layers_are_the_sources_and_stay_distinct():
    assert matched_layers(resolve_positions([2, 4], 4), 4) == [1, 3]
    assert matched_layers(resolve_positions([0], 4), 4) == [0]  # k = 0 copies layer 0
    # Two blocks copying layer 3: the second trains the next free layer below.
    assert matched_layers(resolve_positions("top:2", 4), 4) == [2, 3]


def test_lora_rank_is_the_closest_match():
    model = tiny_model("llama")
    rank, count = lora_rank_for(model, 9280)
    per_rank = count // rank
    assert abs(count - 9280) <= per_rank / 2
    assert all(abs(r * per_rank - 9280) >= abs(count - 9280) for r in range(1, 20))


def test_random_arms_are_seeded_and_bottom_and_at_resolve():
    assert [e.at for e in resolve_growth("random:2", 30, seed=1)] == [e.at for e in resolve_growth("random:2", 30, seed=1)]
    draws = {tuple(e.at for e in resolve_growth("random:2", 30, seed=s)) for s in range(6)}
    assert len(draws) > 1
    assert [e.at for e in resolve_growth("bottom:2", 4)] == [0, 1]
    assert [e.at for e in resolve_growth("at:1,3", 4)] == [1, 3]


@pytest.mark.parametrize(
    "growth, controls, message",
    [
        ([], ["layers"], "at least one growth arm"),
        (["top:1"], ["dropout"], "unknown control arm 'dropout'"),
        (["top:1", "top:1"], ["layers"], "arm names must be unique"),
        (["random:9"], [], "random:N needs 1 <= N <= 4"),
        (["at:x"], [], "at: takes comma-separated layer positions"),
    ],
)
def test_bad_arms_are_refused(growth, controls, message):
    with pytest.raises(ValueError, match=None) as err:
        build_arms(tiny_model("llama"), growth, controls)
    assert message in str(err.value)


# --------------------------------------------------------------------------- training modes of the controls


def test_layers_mode_trains_only_those_layers_and_caches_below():
    model = tiny_model("llama")
    rows = lm_rows(model, 16, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(trainable="layers", trainable_layers=[2], max_steps=3, learning_rate=1e-2, progress_bar=False, fallback=False)
    cached = train(copy.deepcopy(model), rows, prefix_cache="memory", **kw)
    plain = train(copy.deepcopy(model), rows, prefix_cache="off", **kw)
    changed = {n for n, p in cached.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("model.layers.2.") for n in changed)
    assert cached.prefix_cache["index"] == 2 and plain.prefix_cache is None
    for (n, a), (_, b) in zip(cached.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)  # the cache changes speed, not the result


def test_lora_mode_merges_into_the_base_and_keeps_its_shape():
    model = tiny_model("llama")
    result = train(copy.deepcopy(model), lm_rows(model, 16, 0), trainable="lora", lora_r=2, max_steps=3,
                   learning_rate=1e-2, progress_bar=False, fallback=False)
    names = {n for n, _ in result.model.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # merged and unloaded: a plain model again
    _, per_rank = lora_rank_for(model, 1)  # rank 1: the parameters one rank adds
    assert result.num_trainable_parameters == 2 * per_rank


def test_control_modes_refuse_grown_models_and_bad_layers():
    model = tiny_model("llama")
    rows = lm_rows(model, 8, 0)
    with pytest.raises(ValueError, match="adds no depth"):
        train(grow_depth(copy.deepcopy(model), [2]), rows, trainable="layers", trainable_layers=[1], max_steps=1)
    with pytest.raises(ValueError, match="out of range"):
        train(copy.deepcopy(model), rows, trainable="layers", trainable_layers=[7], max_steps=1)
    with pytest.raises(ValueError, match="trainable_layers is only used"):
        train(copy.deepcopy(model), rows, trainable="full", trainable_layers=[1], max_steps=1)


# --------------------------------------------------------------------------- compare_plans end to end


@pytest.fixture(scope="module")
def compared():
    model = tiny_model("llama")
    data = {name: lm_rows(model, n, seed) for name, n, seed in (("train", 32, 0), ("eval", 16, 1), ("test", 24, 2), ("ret", 16, 3))}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = compare_plans(
        model, data["train"], data["eval"], data["test"], retention_data=data["ret"],
        growth=["top:1", "at:2", "bottom:1"], controls=["layers", "lora"], learning_rates=[1e-3, 5e-3],
        max_steps=6, progress=False, n_bootstrap=300, successive_halving=True, lr_extensions=0, allow_repeated_data=True,
        forgetting_rates=0,  # the two-rate grid halving is checked on (the rates below it: tests/test_curve_against_curve.py)
    )
    return model, data, before, result


def test_compare_leaves_the_base_unchanged_and_spends_an_equal_budget(compared):
    model, _, before, result = compared
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    trained = [a for a in result.arms if a.kind != "original"]
    assert [a.name for a in result.arms] == ["original", "top:1", "at:2", "bottom:1", "layers", "lora"]
    assert len({a.units_seen for a in trained}) == 1 and trained[0].units_seen == 6 * 8 * 12
    for arm in trained:  # successive halving: one rate stops at 1/4 of the steps, the better one on held-out goes on
        assert set(arm.tried) == {1e-3, 5e-3}
        stopped = [lr for lr, t in arm.tried.items() if t["stopped_at"] < 6]
        assert len(stopped) == 1 and arm.tried[stopped[0]]["stopped_at"] == 2  # round(0.25 * 6)
        assert arm.tried[arm.learning_rate]["stopped_at"] == 6
    assert result.arm("layers").trainable_parameters == result.arm("at:2").trainable_parameters


def test_successive_halving_keeps_the_run_it_would_have_trained_alone():
    """The survivor of halving is bit-identical to training that rate alone (same schedule, same data order)."""
    model = tiny_model("llama")
    rows = {name: lm_rows(model, n, seed) for name, n, seed in (("train", 24, 0), ("eval", 8, 1), ("test", 8, 2))}
    kw = dict(growth=["at:2"], controls=[], max_steps=8, progress=False, n_bootstrap=100, lr_extensions=0, allow_repeated_data=True)
    halved = compare_plans(model, rows["train"], rows["eval"], rows["test"], learning_rates=[1e-4, 5e-3], successive_halving=True, **kw)
    chosen = halved.arm("at:2").learning_rate
    alone = compare_plans(model, rows["train"], rows["eval"], rows["test"], learning_rates=[chosen], **kw)
    np.testing.assert_array_equal(halved.arm("at:2").test_per_example, alone.arm("at:2").test_per_example)
    full = compare_plans(model, rows["train"], rows["eval"], rows["test"], learning_rates=[1e-4, 5e-3], successive_halving=False, **kw)
    assert all(t["stopped_at"] == 8 for t in full.arm("at:2").tried.values())
    assert full.arm("at:2").learning_rate == min(full.arm("at:2").tried, key=lambda lr: full.arm("at:2").tried[lr]["heldout_loss"])


def test_compare_statistics_are_paired_against_the_same_examples(compared):
    model, data, _, result = compared
    from hf_depthgrow.comparison import example_losses

    per, weight = example_losses(model, data["test"], 8)
    original = result.arm("original")
    np.testing.assert_array_equal(original.test_per_example, per)
    stats = result.statistics
    for arm in result.arms[1:]:
        row = stats["vs_original"]["arms"][arm.name]
        assert row["mean"] == pytest.approx(float(np.mean(per - arm.test_per_example)), abs=1e-12)
        assert row["low"] <= row["mean"] <= row["high"]
    assert stats["vs_original"]["level"] == pytest.approx(0.05 / 5)  # five trained arms
    best = stats["best_control"]
    assert best == min(("layers", "lora"), key=lambda n: result.arm(n).heldout_loss)
    assert set(stats["vs_best_control"]["arms"]) == {"top:1", "at:2", "bottom:1"}
    for name in ("top:1", "at:2", "bottom:1"):
        expected = np.mean(result.arm(best).test_per_example - result.arm(name).test_per_example)
        assert stats["vs_best_control"]["arms"][name]["mean"] == pytest.approx(float(expected), abs=1e-12)


def test_retention_is_wired_for_every_arm(compared):
    model, data, _, result = compared
    from hf_depthgrow.comparison import example_losses

    from hf_depthgrow.comparison.aggregate import retention_parts

    per, _ = example_losses(model, data["ret"], 8)
    selection, test = retention_parts(len(per), 0.5, 0)  # the test part is reported; the selection part chooses
    retention = result.statistics["retention"]["arms"]
    assert set(retention) == {a.name for a in result.arms[1:]}
    for arm in result.arms[1:]:
        assert retention[arm.name]["mean"] == pytest.approx(float(np.mean(per[test] - arm.retention_per_example)), abs=1e-12)
        assert len(arm.retention_selection) == len(selection)
    assert "forgetting" in result.to_markdown()


def test_compare_writes_json_markdown_and_plot(compared, tmp_path):
    *_, result = compared
    paths = result.save(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["verdict"] == result.verdict and len(saved["rows"]) == 6
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    assert "| layers | layers |" in (tmp_path / "out" / "compare.md").read_text()
    assert set(paths) == {"json", "markdown", "plot", "frontier_plot"}  # with a retention set: the gain x forgetting plane
    assert (tmp_path / "out" / "compare_frontier.png").stat().st_size > 10_000


def _result_with(stats_vs_control: dict) -> CompareResult:
    arms = [ArmResult(name=n, kind=k, arm={}, heldout_loss=h) for n, k, h in
            (("original", "original", 3.0), ("g1", "growth", 2.0), ("g2", "growth", 2.1), ("layers", "layers", 2.05))]
    stats = {
        "vs_original": {"delta": 0.05, "method": "holm", "arms": {}},
        "vs_best_control": {"method": "holm", "certified": stats_vs_control["certified"], "worse": stats_vs_control["worse"],
                            "arms": {"g1": {"mean": 0.2, "low": 0.1, "high": 0.3}, "g2": {"mean": -0.1, "low": -0.2, "high": 0.0}}},
        "best_control": "layers", "best_growth": "g1",
    }
    return CompareResult(arms=arms, config={}, statistics=stats)


def test_verdict_says_plainly_when_growth_did_not_win():
    assert _result_with({"certified": ["g1"], "worse": []}).verdict.startswith("growth beat the best control (layers): g1 by 0.2 [0.1, 0.3]")
    lost = _result_with({"certified": [], "worse": []}).verdict
    assert lost.startswith("growth did NOT beat the best control (layers)") and "g1" in lost


def test_config_is_validated_before_any_work():
    for bad, message in (({"learning_rates": []}, "learning_rates"), ({"max_steps": 0}, "max_steps"),
                         ({"interval": "bernstein"}, "needs loss_bound"), ({"controls": ["x"]}, "unknown control")):
        with pytest.raises(ValueError, match=message):
            CompareConfig(**bad)


def test_bad_test_data_fails_before_training(monkeypatch):
    import hf_depthgrow.training.trainer as trainer

    model = tiny_model("llama")
    rows = lm_rows(model, 8, 0)
    bad = lm_rows(model, 4, 1)
    bad[0]["input_ids"] = bad[0]["input_ids"] + 10_000  # ids the model cannot embed
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("trained before the data was checked"))
    with pytest.raises(ValueError, match="test_data"):
        compare_plans(model, rows, rows, bad, growth=["top:1"], controls=[], max_steps=1, progress=False)


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from tiny_lm import make_tiny_lm

    return make_tiny_lm(tmp_path_factory.mktemp("compare"), max_chars=30_000)


def _argv(lm_dir, out, *extra):
    return ["compare", "--model", str(lm_dir / "tiny"), "--data", str(lm_dir / "sample.txt"), "--output-dir", str(out),
            "--block-size", "16", "--max-examples", "64", "--max-steps", "2", "--learning-rates", "3e-3",
            "--n-bootstrap", "200", "--no-progress", *extra]


def test_cli_bad_arm_is_one_line_and_writes_nothing(lm_dir, tmp_path, capsys):
    from hf_depthgrow.cli import main

    out = tmp_path / "out"
    assert main(_argv(lm_dir, out, "--growth", "middle:1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-depthgrow compare: ") and "\n" not in err and "middle:1" in err
    assert not out.exists()
    assert main(_argv(lm_dir, out, "--controls", "dropout")) == 2
    assert "unknown control arm 'dropout'" in capsys.readouterr().err
    assert main(_argv(lm_dir, out, "--oracle-positions", "0", "1", "1")) == 2
    assert "--oracle-positions needs at least 4 distinct positions" in capsys.readouterr().err
    assert main(_argv(lm_dir, out, "--oracle-positions", "0", "1", "2", "9")) == 2  # the tiny Llama has 4 layers
    assert "the model has 4 layers" in capsys.readouterr().err and not out.exists()


def test_cli_compares_and_validates_the_probe(lm_dir, tmp_path, capsys):
    from hf_depthgrow.cli import main

    out = tmp_path / "out"
    argv = _argv(lm_dir, out, "--growth", "top:1", "bottom:1", "--controls", "layers", "--retention-data", str(lm_dir / "sample.txt"),
                 "--retention-max-examples", "16", "--oracle-positions", "0", "1", "3", "4", "--oracle-seeds", "0", "1")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Comparison at an equal budget" in printed and "Probe validation" in printed
    saved = json.loads((out / "compare.json").read_text())
    assert [r["arm"] for r in saved["rows"]] == ["original", "top:1", "bottom:1", "layers"]
    assert saved["num_examples"]["retention"] == 16
    validation = json.loads((out / "probe_validation.json").read_text())
    assert validation["positions"] == [0, 1, 3, 4] and set(validation["realized_by_seed"]) == {"0", "1"}
    predictors = {row["predictor"] for row in validation["table"]}
    assert {"signal", "z", "gradient_norm", "block_influence", "depth", "lookahead", "random", "bottom"} <= predictors
    assert str(tmp_path) not in (out / "compare.md").read_text()  # no local paths in reports
    assert (out / ".hf_depthgrow_run").is_file()


def test_classifier_retention_is_labelled_with_the_originals_decisions(lm_dir):
    from transformers import AutoTokenizer

    from hf_depthgrow.data.pseudo_labels import paragraphs, pseudo_labelled

    assert paragraphs(["short\n\n" + "a b c d e f g h i j k l", "x y"]) == ["a b c d e f g h i j k l"]
    tok = AutoTokenizer.from_pretrained(lm_dir / "tiny")
    model = tiny_model("bert", vocab_size=len(tok))
    model.train()
    texts = [(lm_dir / "sample.txt").read_text()]
    ds = pseudo_labelled(model, tok, texts, block_size=16, max_examples=12, seed=0)
    assert len(ds) == 12 and model.training  # the caller's mode is restored
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ds[:]["input_ids"], attention_mask=ds[:]["attention_mask"]).logits
    assert ds[:]["labels"].tolist() == logits.argmax(-1).tolist()


def test_an_arm_that_fell_back_to_the_original_is_not_the_best_growth_arm():
    from hf_depthgrow.comparison.aggregate import statistics

    rng = np.random.default_rng(0)
    base = rng.normal(3.0, 0.1, 20)
    original = ArmResult(name="original", kind="original", arm={}, test_per_example=base)

    def arm(name, kind, selected, heldout, gain):
        return ArmResult(name=name, kind=kind, arm={}, selected=selected, heldout_loss=heldout, test_per_example=base - gain)

    # As on MiniLM: the arm that fell back ties with the original and sits a rounding below the trained one.
    results = [arm("fell_back", "growth", "old", 0.83327255507, 0.0), arm("trained", "growth", "new", 0.83327255567, 0.01),
               arm("lora", "lora", "new", 0.9, 0.005)]
    stats = statistics(results, original, CompareConfig(growth=["top:1"], controls=["lora"]))
    assert stats["best_growth"] == "trained" and stats["best_control"] == "lora"
    everything_fell_back = [arm("a", "growth", "old", 0.8, 0.0), arm("b", "growth", "old", 0.7, 0.0)]
    assert statistics(everything_fell_back, original, CompareConfig(growth=["top:1"], controls=[]))["best_growth"] == "b"


def _folder(root, text: str, n: int):
    root.mkdir()
    step = len(text) // n
    for i in range(n):
        (root / f"doc{i}.txt").write_text(text[i * step : (i + 1) * step])
    return root


def test_retention_parts_are_disjoint_documents():
    from hf_depthgrow.comparison.aggregate import retention_parts

    docs = [d for d in range(12) for _ in range(3)]
    selection, test = retention_parts(len(docs), 0.5, seed=0, documents=docs)
    assert {docs[i] for i in selection}.isdisjoint({docs[i] for i in test})
    assert len(selection) + len(test) == len(docs) and len(selection) == 18
    with pytest.raises(ValueError, match="the retention set has 1 document"):
        retention_parts(6, 0.5, seed=0, documents=[4] * 6)


def test_cli_reports_documents_per_part_and_resamples_them(lm_dir, tmp_path, capsys):
    from hf_depthgrow.cli import main

    text = (lm_dir / "sample.txt").read_text()
    data, retention = _folder(tmp_path / "data", text[: len(text) // 2], 8), _folder(tmp_path / "ret", text[len(text) // 2 :], 6)
    out = tmp_path / "out"
    argv = _argv(lm_dir, out, "--growth", "top:1", "--controls", "layers", "--retention-data", str(retention),
                 "--retention-max-examples", "24", "--retention-blocks-per-document", "4", "--blocks-per-document", "8",
                 "--split-by", "document")
    argv[argv.index("--data") + 1] = str(data)
    assert main(argv) == 0
    saved = json.loads((out / "compare.json").read_text())
    parts = saved["data_parts"]
    assert {k: p["blocks"] for k, p in parts.items()} == {"train": 40, "heldout": 8, "test": 16, "retention_selection": 12, "retention_test": 12}
    assert {k: p["documents"] for k, p in parts.items()} == {"train": 5, "heldout": 1, "test": 2, "retention_selection": 3, "retention_test": 3}
    assert parts["test"]["resampled"] == parts["retention_test"]["resampled"] == "documents"
    report = (out / "compare.md").read_text()
    assert "retention selection 12 blocks of 3 documents; retention test 12 blocks of 3 documents" in report
    assert "for a document-level interval to stand for the domain on test (2), retention selection (3), retention test (3):" in report
    assert saved["config"]["cluster_key"] == "auto"


def test_data_parts_text_says_when_a_part_has_too_few_documents_to_resample():
    from hf_depthgrow.evaluation.formatting import FEW_DOCUMENTS, data_parts_text

    few = {"test": {"blocks": 80, "documents": FEW_DOCUMENTS - 1, "resampled": "documents"}}
    enough = {"test": {"blocks": 80, "documents": FEW_DOCUMENTS, "resampled": "documents"},
              "train": {"blocks": 80, "documents": 2}}  # train is never resampled: its count is no warning
    assert f"Too few documents for a document-level interval to stand for the domain on test ({FEW_DOCUMENTS - 1})" in data_parts_text(few)
    assert "Too few" not in data_parts_text(enough)


def test_cli_refuses_a_cluster_key_the_data_lacks(lm_dir, tmp_path, capsys):
    from hf_depthgrow.cli import main

    out = tmp_path / "out"
    assert main(_argv(lm_dir, out, "--growth", "top:1", "--controls", "layers", "--cluster-key", "page")) == 2
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "hf-depthgrow" in line]
    assert len(err) == 1 and "cluster_key 'page' is not a column of the test data" in err[0]
    assert not out.exists()
