"""`hf-depthgrow grow MODEL --positions 15 --out DIR`: grow a saved model and save it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..growth.engine import BLOCK_KINDS, INITS, GrowthConfig, grow_depth, growth_record
from ..hub.serialization import load_pretrained, save_pretrained


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-depthgrow grow", description=__doc__)
    parser.add_argument("model", help="local folder of a saved model (or a Hub id where the Hub is reachable)")
    parser.add_argument("--positions", type=int, nargs="+", required=True, help="insertion points k, 0 <= k <= L")
    parser.add_argument("--out", required=True, help="output folder (must not exist, or pass --overwrite)")
    parser.add_argument("--block", choices=BLOCK_KINDS, default="auto")
    parser.add_argument("--init", choices=INITS, default="copy")
    parser.add_argument("--eps", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        print(f"hf-depthgrow grow: {out} exists and is not empty; pass --overwrite to replace it", file=sys.stderr)
        return 2
    config = GrowthConfig(block=args.block, init=args.init, eps=args.eps, seed=args.seed)
    from .common import load_tokenizer_if_any

    model = load_pretrained(args.model)
    grow_depth(model, args.positions, config=config)
    save_pretrained(model, out, tokenizer=load_tokenizer_if_any(args.model))
    print(json.dumps(growth_record(model), indent=2))
    return 0
