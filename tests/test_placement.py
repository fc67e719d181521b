"""Placement presets, plans and mergekit passthrough configs: resolved positions, exactness, refusals, records."""

import copy
import json
import math

import pytest
import torch
import yaml

from hf_depthgrow import grow_depth, growth_record
from hf_depthgrow.cli import main
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.growth.placement import PlacementEntry, resolve_positions
from hf_depthgrow.growth.record import GrowthRecord
from hf_depthgrow.pipeline.config import RunConfig
from hf_depthgrow.testing import model_output, tiny_inputs, tiny_model


def positions(spec, num_layers, **kwargs):
    return [e.at for e in resolve_positions(spec, num_layers, **kwargs)]


class FakeProbe:
    """What `probe:N` reads from a `ProbeResult`."""

    def __init__(self, z, num_layers=4):
        self.positions, self.z, self.num_layers = list(range(len(z))), z, num_layers


# ------------------------------------------------------------------ presets


def test_interleave_spreads_distinct_positions_for_any_depth():
    got = positions("interleave:8", 30)
    assert got == [4, 8, 11, 15, 19, 23, 26, 30]
    assert len(set(got)) == 8 and got[-1] == 30
    gaps = [b - a for a, b in zip([0, *got], got)]
    assert set(gaps) <= {3, 4}  # 30 / 8 = 3.75: as even as integers allow


@pytest.mark.parametrize("num_layers, n", [(32, 8), (24, 4), (4, 2), (6, 6), (30, 1)])
def test_interleave_is_llama_pro_when_divisible(num_layers, n):
    # LLaMA Pro: a block after every L/N original layers, the last one at the top.
    step = num_layers // n
    assert positions(f"interleave:{n}", num_layers) == [step * (j + 1) for j in range(n)]


@pytest.mark.parametrize("num_layers, n", [(7, 3), (5, 2), (13, 5), (30, 7)])
def test_interleave_rule_non_divisible(num_layers, n):
    want = [math.floor((j + 1) * num_layers / n + 0.5) for j in range(n)]
    assert positions(f"interleave:{n}", num_layers) == want
    assert len(set(want)) == n


def test_top_and_probe_presets():
    assert positions("top:3", 5) == [5, 5, 5]
    probe = FakeProbe([0.1, 2.0, float("nan"), 3.0, 2.0])
    assert positions("probe:2", 4, probe_result=probe) == [1, 3]
    assert positions("probe:3", 4, probe_result=probe) == [1, 3, 4]  # ties: the lower position first


def test_explicit_positions_resolve_as_before():
    assert resolve_positions([3, 0, 3], 4) == [PlacementEntry(0), PlacementEntry(3), PlacementEntry(3)]


# ------------------------------------------------------------------ plans and exactness


def _grow_exact(model_type, spec, **kwargs):
    model = tiny_model(model_type)
    original = copy.deepcopy(model)
    inputs = tiny_inputs(model)
    with torch.no_grad():
        before = model_output(model, inputs)
    grow_depth(model, spec, **kwargs)
    with torch.no_grad():
        assert (model_output(model, inputs) - before).abs().max().item() <= 1e-6
    return original, model


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_plan_copies_a_far_layer_exactly(model_type):
    original, model = _grow_exact(model_type, [{"at": 4, "copy_from": 0}, {"at": 1, "copy_from": 3, "init": "copy"}], block="native")
    spec, _, _ = resolve_family(model)
    _, stack, _ = resolve_family(model)
    _, old_stack, _ = resolve_family(original)
    # Grown order: 0, [copy of 3], 1, 2, 3, [copy of 0].
    for new_index, source in ((1, 3), (5, 0)):
        zeroed = {f"{name}." for name in spec.residual_outputs}
        got, want = stack[new_index].state_dict(), old_stack[source].state_dict()
        assert got.keys() == want.keys()
        for name, value in got.items():
            if any(name.startswith(z) for z in zeroed):
                assert not value.any(), name
            else:
                assert torch.equal(value, want[name]), name
    layer_types = getattr(original.config, "layer_types", None)
    if layer_types:  # a copy carries its source's per-layer config entry
        assert model.config.layer_types[1] == layer_types[3] and model.config.layer_types[5] == layer_types[0]


@pytest.mark.parametrize("spec", ["interleave:2", "top:2", {"plan": [{"at": 2}, {"at": 2, "init": "random"}]}])
def test_presets_and_plans_grow_exactly(spec):
    _, model = _grow_exact("llama", spec, block="native")
    assert model.config.num_hidden_layers == 6


MERGEKIT = """
slices:
  - sources:
      - model: my/model
        layer_range: [0, 3]
  - sources:
      - model: my/model
        layer_range: [1, 4]
merge_method: passthrough
dtype: float32
"""


def test_mergekit_passthrough_is_the_equivalent_plan():
    config = yaml.safe_load(MERGEKIT)
    # 0 1 2 | 1 2 3: originals 0 1 2, then copies of 1 and 2 before original layer 3.
    plan = [{"at": 3, "copy_from": 1}, {"at": 3, "copy_from": 2}]
    assert resolve_positions(config, 4) == resolve_positions(plan, 4)
    original, model = _grow_exact("llama", config, block="native")
    _, stack, _ = resolve_family(model)
    _, old_stack, _ = resolve_family(original)
    assert torch.equal(stack[3].input_layernorm.weight, old_stack[1].input_layernorm.weight)
    assert torch.equal(stack[4].self_attn.q_proj.weight, old_stack[2].self_attn.q_proj.weight)


# ------------------------------------------------------------------ refusals


def fingerprint(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, model.config.to_json_string()


MERGE = {"models": [{"model": "a"}, {"model": "b"}], "merge_method": "ties"}
TWO_MODELS = {"slices": [{"sources": [{"model": "a", "layer_range": [0, 4]}]}, {"sources": [{"model": "b", "layer_range": [3, 4]}]}]}
SPLIT_SOURCES = {"slices": [{"sources": [{"model": "a", "layer_range": [0, 4]}, {"model": "a", "layer_range": [0, 4]}]}]}
RANGE = "placement '{p}:{n}': N must be in 1..4 (at most one new block per original layer, doubling the depth of this 4-layer model); grow again for more."
REFUSALS = [
    ("N=0", "interleave:0", {}, RANGE.format(p="interleave", n=0)),
    ("N too large", "top:5", {}, RANGE.format(p="top", n=5)),
    ("N not an int", "top:two", {}, "placement 'top:two': N must be an integer, got 'two'"),
    ("unknown preset", "every:2", {}, "unknown placement 'every:2': use 'interleave:N', 'top:N', 'probe:N', a list of positions, "
     "a plan (a list of {'at': k, 'copy_from': j}) or a YAML file holding one."),
    ("probe without result", "probe:2", {}, "placement 'probe:2' needs the probe's result: pass probe_result=probe(model, data) to grow_depth "
     "(grow_depth does not run the probe itself)."),
    ("probe of other depth", "probe:1", {"probe_result": FakeProbe([1.0] * 7, num_layers=6)},
     "probe_result was measured on 6 layers, but the model has 4: probe it again."),
    ("plan entry without at", [{"copy_from": 1}], {}, "plan entry 0 must be a dict with at least 'at', got {'copy_from': 1}"),
    ("plan unknown key", [{"at": 1, "from": 0}], {}, "plan entry 0: unknown keys ['from']; an entry holds ['at', 'copy_from', 'init']"),
    ("plan empty", {"plan": []}, {}, "a plan must be a non-empty list of {'at': k, 'copy_from': j} entries, got []"),
    ("copy_from out of range", [{"at": 1, "copy_from": 4}], {}, "plan entry 0: copy_from must be an int in 0..3 for this 4-layer model, got 4"),
    ("at out of range", [{"at": 5}], {}, "plan entry 0: at must be an int in 0..4 for this 4-layer model, got 5"),
    ("bad init", [{"at": 1, "init": "zeros"}], {}, "plan entry 0: init must be one of ('copy', 'random'), got 'zeros'"),
    ("copy_from on adapters", [{"at": 1, "copy_from": 0}], {"block": "adapter"},
     "plan entry PlacementEntry(at=1, copy_from=0, init=None) sets copy_from or init, which only native blocks have; this growth "
     "builds adapter blocks (use block='native' on a pre-norm family, or drop copy_from/init)."),
    ("mergekit merge", MERGE, {}, "this mergekit config merges weights (merge_method 'ties', models:): only a passthrough config "
     "that duplicates layers of one model can be grown exactly."),
    ("mergekit two models", TWO_MODELS, {}, "this mergekit config uses several models (['a', 'b']): only layers of the model being grown can be copied"),
    ("mergekit two sources", SPLIT_SOURCES, {}, f"mergekit slice 0 must have exactly one source (several sources merge weights), got {SPLIT_SOURCES['slices'][0]!r}"),
    ("mergekit drops a layer", {"slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}]}, {"sources": [{"model": "a", "layer_range": [3, 4]}]}]}, {},
     "mergekit config drops or reorders original layers (layer 2 is missing after the layers before it): only configs that keep "
     "every layer in order and duplicate some can be grown exactly."),
]


@pytest.mark.parametrize("spec, kwargs, message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_placement_is_refused_and_model_untouched(spec, kwargs, message):
    model = tiny_model("llama")
    state, config = fingerprint(model)
    with pytest.raises(ValueError) as caught:
        grow_depth(model, spec, **kwargs)
    assert str(caught.value) == message
    after_state, after_config = fingerprint(model)
    assert after_config == config and after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in state.items())


# ------------------------------------------------------------------ record, CLI, RunConfig


def test_record_round_trip_keeps_spec_and_sources():
    model = tiny_model("llama")
    grow_depth(model, [{"at": 4, "copy_from": 0}, {"at": 2}], block="native")
    grow_depth(model, "top:1", block="native")
    record = growth_record(model)
    first, second = (step.config["placement"] for step in record.history)
    assert first == {"spec": [{"at": 4, "copy_from": 0}, {"at": 2}], "positions": [2, 4], "copy_from": [1, 0], "init": [None, None]}
    assert second["spec"] == "top:1" and second["positions"] == [6] and second["copy_from"] == [5]
    assert GrowthRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def test_explicit_positions_record_is_unchanged():
    model = tiny_model("llama")
    grow_depth(model, [2], block="native")
    assert "placement" not in growth_record(model).history[0].config


def test_cli_accepts_a_preset_and_a_plan(tmp_path, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    assert main(["grow", str(tmp_path / "m"), "--positions", "interleave:2", "--block", "native", "--out", str(tmp_path / "g")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["native_indices"] == [2, 5] and record["history"][0]["config"]["placement"]["spec"] == "interleave:2"
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan:\n  - {at: 4, copy_from: 0}\n")
    assert main(["grow", str(tmp_path / "m"), "--plan", str(plan), "--block", "native", "--out", str(tmp_path / "p")]) == 0
    assert json.loads(capsys.readouterr().out)["native_indices"] == [4]
    assert main(["grow", str(tmp_path / "m"), "--positions", "every:2", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("hf-depthgrow grow: unknown placement 'every:2'")


def test_run_config_takes_a_preset():
    cfg = RunConfig(positions="probe:2")
    assert cfg.positions is None and cfg.placement == "probe:2"
    with pytest.raises(ValueError, match="unknown placement 'every:2': use 'interleave:N'"):
        RunConfig(placement="every:2")
    with pytest.raises(ValueError, match="give positions or placement, not both"):
        RunConfig(positions=[1], placement="top:1")


def test_pipeline_resolves_probe_placement_from_its_probe():
    from types import SimpleNamespace

    from hf_depthgrow.pipeline.stages import _choose_positions

    run = SimpleNamespace(
        cfg=RunConfig(placement="probe:2"), model=tiny_model("llama"), probe_result=FakeProbe([0.0, 5.0, 1.0, 4.0, 2.0]),
        positions=[], placement=[], why="",
    )
    run.probe_result.recommendation = {"grow": False}
    assert _choose_positions(run) and run.positions == [1, 3] and run.why == "placement 'probe:2'"
