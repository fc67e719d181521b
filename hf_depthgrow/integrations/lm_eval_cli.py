"""lm-evaluation-harness's own command line, with the `depthgrow` PEFT method registered first.

`lm_eval --model hf --model_args pretrained=BASE,peft=ADAPTER` loads the adapter with
`PeftModel.from_pretrained`, which looks the adapter's `peft_type` up in peft's tables. A method that
lives outside peft is in those tables only once its package is imported, and neither peft (0.21) nor
lm-eval (0.4.13) offers a plugin hook (an entry-point group) through which a third-party method could
register itself in a process that never imported it: plain `lm_eval` stops with `KeyError: 'DEPTHGROW'`.
This module is that one step, then the harness's own `cli_evaluate` with the same arguments:

    python -m hf_depthgrow.integrations.lm_eval_cli --model hf \
        --model_args pretrained=BASE,peft=ADAPTER,dtype=float32 --tasks TASK --device cpu

Every argument is lm-eval's; nothing else changes. From Python, `import hf_depthgrow.integrations.peft_method`
before `lm_eval.simple_evaluate(model="hf", model_args="...,peft=ADAPTER")` does the same.
"""

from __future__ import annotations


def main() -> None:
    """Register `depthgrow` with peft, then run lm-eval's command line on `sys.argv`."""
    import hf_depthgrow.integrations.peft_method  # noqa: F401  (registers "depthgrow" with peft)

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        raise SystemExit(f"hf_depthgrow.integrations.lm_eval_cli needs lm-eval ({err}): pip install 'lm-eval>=0.4.13'") from None
    cli_evaluate()


if __name__ == "__main__":
    main()
