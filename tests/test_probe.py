"""The probe (docs/theory.md §2, §5, §6): exact against autograd on grown models, side-effect free, honest verdicts."""

import copy
import json
import math

import pytest
import torch

from hf_depthgrow.growth.engine import grow_depth, new_block_parameters
from hf_depthgrow.chunked_loss import batch_example_losses
from hf_depthgrow.probe.plots import plot_probe
from hf_depthgrow.probe.signal import VERDICT_IMPROVABLE, VERDICT_NOT_OBSERVABLE, ProbeResult, probe
from hf_depthgrow.probe.statistics import PositionStats
from hf_depthgrow.testing import tiny_inputs, tiny_model



def batches_for(model, n=3, batch=2, seq=12):
    return [tiny_inputs(model, batch=batch, seq=seq, seed=s) for s in range(n)]


def grown_signal(model, batches, k, **kwargs):
    """Reference: grow a copy at k, loss over all batches (token-weighted / per example), autograd."""
    grown = grow_depth(copy.deepcopy(model), [k], **kwargs)
    params = [p for _, p in new_block_parameters(grown)]
    total, weight = 0.0, 0.0
    for batch in batches:
        losses = batch_example_losses(grown, batch)
        total = total + losses.total.sum()
        weight = weight + losses.weight.sum()
    grads = torch.autograd.grad(total / weight, params, allow_unused=True)
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))


@pytest.mark.parametrize(
    "model_type, block",
    [
        ("llama", "auto"),  # native, pre-norm
        ("llama", "adapter"),
        ("gemma2", "auto"),  # native, the branches end in post-norms (Jacobian gamma / sqrt(eps) at 0)
        ("gemma3_text", "auto"),  # native, sliding/full layer types: the candidate takes layer k-1's mask
        ("bert", "auto"),  # post-norm encoder: adapter blocks
        ("vit", "auto"),  # vision, native
    ],
)
def test_signal_equals_autograd_on_grown_model_at_every_position(model_type, block):
    model = tiny_model(model_type)
    batches = batches_for(model)
    result = probe(model, batches, block=block, progress=False)
    assert result.positions == list(range(model.config.num_hidden_layers + 1))
    for i, k in enumerate(result.positions):
        expected = grown_signal(model, batches, k, block=block)
        assert expected > 0
        assert abs(result.signal[i] - expected) <= 1e-4 * expected, (k, result.signal[i], expected)


@pytest.mark.parametrize("first, then", [("adapter", "native"), ("native", "adapter")])
def test_signal_exact_on_an_already_grown_model(first, then):
    # A native block goes in before adapters already hung on layer k; a new adapter after them.
    model = tiny_model("llama")
    grow_depth(model, [2, 4], block=first)
    with torch.no_grad():  # trained-looking blocks, so that they matter
        for _, p in new_block_parameters(model):
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batches = batches_for(model, n=2)
    result = probe(model, batches, block=then, progress=False)
    for i, k in enumerate(result.positions):
        grown = copy.deepcopy(model)
        before = {id(p) for p in grown.parameters()}
        grow_depth(grown, [k], block=then)
        params = [p for p in grown.parameters() if id(p) not in before]
        total, weight = 0.0, 0.0
        for batch in batches:
            losses = batch_example_losses(grown, batch)
            total, weight = total + losses.total.sum(), weight + losses.weight.sum()
        grads = torch.autograd.grad(total / weight, params, allow_unused=True)
        expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))
        assert abs(result.signal[i] - expected) <= 1e-4 * expected, (k, result.signal[i], expected)


def test_signal_parts_are_the_output_projections():
    model = tiny_model("llama")
    result = probe(model, batches_for(model, n=2), positions=[1], progress=False)
    assert set(result.signal_parts[0]) == {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
    assert math.isclose(math.hypot(*result.signal_parts[0].values()), result.signal[0], rel_tol=1e-6)


def test_probe_leaves_the_model_unchanged():
    model = tiny_model("llama")
    model.train()
    model.model.layers[1].eval()  # a mixed mode must come back as it was
    model.model.embed_tokens.weight.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    hooks = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in model.named_modules()}
    probe(model, batches_for(model), progress=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in model.named_modules()} == hooks
    assert all(p.grad is None for p in model.parameters())


def test_hooks_removed_on_error():
    model = tiny_model("llama")
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ValueError, match="labels"):
        probe(model, [{"input_ids": torch.ones(1, 4, dtype=torch.long)}], progress=False)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks
    assert all(p.requires_grad for p in model.parameters())


def test_multi_batch_accumulation_equals_one_big_batch():
    model = tiny_model("llama")
    small = batches_for(model, n=4, batch=2)
    big = {k: torch.cat([b[k] for b in small]) for k in small[0]}
    many = probe(model, small, progress=False)
    one = probe(model, [big], progress=False)
    for key in ("signal", "offdiag_share", "spectral_norm", "stable_rank", "trace", "near_singular_share", "mean_var"):
        assert torch.allclose(torch.tensor(getattr(many, key)), torch.tensor(getattr(one, key)), rtol=1e-5), key
    assert math.isclose(many.loss, one.loss, rel_tol=1e-6)
    assert many.total_weight == one.total_weight == 8 * 11  # token-weighted: shifted labels


def test_dataset_input_matches_batches():
    datasets = pytest.importorskip("datasets")
    model = tiny_model("bert")
    batches = batches_for(model, n=3, batch=2)
    rows = {k: torch.cat([b[k] for b in batches]).tolist() for k in batches[0]}
    ds = datasets.Dataset.from_dict(rows).with_format("torch")
    from_ds = probe(model, ds, batch_size=2, progress=False)
    from_batches = probe(model, batches, progress=False)
    assert torch.allclose(torch.tensor(from_ds.signal), torch.tensor(from_batches.signal), rtol=1e-6)
    assert from_ds.num_examples == 6 and from_ds.weight_unit == "examples"


def test_zero_head_gives_no_signal_and_no_growth():
    # Zero head weights: logits are constant, so the loss does not depend on the residual stream at all.
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    result = probe(model, batches_for(model, n=4), progress=False)
    assert all(s == 0.0 for s in result.signal)
    assert all(v == VERDICT_NOT_OBSERVABLE for v in result.verdict)
    assert not any(result.improvable)
    assert result.recommendation["grow"] is False and result.recommendation["best"] is None
    assert math.isclose(result.loss, math.log(model.config.vocab_size), rel_tol=1e-6)


def test_consistent_gradient_is_improvable():
    # One input, labels mostly one token with 20% random ones: every batch's gradient is a common
    # direction plus a little label noise, so the population signal is clearly observable.
    model = tiny_model("llama")
    base = tiny_inputs(model, seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        labels = torch.full_like(base["labels"], 7)
        noise = torch.randint(0, model.config.vocab_size, labels.shape, generator=gen)
        labels = torch.where(torch.rand(labels.shape, generator=gen) < 0.2, noise, labels)
        batches.append({**base, "labels": labels})
    result = probe(model, batches, progress=False)
    assert all(result.improvable) and all(v == VERDICT_IMPROVABLE for v in result.verdict)
    assert all(z > 5 for z in result.z)
    assert result.recommendation["grow"] is True
    assert result.recommendation["best"] == result.positions[max(range(len(result.z)), key=lambda i: result.z[i])]


def _label_noise_batches(model, n=6):
    """Batches whose labels are drawn independently of everything (seeded)."""
    batches = batches_for(model, n=n)
    gen = torch.Generator().manual_seed(3)
    for b in batches:
        b["labels"] = torch.randint(0, model.config.vocab_size, b["labels"].shape, generator=gen)
    return batches


def test_pure_label_noise_is_not_observable():
    # Labels drawn independently of everything: the per-batch gradients share no direction beyond
    # what the model's miscalibration gives; with few batches nothing is significant.
    model = tiny_model("gpt2")
    result = probe(model, _label_noise_batches(model), progress=False)
    assert all(abs(z) < 3 for z in result.z)


def test_population_statistic_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(5, generator=gen) + 0.3 for _ in range(7)]
    weights = [3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 2.0]
    stats = PositionStats(5, num_splits=3, device="cpu", covariance=False)
    for b, (v, w) in enumerate(zip(vectors, weights)):
        stats.add_gradient(b, v, w)

    def u_of(idx):
        num = sum(float(vectors[i] @ vectors[j]) for i in idx for j in idx if i != j)
        den = sum(weights[i] * weights[j] for i in idx for j in idx if i != j)
        return num / den

    u, se = stats.population()
    assert math.isclose(u, u_of(range(7)), rel_tol=1e-6)
    groups = [[b for b in range(7) if b % 3 == m] for m in range(3)]
    leave = [u_of([b for b in range(7) if b not in g]) for g in groups]
    mean = sum(leave) / 3
    assert math.isclose(se, math.sqrt(2 / 3 * sum((v - mean) ** 2 for v in leave)), rel_tol=1e-6)


def test_population_estimate_is_unbiased_on_noise():
    # Zero-mean gradients: E[U] = ||mu||^2 = 0, while the naive ||mean||^2 is biased upwards.
    gen = torch.Generator().manual_seed(1)
    us, naive = [], []
    for _ in range(300):
        stats = PositionStats(20, num_splits=4, device="cpu", covariance=False)
        total = torch.zeros(20)
        for b in range(8):
            v = torch.randn(20, generator=gen)
            stats.add_gradient(b, v, 1.0)
            total += v
        us.append(stats.population()[0])
        naive.append(float((total / 8).square().sum()))
    mean_u = sum(us) / len(us)
    sd_u = (sum((u - mean_u) ** 2 for u in us) / len(us)) ** 0.5
    assert abs(mean_u) < 4 * sd_u / len(us) ** 0.5
    assert sum(naive) / len(naive) > 2.0  # E||mean||^2 = 20 / 8


def test_covariance_statistics_on_constructed_gradients():
    d = 6
    # Rank one: g_t = s_t u. Sigma = E[s^2] u u^T: stable rank 1, spectral norm = trace.
    u = torch.tensor([1.0, 2.0, 0.0, -1.0, 0.5, 0.0])
    s = torch.linspace(-1, 2, 50)
    stats = PositionStats(1, num_splits=2, device="cpu", covariance=True)
    stats.add_tokens(s[:, None] * u, torch.ones(50), 0.0)
    cov = stats.covariance()
    sigma = (s.square().mean() * torch.outer(u, u)).double()
    off = torch.linalg.matrix_norm(sigma - torch.diag(torch.diag(sigma))) / torch.linalg.matrix_norm(sigma)
    assert math.isclose(cov["stable_rank"], 1.0, rel_tol=1e-6)
    assert math.isclose(cov["spectral_norm"], cov["trace"], rel_tol=1e-6)
    assert math.isclose(cov["offdiag_share"], float(off), rel_tol=1e-6)
    # Independent coordinates with variances 1..d: near-diagonal, stable rank sum / max.
    gen = torch.Generator().manual_seed(0)
    scales = torch.arange(1, d + 1, dtype=torch.float32).sqrt()
    stats = PositionStats(1, num_splits=2, device="cpu", covariance=True)
    stats.add_tokens(torch.randn(200_000, d, generator=gen) * scales, torch.ones(200_000), 0.0)
    cov = stats.covariance()
    assert cov["offdiag_share"] < 0.01
    assert math.isclose(cov["stable_rank"], 21 / 6, rel_tol=0.02)


def test_covariance_matches_direct_activation_gradients():
    # Sigma_k from the probe equals (1/N) sum_t g_t g_t^T with g from retain_grad on the hidden states.
    model = tiny_model("llama")
    batch = tiny_inputs(model, batch=2, seq=10)
    result = probe(model, [batch], positions=[2], progress=False)
    out = model(input_ids=batch["input_ids"], output_hidden_states=True)
    hidden = out.hidden_states[2]  # input of layer 2 (before the final norm only at L)
    from hf_depthgrow.losses import example_losses

    loss = example_losses(out.logits, batch["labels"], causal=True).total.sum()
    (g,) = torch.autograd.grad(loss, hidden)
    g = g.reshape(-1, g.shape[-1]).double()
    sigma = g.T @ g / g.shape[0]
    assert math.isclose(result.trace[0], float(torch.trace(sigma)), rel_tol=1e-4)
    assert math.isclose(result.spectral_norm[0], float(torch.linalg.eigvalsh(sigma)[-1]), rel_tol=1e-4)
    model.zero_grad(set_to_none=True)


def test_norm_regime_counts_tokens_near_eps():
    model = tiny_model("llama")
    batch = tiny_inputs(model, batch=2, seq=8)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e-4)  # tiny embeddings: var(z_0) ~ 1e-8 * 4e-4, far below 100 * eps
    result = probe(model, [batch], positions=[0, 4], progress=False)
    assert result.norm_eps == [model.config.rms_norm_eps] * 2  # layer 0's input norm, the final norm
    assert result.near_singular_share[0] == 1.0
    assert result.min_var[0] <= result.mean_var[0]
    huge = probe(model, [batch], positions=[0], norm_factor=1e-30, progress=False)
    assert huge.near_singular_share[0] == 0.0


def test_result_json_round_trip_and_plot(tmp_path):
    model = tiny_model("vit")
    result = probe(model, batches_for(model, n=4), progress=False)
    path = tmp_path / "probe.json"
    result.to_json(path)
    data = json.loads(path.read_text())
    assert data["positions"] == result.positions and "gradients" not in data
    again = ProbeResult.from_json(path)
    assert again.signal == result.signal and again.recommendation == result.recommendation
    plot_probe(again, tmp_path / "probe.png")
    assert (tmp_path / "probe.png").read_bytes()[:4] == b"\x89PNG"


def test_keep_gradients_match_grown_model():
    model = tiny_model("llama")
    batches = batches_for(model, n=2)
    result = probe(model, batches, positions=[3], keep_gradients=True, progress=False)
    grown = grow_depth(copy.deepcopy(model), [3])
    total, weight = 0.0, 0.0
    for b in batches:
        losses = batch_example_losses(grown, b)
        total, weight = total + losses.total.sum(), weight + losses.weight.sum()
    layer = grown.model.layers[3]
    names = list(result.gradients[0])
    grads = torch.autograd.grad(total / weight, [layer.get_parameter(n) for n in names])
    for name, g in zip(names, grads):
        assert torch.allclose(result.gradients[0][name], g, rtol=1e-4, atol=1e-7), name


def test_rejects_bad_arguments():
    model = tiny_model("llama")
    batches = batches_for(model, n=1)
    with pytest.raises(ValueError, match="out of range"):
        probe(model, batches, positions=[9], progress=False)
    with pytest.raises(ValueError, match="num_splits"):
        probe(model, batches, num_splits=1, progress=False)
    with pytest.raises(ValueError, match="native blocks are not function-preserving"):
        probe(tiny_model("bert"), batches_for(tiny_model("bert"), n=1), block="native", progress=False)
    with pytest.raises(ValueError, match="empty"):
        probe(model, [], progress=False)
    with pytest.raises(ValueError, match="no batches"):
        probe(model, torch.utils.data.DataLoader([]), progress=False)


def test_too_few_batches_is_not_observable():
    model = tiny_model("llama")
    result = probe(model, batches_for(model, n=2), positions=[1], progress=False)
    assert math.isnan(result.population_se[0]) and result.verdict == [VERDICT_NOT_OBSERVABLE]
    assert result.to_dict()["z"] == [None]


# --------------------------------------------------------------------------- CLI


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a of and to in is that it was he for on are with as his they be at one have this from".split()
    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")
    fast.save_pretrained(path)
    return words


def test_cli_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("hf_depthgrow.data.sources")
    from hf_depthgrow.cli.probe import main, parse_positions

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    words = _tiny_tokenizer(tmp_path / "model")
    gen = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (2000,), generator=gen).tolist())
    (tmp_path / "corpus.txt").write_text(text)
    out = tmp_path / "out"
    code = main([str(tmp_path / "model"), "--data", str(tmp_path / "corpus.txt"), "--out", str(out), "--block-size", "16",
                 "--max-examples", "24", "--batch-size", "4", "--positions", "0,2-4", "--no-progress", "--threads", "1"])
    assert code == 0
    data = json.loads((out / "probe.json").read_text())
    assert data["positions"] == [0, 2, 3, 4] and data["num_batches"] == 6
    assert data["command"].startswith("hf-depthgrow probe ")
    assert (out / "probe.png").read_bytes()[:4] == b"\x89PNG"
    assert "recommendation" in capsys.readouterr().out
    assert parse_positions("0,3-5") == [0, 3, 4, 5]
    assert main([str(tmp_path / "missing"), "--data", "x", "--out", str(out)]) == 2  # an input error


def _consistent_batches(model, n):
    base = tiny_inputs(model, seed=0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        labels = torch.full_like(base["labels"], 7)
        noise = torch.randint(0, model.config.vocab_size, labels.shape, generator=gen)
        out.append({**base, "labels": torch.where(torch.rand(labels.shape, generator=gen) < 0.2, noise, labels)})
    return out


def test_sequential_stopping_ends_once_the_recommendation_is_stable_and_equals_the_shorter_probe():
    model = tiny_model("llama")
    batches = _consistent_batches(model, 16)
    full = probe(model, batches, progress=False)
    assert full.num_batches == 16 and full.stopping is None
    stopped = probe(model, batches, progress=False, stop_patience=2)
    # The recommendation is the same after batches 3, 4 and 5: with patience 2 the probe stops at 5.
    assert stopped.num_batches == 5
    assert "stopped after 5 of at most 16 batches" in stopped.stopping and "did not change over the last 2" in stopped.stopping
    # Close z-scores can still swap later (here k = 2 leads after 5 batches, k = 1 after 16): a stop is a
    # cheaper, noisier answer, which is why it is opt-in.
    assert stopped.recommendation["positions"] == [2, 1, 0] and full.recommendation["positions"] == [1, 2, 0]
    # Patience longer than the swaps: it reads everything.
    assert probe(model, batches, progress=False, stop_patience=3).num_batches == 16
    # What it reports is exactly the probe of the batches it read.
    short = probe(model, batches[: stopped.num_batches], progress=False)
    assert stopped.z == short.z and stopped.signal == short.signal
    # Fewer batches: wider standard errors.
    assert sum(stopped.population_se) > sum(full.population_se)
    # JSON keeps where it stopped.
    assert ProbeResult.from_dict(json.loads(json.dumps(stopped.to_dict()))).stopping == stopped.stopping


def test_sequential_stopping_reads_everything_while_the_recommendation_moves():
    model = tiny_model("gpt2")
    batches = _label_noise_batches(model)
    # Patience longer than the data: never stops early, and says nothing.
    result = probe(model, batches, progress=False, stop_patience=10)
    assert result.num_batches == 6 and result.stopping is None
    # The trace holds what the stop watched, from the 3rd batch; its last entry is the result's recommendation.
    trace = result.recommendation_trace
    assert [t["batches"] for t in trace] == [3, 4, 5, 6]
    assert (trace[-1]["grow"], trace[-1]["positions"]) == (result.recommendation["grow"], list(result.recommendation["positions"]))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_stop_patience_must_be_a_positive_int(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="stop_patience"):
        probe(model, [tiny_inputs(model, seed=0)] * 4, progress=False, stop_patience=bad)
