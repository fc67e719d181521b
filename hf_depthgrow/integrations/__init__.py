"""Bridges to other libraries, each imported on demand so that `import hf_depthgrow` stays light.

- `peft_method`: depth growth as a registered PEFT method (`DepthGrowConfig`, `DepthGrowModel`):
  `peft.get_peft_model(model, DepthGrowConfig(positions=[2]))`, adapter-sized saves,
  `PeftModel.from_pretrained`, `disable_adapter()` and `merge_and_unload()`. Importing
  `hf_depthgrow.integrations.peft_method` registers the method with peft.
- `lm_eval_cli`: lm-eval's own command line with the method registered first, for a `depthgrow`
  adapter loaded by `--model_args pretrained=BASE,peft=ADAPTER` (plain `lm_eval` has no hook to find
  it): `python -m hf_depthgrow.integrations.lm_eval_cli --model hf --model_args ... --tasks ...`.

Example:
    ```python
    >>> from peft import get_peft_model
    >>> from hf_depthgrow.integrations.peft_method import DepthGrowConfig
    >>> peft_model = get_peft_model(model, DepthGrowConfig(positions=[2]))
    ```
"""
