"""The loss head of a pass without gradients (evaluation, line search, fallback rule): plain vs chunked.

    python benchmarks/bench_eval_head.py --write-results            # SmolLM2-135M, 4 batches of 8 x 64 tokens
    python benchmarks/bench_eval_head.py --model tiny --repeats 1   # CPU smoke run (what CI runs)

Every evidence pass of a run (the stepping stones' line search, the fallback rule's training losses, held-out and
test evaluation, retention) scores a model under `torch.no_grad()` whose weights still require grad. Timed, on the
same batches, interleaved, medians over `--repeats`:

- `plain`: `model_example_losses(..., chunk_size=None)`, the full logits (what a user's own loop computes);
- `chunked`: `chunk_size="auto"` (the default everywhere), which under no_grad runs only the head's forward;
- `chunked, weight gradient`: the chunked head with its weight gradient computed on the same hidden states:
  the work every such pass did before 2026-12-04, when the chunked head took `requires_grad` for a request
  for gradients (an `autograd.Function` sees the flag, not the grad mode).

`whole pass` rows time the model's forward with the loss (body included); `head only` rows time the head and the
loss on the decoder's hidden states, computed once. Losses of all three are checked to agree within 1e-5.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md helpers next to this script
from results_file import command_line, publish  # noqa: E402

SECTION = "## Evaluation head: the chunked loss without gradients"
VARIANTS = ("plain", "chunked", "chunked, weight gradient")


def load(args):
    """`(model, batches)`: the model in eval mode (weights requiring grad, as loaded) and `--batches` batches."""
    if args.model == "tiny":
        from hf_depthgrow.testing import tiny_model

        model = tiny_model("llama", vocab_size=4096)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, 4096, (args.batches * args.batch, args.seq), generator=g)
        rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    else:
        from hf_depthgrow import load_model
        from hf_depthgrow.data import load_data

        model, tokenizer = load_model("smollm2")
        rows = load_data("shakespeare", model=model, tokenizer=tokenizer, block_size=args.seq, max_examples=args.batches * args.batch)
    model.eval()
    batches = []
    for b in range(args.batches):
        chunk = [rows[i] for i in range(b * args.batch, (b + 1) * args.batch)]  # a list or a Dataset
        batches.append({k: torch.stack([torch.as_tensor(r[k]) for r in chunk]) for k in ("input_ids", "attention_mask", "labels")})
    return model, batches


def whole_pass(model, batches, variant: str, chunk: int) -> tuple[float, float]:
    """`(seconds, summed loss)` of the model's forward with the loss on every batch, under no_grad."""
    from hf_depthgrow.chunked_loss import model_example_losses

    total, start = 0.0, time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            if variant == "chunked, weight gradient":
                hidden = model.get_decoder()(**inputs).last_hidden_state
                total += float(head_losses(model, hidden, batch["labels"], variant, chunk).sum())
                continue
            size = None if variant == "plain" else chunk
            total += float(model_example_losses(model, inputs, batch["labels"], causal=True, chunk_size=size).total.sum())
    return time.perf_counter() - start, total


def head_losses(model, hidden, labels, variant: str, chunk: int) -> torch.Tensor:
    """Token losses of the head on `hidden` `[batch, seq, d]` against the next-token labels."""
    from hf_depthgrow.chunked_loss import chunked_token_losses

    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    head = model.get_output_embeddings()
    if variant == "plain":
        return torch.nn.functional.cross_entropy(head(flat).float(), targets, reduction="none")
    if variant == "chunked":
        return chunked_token_losses(flat, targets, head, chunk=chunk)
    with torch.enable_grad():  # the weight requires grad: the chunked forward precomputes its gradient
        return chunked_token_losses(flat.detach(), targets, head, chunk=chunk).detach()


def head_only(model, hiddens, batches, variant: str, chunk: int) -> tuple[float, float]:
    total, start = 0.0, time.perf_counter()
    with torch.no_grad():
        for hidden, batch in zip(hiddens, batches):
            total += float(head_losses(model, hidden, batch["labels"], variant, chunk).sum())
    return time.perf_counter() - start, total


def measure(args) -> dict:
    from hf_depthgrow.chunked_loss import resolve_chunk_size

    model, batches = load(args)
    tokens = batches[0]["labels"][:, 1:].numel()
    chunk = resolve_chunk_size("on", tokens, model.config.vocab_size)
    with torch.no_grad():
        hiddens = [model.get_decoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state for b in batches]
    runs = {(kind, v): [] for kind in ("whole pass", "head only") for v in VARIANTS}
    losses = {}
    whole_pass(model, batches, "chunked", chunk)  # warm-up (and the chunked path's one-off self-check)
    for r in range(args.repeats):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # rotate, so drift in the machine's load hits all alike
        for variant in order:
            for kind, fn in (("whole pass", lambda v: whole_pass(model, batches, v, chunk)),
                             ("head only", lambda v: head_only(model, hiddens, batches, v, chunk))):
                seconds, loss = fn(variant)
                runs[kind, variant].append(seconds)
                losses[kind, variant] = loss
    for kind in ("whole pass", "head only"):
        ref = losses[kind, "plain"]
        for v in VARIANTS:
            if abs(losses[kind, v] - ref) > 1e-5 * max(1.0, abs(ref)):
                raise RuntimeError(f"{kind}: {v} gives loss {losses[kind, v]}, plain {ref}")
    return {"runs": runs, "chunk": chunk, "tokens": tokens, "vocab": model.config.vocab_size}


def markdown(result: dict, args, command: str) -> str:
    runs = result["runs"]
    lines = [
        SECTION, "",
        f"Command ({date.today().isoformat()}): `{command}`", "",
        f"{'SmolLM2-135M-Instruct (fp32, vocabulary 49152)' if args.model == 'smollm2' else 'tiny random Llama'}, "
        f"{args.batches} batches of {args.batch} x {args.seq} tokens (Shakespeare for SmolLM2), chunks of {result['chunk']} "
        f"tokens; {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads. Median wall seconds "
        f"of {args.repeats} interleaved repeats; every variant's loss equals the plain one within 1e-5.", "",
        "| pass | variant | median s | runs (s) | vs plain | vs chunked, weight gradient |",
        "|---|---|---:|---|---:|---:|",
    ]
    for kind in ("whole pass", "head only"):
        med = {v: statistics.median(runs[kind, v]) for v in VARIANTS}
        for v in VARIANTS:
            cells = ", ".join(f"{t:.3f}" for t in runs[kind, v])
            lines.append(f"| {kind} | {v} | {med[v]:.3f} | {cells} | {med['plain'] / med[v]:.2f}x | "
                         f"{med['chunked, weight gradient'] / med[v]:.2f}x |")
    lines += ["", "'vs X' is X's median time over this row's: above 1, this row is faster."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    if min(args.batches, args.batch, args.repeats) < 1 or args.seq < 2:
        p.error("--batches, --batch and --repeats must be at least 1, --seq at least 2")
    result = measure(args)
    publish(args, SECTION, markdown(result, args, command_line("bench_eval_head.py", argv)))
    return result


if __name__ == "__main__":
    main()
