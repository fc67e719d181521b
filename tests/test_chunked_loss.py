"""Chunked head + cross-entropy: the same per-example losses and gradients as the plain path, never a wrong one."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from hf_depthgrow import chunked_loss as cl
from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.chunked_loss import chunked_loss_status, chunked_token_losses, model_example_losses, resolve_chunk_size
from hf_depthgrow.evaluation import evaluate_delta
from hf_depthgrow.losses import IGNORE_INDEX, example_losses
from hf_depthgrow.probe.signal import probe
from hf_depthgrow.testing import tiny_inputs, tiny_model
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.trainer import train

VOCAB = 3000  # large enough that a chunk of 5 tokens is a small part of the logits
FAMILIES = {
    "llama": {},
    "gemma2": {"final_logit_softcapping": 3.0},  # a small cap: logits of a tiny model reach it
    "qwen2": {},
}


def _batch(model, seed=0):
    """Three rows with a masked prompt, right padding (mask 0, labels -100) and one row almost unsupervised."""
    batch = tiny_inputs(model, batch=3, seq=14, seed=seed)
    labels = batch.pop("labels")
    labels[0, :5] = IGNORE_INDEX
    batch["attention_mask"][1, 9:] = 0
    labels[1, 9:] = IGNORE_INDEX
    labels[2, 2:] = IGNORE_INDEX  # one supervised next token
    return batch, labels


def _grads(model, loss) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}


def _assert_grads_close(got: dict, ref: dict, exact: dict) -> None:
    """Chunked gradients are within 1e-6 of the fp64 ones, or at most twice as far as the plain fp32 ones are.

    Elementwise, relative to max(1, the parameter's largest gradient entry). The plain fp32 path itself
    is up to ~1e-6 from fp64 here (rounding amplified through the layers), so "equal to plain within
    1e-6" would test that noise: what must hold is that chunking adds no error beyond fp32 rounding.
    """
    assert got.keys() == ref.keys() == exact.keys()
    for name, g64 in exact.items():
        scale = max(1.0, float(g64.abs().max()))
        err_chunked = float((got[name].double() - g64).abs().max()) / scale
        err_plain = float((ref[name].double() - g64).abs().max()) / scale
        assert err_chunked <= 2 * max(err_plain, 1e-6), (name, err_chunked, err_plain)


def _plain(model, batch, labels):
    return example_losses(model(**batch).logits, labels, causal=True)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("trainable", ["all", "new", "tied"])
def test_chunked_equals_plain_values_and_gradients(model_type, trainable):
    overrides = {**FAMILIES[model_type], "vocab_size": VOCAB, "tie_word_embeddings": trainable == "tied"}
    model = grow_depth(tiny_model(model_type, **overrides), [1])
    if trainable == "new":  # the head is frozen: only the gradient to the hidden states flows back
        new = {id(p) for _, p in new_block_parameters(model)}
        for p in model.parameters():
            p.requires_grad_(id(p) in new)
    batch, labels = _batch(model)
    ref = _plain(model, batch, labels)
    got = model_example_losses(model, batch, labels, causal=True, chunk_size=5)
    assert chunked_loss_status(model) == ""  # the self-check passed: the chunked path ran
    assert torch.equal(got.weight, ref.weight) and got.weight.tolist() == [9.0, 8.0, 1.0]
    # Per-token mean loss within 1e-6 (plus 1e-6 relative: a few fp32 ulps). Not the summed totals at
    # 1e-6: an example's total (~64 here) has an fp32 ulp of 7.6e-6, and which way the last bit rounds
    # depends on the CPU's matmul kernels (AVX2 and AVX-512 differ).
    assert torch.allclose((got.total / got.weight).detach(), (ref.total / ref.weight).detach(), rtol=1e-6, atol=1e-6)
    # Token-weighted mean (the trainer's, the same upstream gradient for every token) and a mean of
    # per-example means (a different one per example: the weight gradient is recomputed chunk by chunk).
    exact_model = copy.deepcopy(model).double()
    for reduce in (lambda el: el.total.sum() / el.weight.sum(), lambda el: el.per_example.mean()):
        ref = _grads(model, reduce(_plain(model, batch, labels)))
        got = _grads(model, reduce(model_example_losses(model, batch, labels, causal=True, chunk_size=5)))
        _assert_grads_close(got, ref, _grads(exact_model, reduce(_plain(exact_model, batch, labels))))


def test_logits_are_never_held_for_more_than_one_chunk(monkeypatch):
    model = grow_depth(tiny_model("gemma2", vocab_size=VOCAB), [1])
    batch, labels = _batch(model)
    model_example_losses(model, batch, labels, causal=True, chunk_size=4)  # first call: the self-check
    rows, positions = [], []
    real = cl.logit_transform(model)
    monkeypatch.setattr(cl, "logit_transform", lambda m: lambda x: rows.append(x.shape[0]) or real(x))
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: positions.append(out.shape[1]))
    try:
        el = model_example_losses(model, batch, labels, causal=True, chunk_size=4)
        (el.total.sum() / el.weight.sum()).backward()
    finally:
        handle.remove()
    assert positions == [1]  # the model's own head saw one position per row
    assert rows and max(rows) <= 4 and sum(rows) == 18  # every supervised token once, 4 at a time


class _DoubledLogits(nn.Module):
    """A causal LM whose forward scales the head's logits: a transform `logit_transform` does not know."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def get_decoder(self):
        return self.inner.get_decoder()

    def forward(self, logits_to_keep=0, **kwargs):
        out = self.inner(logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_unknown_transform_falls_back_with_a_warning_once():
    model = _DoubledLogits(tiny_model("llama", vocab_size=VOCAB))
    batch, labels = _batch(model)
    with pytest.warns(UserWarning, match=r"chunked cross-entropy is off .* differ from the model's own"):
        got = model_example_losses(model, batch, labels, causal=True, chunk_size=5)
    assert torch.equal(got.total, _plain(model, batch, labels).total)  # the plain loss, not a wrong one
    assert "logit transform" in chunked_loss_status(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per model: no second warning, still plain
        again = model_example_losses(model, batch, labels, causal=True, chunk_size=5)
    assert torch.equal(again.total, got.total)


def test_a_head_that_is_not_linear_falls_back():
    model = tiny_model("llama", vocab_size=VOCAB)
    model.lm_head = nn.Sequential(model.lm_head)
    batch, labels = _batch(model)
    with pytest.warns(UserWarning, match="not an nn.Linear"):
        got = model_example_losses(model, batch, labels, causal=True, chunk_size=5)
    assert torch.equal(got.total, _plain(model, batch, labels).total)


def test_no_supervised_token_gives_zero_and_a_graph():
    model = tiny_model("llama", vocab_size=VOCAB)
    batch, labels = _batch(model)
    masked = torch.full_like(labels, IGNORE_INDEX)
    for status in (None, ""):  # before the self-check (nothing to check on: undecided), and after it
        got = model_example_losses(model, batch, masked, causal=True, chunk_size=5)
        assert got.total.tolist() == [0.0, 0.0, 0.0] and got.weight.tolist() == [0.0, 0.0, 0.0]
        got.total.sum().backward()  # what the trainer does with an all-masked micro-batch
        assert float(model.lm_head.weight.grad.abs().max()) == 0.0
        assert chunked_loss_status(model) == status
        model_example_losses(model, batch, labels, causal=True, chunk_size=5)
    assert chunked_loss_status(model) == ""


def test_chunk_size_rule():
    assert resolve_chunk_size(None, 10**6, 10**6) is None
    assert resolve_chunk_size(7, 1, 1) == 7
    assert resolve_chunk_size("auto", 127, 128) is None  # tiny: the plain path
    assert resolve_chunk_size("auto", 512, 49152) == cl.CHUNK_ELEMENTS // 49152  # SmolLM2 at 512 tokens
    assert resolve_chunk_size("auto", 512, 262144) == cl.MIN_CHUNK_TOKENS
    for bad in (0, -1, 2.5, True, "big"):
        with pytest.raises(ValueError, match="chunk_size"):
            resolve_chunk_size(bad, 10, 10)


def test_chunked_token_losses_without_grad_and_with_bias():
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(6, 50)
    hidden = torch.randn(9, 6, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=g)
    ref = nn.functional.cross_entropy(head(hidden), targets, reduction="none")
    got = chunked_token_losses(hidden, targets, head, chunk=2)
    assert float((got - ref).detach().abs().max()) <= 1e-6
    weights = torch.rand(9, generator=g)  # a different upstream gradient per token
    ref_g = torch.autograd.grad((ref * weights).sum(), [hidden, head.weight, head.bias])
    got_g = torch.autograd.grad((got * weights).sum(), [hidden, head.weight, head.bias])
    for a, b in zip(got_g, ref_g):
        assert float((a - b).abs().max()) <= 1e-6
    with torch.no_grad():  # no gradient work at all, the same values
        assert float((chunked_token_losses(hidden, targets, head, chunk=4) - ref).abs().max()) <= 1e-6


def _matmuls(fn) -> int:
    """How many matrix products `fn()` runs (every mm / addmm / linear kernel, in place or not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "bmm", "matmul", "linear"):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_no_gradient_work_under_no_grad_even_for_trainable_weights():
    # Regression: autograd.Function sees `requires_grad`, not the grad mode, so every evaluation of a model with
    # trainable weights (under no_grad) also computed d_hidden and the head's weight gradient: 3 matmuls a chunk.
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(6, 50)  # its weight requires grad, as a model's does outside a frozen phase
    hidden = torch.randn(8, 6, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (8,), generator=g)
    with torch.no_grad():
        assert _matmuls(lambda: chunked_token_losses(hidden, targets, head, chunk=2)) == 4  # one head product a chunk
        got = chunked_token_losses(hidden, targets, head, chunk=2)
    assert not got.requires_grad
    ref = nn.functional.cross_entropy(head(hidden), targets, reduction="none")
    assert float((got - ref).detach().abs().max()) <= 1e-6
    # With grad on, the gradients are precomputed in the same chunk loop (3 products a chunk), as before.
    assert _matmuls(lambda: chunked_token_losses(hidden, targets, head, chunk=2)) == 12


# ----------------------------------------------------------------------------- wired into trainer, probe, evaluator


def _force_chunks(monkeypatch, chunk: int) -> None:
    """'auto' chunks every batch, `chunk` tokens at a time (tiny models are far below the real threshold)."""
    monkeypatch.setattr(cl, "AUTO_MIN_ELEMENTS", 1)
    monkeypatch.setattr(cl, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(cl, "MIN_CHUNK_TOKENS", chunk)


def _lm_rows(n, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, seq), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


@pytest.mark.parametrize("trainable, cache", [("new", "memory"), ("full", "off")])
def test_trainer_takes_the_same_steps(monkeypatch, trainable, cache):
    data, runs = _lm_rows(12), {}
    base = grow_depth(tiny_model("llama", vocab_size=VOCAB), [2])
    chunks = []
    real = cl.chunked_token_losses
    monkeypatch.setattr(cl, "chunked_token_losses", lambda *a, chunk, **k: chunks.append(chunk) or real(*a, chunk=chunk, **k))
    # TrainConfig's flag: "off" is the plain head; "on" with 7 tokens per chunk chunks this small vocabulary too
    for mode, flags in (("plain", {"chunked_loss": "off"}), ("chunked", {"chunked_loss": "on", "loss_chunk_size": 7})):
        model = copy.deepcopy(base)
        cfg = TrainConfig(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, progress_bar=False,
                          fallback=mode == "chunked", trainable=trainable, prefix_cache=cache, **flags)
        result = train(model, data, config=cfg)
        assert (result.prefix_cache is not None) == (cache == "memory")  # start_at runs the body from the cache
        assert chunked_loss_status(model) == ("" if mode == "chunked" else None)
        assert set(chunks) == ({7} if mode == "chunked" else set())  # training and the fallback's passes took the flag
        runs[mode] = ([h["loss"] for h in result.history], dict(result.model.named_parameters()))
    assert runs["chunked"][0] == pytest.approx(runs["plain"][0], rel=1e-6)
    for name, p in runs["plain"][1].items():
        # AdamW divides by sqrt(v): an entry whose gradient is near zero moves by up to lr = 1e-2 on fp32
        # rounding alone, so weights agree to 1e-4 (1% of one step), not to 1e-6.
        torch.testing.assert_close(runs["chunked"][1][name], p, rtol=1e-5, atol=1e-4)


def test_train_config_checks_the_chunked_loss_flags():
    assert TrainConfig().loss_chunk == "auto"
    assert TrainConfig(chunked_loss="off").loss_chunk is None
    assert TrainConfig(chunked_loss="on").loss_chunk == "on"
    assert TrainConfig(chunked_loss="on", loss_chunk_size=64).loss_chunk == 64
    vocab = 1 << 20  # the automatic size is then the minimum chunk
    assert resolve_chunk_size("on", 1, vocab) == cl.MIN_CHUNK_TOKENS  # "on" chunks even where "auto" would not
    assert resolve_chunk_size("auto", 1, vocab) is None
    with pytest.raises(ValueError, match="chunked_loss must be one of"):
        TrainConfig(chunked_loss="yes")
    with pytest.raises(ValueError, match="loss_chunk_size must be an int >= 1"):
        TrainConfig(loss_chunk_size=0)
    with pytest.raises(ValueError, match="but chunked_loss is 'off'"):
        TrainConfig(chunked_loss="off", loss_chunk_size=8)


def test_probe_signal_is_the_same(monkeypatch):
    model = tiny_model("gemma2", vocab_size=VOCAB, final_logit_softcapping=3.0)
    batches = [tiny_inputs(model, batch=2, seq=10, seed=s) for s in range(4)]
    plain = probe(model, batches, chunk_size=None, progress=False)
    chunked = probe(model, batches, chunk_size=3, progress=False)
    assert chunked_loss_status(model) == ""
    assert chunked.loss == pytest.approx(plain.loss, rel=1e-6)
    assert chunked.signal == pytest.approx(plain.signal, rel=1e-5)
    assert chunked.z == pytest.approx(plain.z, rel=1e-4, abs=1e-6)


@pytest.mark.filterwarnings("ignore:loss_bound not given")
def test_paired_evaluation_is_the_same():
    grown = grow_depth(tiny_model("qwen2", vocab_size=VOCAB), [2], init="random")
    with torch.no_grad():
        for _, p in new_block_parameters(grown):
            p.add_(0.05)
    batch, labels = _batch(grown)
    rows = [{"input_ids": batch["input_ids"][i], "attention_mask": batch["attention_mask"][i], "labels": labels[i]} for i in range(3)]
    kw = dict(batch_size=2, n_bootstrap=50, use_evaluate=False)
    plain, chunked = evaluate_delta(grown, rows, chunk_size=None, **kw), evaluate_delta(grown, rows, chunk_size=2, **kw)
    assert chunked_loss_status(grown) == ""
    assert chunked.per_example_old == pytest.approx(plain.per_example_old, abs=1e-6)
    assert chunked.per_example_new == pytest.approx(plain.per_example_new, abs=1e-6)
    assert chunked.per_example_new != pytest.approx(chunked.per_example_old, abs=1e-3)  # the two models differ


def test_through_a_ddp_wrapper(tmp_path):
    """The trainer calls the DDP-wrapped model: the body runs through the wrapper, gradients reach the reducer."""
    import torch.distributed as dist

    model = grow_depth(tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=True), [1])
    batch, labels = _batch(model)
    ref = _grads(model, _plain(model, batch, labels).total.sum())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model)
        el = model_example_losses(model, batch, labels, causal=True, chunk_size=5, module=wrapped)
        el.total.sum().backward()
    finally:
        dist.destroy_process_group()
    assert chunked_loss_status(model) == ""
    got = {n: p.grad for n, p in model.named_parameters()}
    for name, g in ref.items():
        assert float((got[name] - g).abs().max()) <= 1e-5 * max(1.0, float(g.abs().max())), name
