"""The typed growth record: derived indices, round trips, old records, and forged records refused."""

import copy
import dataclasses
import json

import pytest

from hf_depthgrow import grow_depth, growth_record, load_pretrained, save_pretrained
from hf_depthgrow.growth.engine import check_record_matches
from hf_depthgrow.growth.record import AdapterEntry, GrowthRecord, InvalidGrowthRecordError
from hf_depthgrow.hub.serialization import _adapter_state
from hf_depthgrow.testing import tiny_model

# A record as the first release wrote it (no num_layers key): it must still load.
OLD_RECORD = {
    "base_num_layers": 4,
    "native_indices": [2],
    "adapters": [],
    "history": [{"positions": [2], "num_layers_before": 4, "block": "native", "init": "copy", "eps": 1e-6, "seed": 0, "config": {}}],
    "hf_depthgrow_version": "0.1.0",
}


def test_indices_and_insertion_points():
    record = GrowthRecord(
        base_num_layers=4,
        num_layers=6,
        native_indices=(1, 4),
        adapters=(AdapterEntry(host=0, where="pre", dim=8, norm="rms", eps=1e-5, act="gelu"),
                  AdapterEntry(host=5, where="post", dim=8, norm="rms", eps=1e-5, act="gelu")),
    )
    assert record.old_indices == (0, 2, 3, 5)
    assert record.insertion_points == (0, 1, 4, 6)
    # The lowest changed layer hosts the pre adapter; a post adapter changes its host but sits above it.
    assert record.lowest_changed_layer == 0 and record.lowest_insertion_point == 0
    assert record.num_original_below(4) == 3
    assert record.block_kinds == ("native", "adapter")
    post_only = GrowthRecord(base_num_layers=4, num_layers=4, adapters=(AdapterEntry(3, "post", 8, "rms", 1e-5, "gelu"),))
    assert post_only.lowest_changed_layer == 3 and post_only.lowest_insertion_point == 4


def test_round_trip_and_old_records_load():
    model = tiny_model("llama")
    grow_depth(model, [0, 4], block="native")
    grow_depth(model, [3], block="adapter", eps=1e-5)
    record = growth_record(model)
    again = GrowthRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record
    old = GrowthRecord.from_dict(OLD_RECORD)
    assert old.num_layers == 5 and old.native_indices == (2,) and old.history[0].positions == (2,)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"native_indices": [9]}, "native_indices entries must be an integer in 0..4"),
        ({"native_indices": [-1]}, "native_indices entries"),
        ({"num_layers": 7}, "num_layers 7 != base_num_layers 4 + 1 native blocks"),
        ({"adapters": [{"host": 1, "where": "pre", "dim": 8, "norm": "rms", "eps": -1.0, "act": "gelu"}]}, "adapter eps must be a finite number > 0"),
        ({"adapters": [{"host": 1, "where": "side", "dim": 8, "norm": "rms", "eps": 1e-5, "act": "gelu"}]}, "adapter where/norm"),
        ({"adapters": [{"host": 1, "bogus": 1}]}, "malformed adapter or history entry"),
        ({"base_num_layers": "4"}, "base_num_layers must be an integer"),
    ],
)
def test_forged_records_are_refused(change, message):
    data = {**copy.deepcopy(OLD_RECORD), **change}
    with pytest.raises(InvalidGrowthRecordError, match=message.replace("(", r"\(").replace("+", r"\+")):
        GrowthRecord.from_dict(data)


def test_a_saved_record_that_does_not_match_the_weights_is_refused(tmp_path):
    model = tiny_model("llama")
    grow_depth(model, [2], block="native")
    save_pretrained(model, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["depth_growth"]["base_num_layers"] = 3
    config["depth_growth"]["num_layers"] = 4  # self-consistent, but the checkpoint holds 5 layers
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidGrowthRecordError, match="record says 4 layers but the model has 5"):
        load_pretrained(tmp_path / "m")
    config["depth_growth"]["native_indices"] = [7]
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidGrowthRecordError, match="native_indices"):
        load_pretrained(tmp_path / "m")


def _adapter_model():
    model = tiny_model("llama")
    grow_depth(model, [1, 1, 4], block="adapter", adapter_dim=8)
    return model, growth_record(model), _adapter_state(model)


def test_check_record_matches_accepts_what_grow_depth_wrote():
    model, record, state = _adapter_model()
    check_record_matches(model, record, state)
    native = tiny_model("llama")
    grow_depth(native, [0, 4], block="native")
    check_record_matches(native, growth_record(native))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda r: dataclasses.replace(r, adapters=(dataclasses.replace(r.adapters[0], dim=16), *r.adapters[1:])),
            "growth record: adapter model.layers.1.depthgrow_pre.0.w_in.weight has shape (8, 32), but the record's dim 16 "
            "and hidden size 32 give (16, 32)",
        ),
        (
            lambda r: dataclasses.replace(r, adapters=r.adapters[1:]),
            "growth record lists 1 pre adapters on layer 1, the model hosts 2",
        ),
        (
            lambda r: dataclasses.replace(r, adapters=(*r.adapters[:2], dataclasses.replace(r.adapters[2], host=2))),
            "growth record: a post adapter hangs on layer 2, not on the last layer 3",
        ),
        (
            lambda r: dataclasses.replace(r, num_layers=5, native_indices=(2,)),
            "growth record says 5 layers but the model has 4: the record does not describe these weights",
        ),
    ],
    ids=["adapter dim vs weights", "adapter count vs hosted", "post adapter host", "native layer count"],
)
def test_check_record_matches_refuses_a_record_the_weights_contradict(change, message):
    model, record, state = _adapter_model()
    with pytest.raises(InvalidGrowthRecordError) as caught:
        check_record_matches(model, change(record), state)
    assert str(caught.value) == message


def test_saved_adapter_weights_that_contradict_the_record_are_refused(tmp_path):
    model = tiny_model("llama")
    grow_depth(model, [1], block="adapter")
    save_pretrained(model, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["depth_growth"]["adapters"][0]["dim"] = 7  # the saved tensors hold the real width
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidGrowthRecordError, match=r"m: growth record: adapter .*w_in.weight has shape"):
        load_pretrained(tmp_path / "m")
