"""Paired evaluation: exact per-example losses, bad-input errors, metrics, report and CLI."""

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_depthgrow import bypass_new_blocks, grow_depth, new_block_modules, new_block_parameters
from hf_depthgrow.evaluation import metrics as ev_metrics
from hf_depthgrow.evaluation import NonFiniteLossError, block_norm_terms, compare_models, evaluate_delta
from hf_depthgrow.testing import tiny_inputs, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:loss_bound not given")


def _rows(batch):
    n = batch["labels"].shape[0]
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _perturb(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in new_block_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=g))


def _direct_lm(model, batch):
    """Per-example mean token loss from a plain forward pass, written out independently."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = []
    for i in range(logits.shape[0]):
        lab = batch["labels"][i, 1:]
        keep = lab != -100
        out.append(F.cross_entropy(logits[i, :-1][keep], lab[keep]).item())
    return out


@pytest.fixture(scope="module")
def grown_llama():
    base = tiny_model("llama")
    grown = grow_depth(copy.deepcopy(base), [2], block="native", init="random")
    _perturb(grown)
    return base, grown


@pytest.fixture(scope="module")
def lm_rows(grown_llama):
    batch = tiny_inputs(grown_llama[1], batch=7, seq=10, seed=3)
    batch["labels"][1, :6] = -100  # fewer supervised tokens in one example
    return _rows(batch)


def test_lm_per_example_losses_equal_two_separate_passes(grown_llama, lm_rows):
    base, grown = grown_llama
    res = evaluate_delta(grown, lm_rows, batch_size=3, loss_bound=10.0, n_bootstrap=200, use_evaluate=False)
    batch = {k: torch.stack([r[k] for r in lm_rows]) for k in lm_rows[0]}
    new = _direct_lm(grown, batch)
    with bypass_new_blocks(grown):
        old = _direct_lm(grown, batch)
    np.testing.assert_allclose(res.per_example_new, new, atol=1e-5)
    np.testing.assert_allclose(res.per_example_old, old, atol=1e-5)
    np.testing.assert_allclose(res.per_example_old, _direct_lm(base, batch), atol=1e-5)  # the real original
    assert max(abs(a - b) for a, b in zip(old, new)) > 1e-3  # the perturbed block changes the model
    assert res.mode == "shared_prefix" and res.prefix_index == 2
    # token-weighted data-set loss vs mean per-example delta (the intervals' target)
    w = np.array(res.example_weights)
    assert w[1] == 4 and w[0] == 9
    assert res.loss_old == pytest.approx(np.sum(w * old) / w.sum(), abs=1e-6)
    assert res.mean_delta == pytest.approx(np.mean(np.subtract(old, new)), abs=1e-6)
    assert res.delta != pytest.approx(res.mean_delta, abs=1e-9)
    assert res.metrics["old"]["perplexity"] == pytest.approx(np.exp(res.loss_old))
    assert set(res.intervals) == {"hoeffding", "bernstein", "bootstrap"}
    json.loads(res.to_json())


def test_classifier_per_example_losses_equal_two_separate_passes():
    model = tiny_model("bert")
    grown = grow_depth(model, [1], block="adapter")
    _perturb(grown, scale=0.5)
    batch = tiny_inputs(grown, batch=6, seq=8, seed=1)
    res = evaluate_delta(grown, _rows(batch), batch_size=4, loss_bound=5.0, n_bootstrap=100, use_evaluate=False)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        new = F.cross_entropy(grown(**inputs).logits, batch["labels"], reduction="none")
        with bypass_new_blocks(grown):
            old = F.cross_entropy(grown(**inputs).logits, batch["labels"], reduction="none")
    np.testing.assert_allclose(res.per_example_new, new.numpy(), atol=1e-5)
    np.testing.assert_allclose(res.per_example_old, old.numpy(), atol=1e-5)
    assert (old - new).abs().max() > 1e-4
    assert set(res.metrics["old"]) == {"accuracy", "f1_macro"}
    assert "use_evaluate=False" in res.metrics["source"]


def test_compare_models_matches_shared_prefix(grown_llama, lm_rows):
    base, grown = grown_llama
    shared = evaluate_delta(grown, lm_rows, batch_size=4, loss_bound=10.0, n_bootstrap=100, metrics=False)
    separate = compare_models(base, grown, lm_rows, batch_size=2, loss_bound=10.0, n_bootstrap=100, metrics=False)
    assert separate.mode == "separate"
    np.testing.assert_allclose(separate.per_example_old, shared.per_example_old, atol=1e-5)
    np.testing.assert_allclose(separate.per_example_new, shared.per_example_new, atol=1e-5)
    assert separate.intervals["bootstrap"] == pytest.approx(shared.intervals["bootstrap"], abs=1e-5)


def test_data_derived_bound_warns(grown_llama, lm_rows):
    with pytest.warns(UserWarning, match="not a valid a-priori bound"):
        res = evaluate_delta(grown_llama[1], lm_rows[:3], n_bootstrap=50, metrics=False)
    assert res.loss_bound_source == "data"
    assert res.loss_bound == pytest.approx(max(res.per_example_old + res.per_example_new))


# --------------------------------------------------------------------------- bad input


class _Counter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self)

    def __call__(self, *args):
        self.calls += 1


def test_empty_data(grown_llama):
    with pytest.raises(ValueError, match="empty"):
        evaluate_delta(grown_llama[1], [])
    with pytest.raises(ValueError, match="empty"):
        evaluate_delta(grown_llama[1], iter([]))


def test_vocab_mismatch_is_caught_before_running(grown_llama, lm_rows):
    grown = copy.deepcopy(grown_llama[1])
    counter = _Counter(grown)
    rows = copy.deepcopy(lm_rows)
    rows[4]["input_ids"][3] = 500  # vocabulary is 128
    with pytest.raises(ValueError, match=r"outside the vocabulary.*max id 500.*\[4\].*tokenizer does not match"):
        evaluate_delta(grown, rows, batch_size=2)
    assert counter.calls == 0


def test_missing_labels_and_bad_labels(grown_llama, lm_rows):
    rows = [{k: v for k, v in r.items() if k != "labels"} for r in lm_rows]
    with pytest.raises(ValueError, match="no 'labels'"):
        evaluate_delta(grown_llama[1], rows)
    rows = copy.deepcopy(lm_rows)
    rows[0]["labels"][:] = -100
    with pytest.raises(ValueError, match=r"examples \[0\] have no supervised token"):
        evaluate_delta(grown_llama[1], rows)
    bert = grow_depth(tiny_model("bert"), [1], block="adapter")
    batch = tiny_inputs(bert, batch=3, seq=8)
    batch["labels"][2] = 7  # 3 classes
    with pytest.raises(ValueError, match=r"labels outside 0..2.*\[2\]"):
        evaluate_delta(bert, _rows(batch))


def test_non_finite_losses_are_reported_with_ids(grown_llama):
    grown = copy.deepcopy(grown_llama[1])
    with torch.no_grad():
        grown.get_input_embeddings().weight[5] = float("nan")  # token 5 poisons only its own example
    batch = tiny_inputs(grown, batch=5, seq=10, seed=11)
    batch["input_ids"][batch["input_ids"] == 5] = 6
    batch["input_ids"][3, 4] = 5
    ids = ["a", "b", "c", "d", "e"]
    with pytest.raises(NonFiniteLossError, match=r"1 of 5 examples have a non-finite loss.*d \(old\+new") as info:
        evaluate_delta(grown, _rows(batch), example_ids=ids, loss_bound=10.0)
    assert info.value.example_ids == ["d"]


def test_not_grown_and_incompatible_models(grown_llama, lm_rows):
    base, grown = grown_llama
    with pytest.raises(ValueError, match="compare_models"):
        evaluate_delta(base, lm_rows)
    other = tiny_model("llama", vocab_size=64)
    with pytest.raises(ValueError, match="different output vocabularies"):
        compare_models(other, grown, lm_rows)
    with pytest.raises(ValueError, match="delta"):
        evaluate_delta(grown, lm_rows, delta=0)


# --------------------------------------------------------------------------- metrics, routes, report, CLI


def test_classification_metrics_fallback_and_evaluate_path(monkeypatch):
    preds, refs = np.array([0, 1, 2, 2, 1, 0, 2]), np.array([0, 2, 2, 1, 1, 0, 0])
    monkeypatch.setattr(ev_metrics, "_load_hf_metric", lambda name: (None, f"evaluate.load({name!r}) failed: offline"))
    metrics, source = ev_metrics.classification_metrics(preds, refs, num_labels=3)
    # by hand: 4 of 7 right; per-class F1 = 2tp / (2tp + fp + fn): 4/5, 2/4, 2/5 (scikit-learn agrees)
    assert metrics["accuracy"] == pytest.approx(4 / 7)
    assert metrics["f1_macro"] == pytest.approx((0.8 + 0.5 + 0.4) / 3)
    assert "offline" in source
    binary, _ = ev_metrics.classification_metrics(preds % 2, refs % 2, num_labels=2)
    assert binary["f1_binary"] == pytest.approx(0.5)

    class Fake:
        def __init__(self, key):
            self.key, self.calls = key, []

        def compute(self, predictions, references, **kw):
            self.calls.append(kw)
            return {self.key: 0.123}

    fakes = {"accuracy": Fake("accuracy"), "f1": Fake("f1")}
    monkeypatch.setattr(ev_metrics, "_load_hf_metric", lambda name: (fakes[name], None))
    metrics, source = ev_metrics.classification_metrics(preds, refs, num_labels=3)
    assert source.startswith("evaluate") and metrics == {"accuracy": 0.123, "f1_macro": 0.123}
    assert fakes["f1"].calls == [{"average": "macro"}]


def test_block_norm_terms_match_direct_autograd():
    model = tiny_model("llama")
    grown = grow_depth(model, [1], block="adapter")
    _perturb(grown, scale=0.3)
    (block,) = new_block_modules(grown)
    batch = tiny_inputs(grown, batch=3, seq=6, seed=2)
    terms = block_norm_terms(grown, _rows(batch), batch_size=2)
    w = torch.cat([block.w_out.weight.flatten(), block.w_out.bias])
    assert terms["b_w"] == pytest.approx(w.norm().item(), rel=1e-6)
    rhos, bas = [], []
    for row in _rows(batch):
        out = {}

        def keep(mod, args, output):
            output.retain_grad()
            out["h"] = output
            out["a"] = block.act(block.w_in(block.norm(args[0]))).detach()

        h = block.register_forward_hook(keep)
        logits = grown(input_ids=row["input_ids"][None]).logits
        F.cross_entropy(logits[0, :-1], row["labels"][1:]).backward()
        h.remove()
        rhos.append(out["h"].grad.norm().item())
        bas.append((out["a"].pow(2).sum() + out["a"].shape[1]).sqrt().item())  # + 1 per token for the bias
    grown.zero_grad()
    assert terms["rho"] == pytest.approx(max(rhos), rel=1e-4)
    assert terms["b_a"] == pytest.approx(max(bas), rel=1e-5)


def test_routes_in_result_and_report(grown_llama, lm_rows, tmp_path):
    from hf_depthgrow.evaluation import route_inputs, write_report

    base, grown = grown_llama
    stone = copy.deepcopy(grown)
    _perturb(stone, scale=0.01, seed=5)

    class TrainResult:
        delta_erm = 0.02
        selected = "f_new"

    inputs = route_inputs(grown, n_train=1000, train_result=TrainResult(), stone_pop=0.1, stone=stone,
                          test_data=lm_rows, block_data=lm_rows)
    assert inputs.delta_erm == 0.02 and inputs.delta_r == 0.1 and inputs.rho > 0 and inputs.b_w > 0
    direct = evaluate_delta(stone, lm_rows, loss_bound=10.0, metrics=False, n_bootstrap=10)
    assert inputs.delta_r_test == pytest.approx(direct.mean_delta)
    res = evaluate_delta(grown, lm_rows, loss_bound=10.0, n_bootstrap=100, routes=inputs, use_evaluate=False)
    assert res.routes["route_a"]["complete"] and res.routes["route_b"]["complete"]
    assert res.routes["terms"]["eps_K"] == pytest.approx(10.0 * np.sqrt(np.log(2 / 0.05) / (2 * len(lm_rows))))
    paths = write_report(res, tmp_path, command="hf-depthgrow eval x")
    md = paths["markdown"].read_text()
    assert "Route A" in md and "vacuous" in md and "rho (estimate)" in md and "Verdict" in md
    assert json.loads(paths["json"].read_text())["routes"]["route_b"]["formula"]
    assert paths["differences"].stat().st_size > 1000 and paths["intervals"].stat().st_size > 1000


def _char_tokenizer(chars: str):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_cli_writes_report_and_rejects_vocab_mismatch(grown_llama, tmp_path, capsys):
    from hf_depthgrow import save_pretrained
    from hf_depthgrow.cli.eval import main

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    model_dir = tmp_path / "grown"
    save_pretrained(grown_llama[1], model_dir)
    _char_tokenizer("abcdefghijklmnopqrstuvwxyz .").save_pretrained(model_dir)
    out = tmp_path / "out"
    argv = [str(model_dir), "--data", str(text), "--block-size", "16", "--max-examples", "12", "--loss-bound", "10",
            "--n-bootstrap", "100", "--no-evaluate", "--no-progress", "--n-train", "100", "--delta-erm", "0.01", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_examples"] == 12 and report["mode"] == "shared_prefix"
    assert report["routes"]["route_a"]["complete"] is False  # Delta_R and rho were not given
    assert (out / "report.md").exists() and (out / "eval_intervals.png").exists()
    # a tokenizer with more symbols than the model's 128 embeddings
    _char_tokenizer("".join(chr(0x4E00 + i) for i in range(200))).save_pretrained(model_dir)
    text.write_text("".join(chr(0x4E00 + i % 200) for i in range(2000)))
    assert main([str(model_dir), "--data", str(text), "--block-size", "16", "--out", str(out), "--overwrite", "--no-progress"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_module_name_does_not_shadow_hf_evaluate():
    """`hf_depthgrow.evaluation` never shadows Hugging Face's `evaluate`: `import evaluate` still finds theirs."""
    import importlib.util

    spec = importlib.util.find_spec("evaluate")
    assert spec is not None and "hf_depthgrow" not in spec.origin
    assert ev_metrics.__name__ == "hf_depthgrow.evaluation.metrics"


def test_report_says_which_view_of_one_model_each_side_is(grown_llama, lm_rows):
    # Shared-prefix mode: old and new are the same object (same path); the report must tell them apart.
    from hf_depthgrow.evaluation.report import render_markdown

    grown = copy.deepcopy(grown_llama[1])
    grown.config._name_or_path = "/models/tiny-llama"
    text = render_markdown(evaluate_delta(grown, lm_rows, n_bootstrap=50, metrics=False))
    line = next(l for l in text.splitlines() if l.startswith("Old = "))
    assert "= tiny-llama, the grown model with its new blocks bypassed" in line  # a folder name, never the path
    assert "/models/" not in text and "new = tiny-llama, grown to" in line and "new blocks at stack index [" in line


def _block_network(monkeypatch):
    import socket

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_classifier_evaluation_makes_no_network_call(var, monkeypatch):
    for other in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(ev_metrics, "_HF_METRICS", {})
    attempts = _block_network(monkeypatch)
    grown = grow_depth(tiny_model("bert"), [1], block="adapter")
    batch = tiny_inputs(grown, batch=6, seq=8, seed=1)
    res = evaluate_delta(grown, _rows(batch), batch_size=4, loss_bound=5.0, n_bootstrap=50)  # use_evaluate=True
    assert attempts == []
    assert res.metrics["source"] == (
        f"hf_depthgrow numpy (scikit-learn definitions); evaluate not used: {var} is set "
        "(offline: evaluate.load would look metric scripts up on the Hub)"
    )
    preds = np.array([0, 1, 1, 0])
    assert ev_metrics.classification_metrics(preds, preds, num_labels=2)[0] == {"accuracy": 1.0, "f1_binary": 1.0}
