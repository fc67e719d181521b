"""Nested configs: growing one tower of a dual encoder (CLIP, SigLIP) or a vision-language model (LLaVA), exactly.

The top config of these models has no `num_hidden_layers`: each tower (`text_config`,
`vision_config`) has its own layer stack. `grow_depth(..., tower=...)` grows one of them; the
growth record (in the top config) names the tower, so save + reload restore it.
"""

import copy
import json

import pytest
import torch
import transformers as tf

from hf_depthgrow import (
    GrowthConfig,
    bypass_new_blocks,
    grow_depth,
    growth_record,
    load_pretrained,
    new_block_parameters,
    save_pretrained,
)
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.growth.record import GrowthRecord, InvalidGrowthRecordError
from hf_depthgrow.growth.verify import GrowthNotExactError, probe_inputs
from hf_depthgrow.testing import tiny_model

TOL = 1e-6
_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=32, bos_token_id=0, eos_token_id=2, pad_token_id=1)
_VISION = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37, image_size=16, patch_size=4)
INPUTS = dict(input_ids=torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0)),
              pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))


def dual_encoder(kind="clip"):
    config_cls, model_cls = (tf.CLIPConfig, tf.CLIPModel) if kind == "clip" else (tf.SiglipConfig, tf.SiglipModel)
    extra = {"projection_dim": 16} if kind == "clip" else {}
    torch.manual_seed(0)
    return model_cls(config_cls(text_config=dict(_TEXT), vision_config=dict(_VISION), **extra)).eval()


def llava():
    vision = dict(_VISION, model_type="clip_vision_model")
    text = dict(model_type="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    # vision_feature_layer=-2 as in LLaVA-1.5: the projector reads the output below the vision tower's top layer.
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=100, vision_feature_layer=-2)
    torch.manual_seed(0)
    return tf.LlavaForConditionalGeneration(config).eval()


def outputs(model, inputs=INPUTS):
    """Every tensor the dual encoder returns that a tower feeds (logits both ways and both embeddings)."""
    with torch.no_grad():
        out = model(**inputs)
    return torch.cat([out.logits_per_image.flatten(), out.text_embeds.flatten(), out.image_embeds.flatten()])


def fingerprint(model):
    return model.config.to_json_string(), {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    config_json, state = before
    assert model.config.to_json_string() == config_json and growth_record(model) is None
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def test_tower_must_be_named_when_several_have_layers_and_bad_towers_are_refused():
    model = dual_encoder("clip")
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"CLIPModel has several towers with a layer stack: \['text', 'vision'\]\. Pass tower="):
        grow_depth(model, [1])
    with pytest.raises(ValueError, match=r"tower='audio' is not a tower of CLIPModel; its towers are \['text', 'vision'\]"):
        grow_depth(model, [1], tower="audio")
    with pytest.raises(ValueError, match="out of range: the model has 3 layers"):
        grow_depth(model, [4], tower="vision")
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no towers .* drop tower="):
        grow_depth(tiny_model("llama"), [1], tower="vision")
    for bad in (3, "vision tower", ""):
        with pytest.raises(ValueError, match="tower must be None or a tower name"):
            GrowthConfig(tower=bad)


def test_clip_vision_tower_grows_natively_exactly_and_round_trips(tmp_path):
    model = dual_encoder("clip")
    before = outputs(model)
    grow_depth(model, [0, 2, 3], tower="vision")
    record = growth_record(model)
    assert record.tower == "vision" and record.block_kinds == ("native",) and record.native_indices == (0, 3, 5)
    assert model.config.vision_config.num_hidden_layers == 6 and model.config.text_config.num_hidden_layers == 3
    assert resolve_family(model)[2] == "vision_model.encoder.layers"  # the record names the tower from now on
    assert (outputs(model) - before).abs().max() <= TOL
    with bypass_new_blocks(model):
        assert model.config.vision_config.num_hidden_layers == 3 and (outputs(model) - before).abs().max() <= TOL
    with pytest.raises(ValueError, match="grown in its 'vision' tower; growing a second tower \\('text'\\) is not supported"):
        grow_depth(model, [1], tower="text")

    save_pretrained(model, tmp_path / "clip")
    assert json.loads((tmp_path / "clip" / "config.json").read_text())["depth_growth"]["tower"] == "vision"
    plain = tf.CLIPModel.from_pretrained(tmp_path / "clip").eval()  # a vanilla checkpoint: plain transformers loads it
    assert len(plain.vision_model.encoder.layers) == 6 and (outputs(plain) - before).abs().max() <= TOL
    again = load_pretrained(tmp_path / "clip").eval()
    assert growth_record(again) == record and (outputs(again) - before).abs().max() <= TOL
    grow_depth(again, [6])  # the record names the tower: no tower= needed to grow it further
    assert again.config.vision_config.num_hidden_layers == 7 and (outputs(again) - before).abs().max() <= TOL


def test_siglip_text_tower_adapters_round_trip(tmp_path):
    model = dual_encoder("siglip")
    before = outputs(model)
    grow_depth(model, [1, 3], tower="text", block="adapter")
    assert growth_record(model).tower == "text" and (outputs(model) - before).abs().max() <= TOL
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking blocks, so the reload is checked on something non-trivial
        for _, param in new_block_parameters(model):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    grown = outputs(model)
    assert (grown - before).abs().max() > 1e-4
    save_pretrained(model, tmp_path / "siglip")
    base = tf.SiglipModel.from_pretrained(tmp_path / "siglip").eval()  # the main checkpoint stays the clean base
    assert (outputs(base) - before).abs().max() <= TOL
    again = load_pretrained(tmp_path / "siglip").eval()
    assert growth_record(again).tower == "text" and (outputs(again) - grown).abs().max() <= TOL


def test_vision_language_model_grows_either_tower_exactly(tmp_path):
    model = llava()
    inputs = probe_inputs(model, torch.device("cpu"))  # token ids with one image's placeholder tokens, and the image
    assert int((inputs["input_ids"] == 100).sum()) == 16

    def run(m):
        with torch.no_grad():
            return m(**inputs).logits

    before = run(model)
    with pytest.raises(ValueError, match=r"several towers with a layer stack: \['text', 'vision'\]"):
        grow_depth(model, [1])
    text = grow_depth(copy.deepcopy(model), [0, 2], tower="text")
    assert text.config.text_config.num_hidden_layers == 4 and (run(text) - before).abs().max() <= TOL
    save_pretrained(text, tmp_path / "llava")
    plain = tf.LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava").eval()
    assert len(plain.model.language_model.layers) == 4 and (run(plain) - before).abs().max() <= TOL

    vision = grow_depth(copy.deepcopy(model), [1, 2], tower="vision")
    assert vision.config.vision_config.num_hidden_layers == 5 and (run(vision) - before).abs().max() <= TOL
    # A block on top of the vision tower would shift what vision_feature_layer=-2 reads: checked and refused.
    state = fingerprint(model)
    with pytest.raises(GrowthNotExactError, match="vision_feature_layer"):
        grow_depth(model, [3], tower="vision")
    assert_unchanged(model, state)


def test_growth_record_tower_is_backward_compatible():
    flat = grow_depth(tiny_model("llama"), [2])
    assert "tower" not in growth_record(flat).to_dict()  # flat models write exactly what earlier versions wrote
    assert "tower" not in growth_record(flat).history[0].config
    old = {"base_num_layers": 3, "native_indices": [1], "adapters": [], "history": []}
    assert GrowthRecord.from_dict(old).tower is None
    record = GrowthRecord.from_dict({**old, "tower": "vision"})
    assert record.tower == "vision" and GrowthRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    with pytest.raises(InvalidGrowthRecordError, match="tower must be null or a tower name"):
        GrowthRecord.from_dict({**old, "tower": "../vision"})
