"""Registering depth growth with peft: the `PeftType` member and the mapping entries.

`peft.utils.register_peft_method` (peft >= 0.14) fills peft's four tables (config class, tuner
class, key prefix, mixed-model compatibility), but it first requires `name.upper()` to be a
member of `peft.utils.PeftType`, a closed `enum.Enum` that peft defines for its own methods only.
A method that lives outside peft therefore has to add its member first: `add_peft_type` does that
in place, the same way `enum` itself adds members while building the class (what `aenum.extend_enum`
does). Registering is idempotent: a second call (a re-import, `importlib.reload`) replaces this
package's own entries and never touches another method's.
"""

from __future__ import annotations

import enum

NAME = "depthgrow"  # peft method name: lower case, no trailing "_" (register_peft_method's rules)
PREFIX = "depthgrow_"  # adapter blocks are hosted as `depthgrow_pre` / `depthgrow_post`: the prefix names them


def add_peft_type(enum_cls: type[enum.Enum], name: str) -> enum.Enum:
    """Add member `name` (value `name`) to the str-valued enum `enum_cls`, or return it where it exists.

    Example:
        ```python
        >>> from peft.utils import PeftType
        >>> add_peft_type(PeftType, "DEPTHGROW") is PeftType.DEPTHGROW
        True
        ```
    """
    if name in enum_cls.__members__:
        return enum_cls[name]
    member = str.__new__(enum_cls, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    if hasattr(enum_cls, "_add_member_"):  # Python >= 3.13 has the hook the class body itself uses
        enum_cls._add_member_(name, member)
    else:
        # EnumType.__setattr__ refuses to rebind members only; the name is not a member yet.
        type.__setattr__(enum_cls, name, member)
        enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[name] = member
    return member


def peft_type():
    """`PeftType.DEPTHGROW`, added to peft's enum on first use.

    Example:
        ```python
        >>> peft_type().value
        'DEPTHGROW'
        ```
    """
    from peft.utils import PeftType

    return add_peft_type(PeftType, NAME.upper())


def register(config_cls: type, model_cls: type) -> None:
    """Register `config_cls`/`model_cls` as peft method `depthgrow`; calling it again is harmless.

    Example:
        ```python
        >>> register(DepthGrowConfig, DepthGrowModel)
        >>> register(DepthGrowConfig, DepthGrowModel)   # idempotent
        ```
    """
    from peft import mapping
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils import register_peft_method

    if not hasattr(BaseTuner, "_remap_adapter_state_dict_for_load"):
        # Older peft saves and loads with per-method branches in peft/utils/save_and_load.py, which no
        # method outside peft can extend; the tuner-class hooks came with huggingface/peft#3490.
        import peft

        raise ImportError(
            f"the depthgrow PEFT method needs a peft whose tuners save and load their own state dict "
            f"(BaseTuner._remap_adapter_state_dict_for_load; tested with 0.21.2), not {peft.__version__}: pip install -U peft"
        )
    member = peft_type()
    if mapping.PEFT_TYPE_TO_TUNER_MAPPING.get(member) is model_cls and mapping.PEFT_TYPE_TO_CONFIG_MAPPING.get(member) is config_cls:
        return
    # A reload defines new classes under the same name: drop this package's previous entries, which
    # register_peft_method would otherwise refuse as a duplicate.
    for table in (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, mapping.PEFT_TYPE_TO_TUNER_MAPPING, mapping.PEFT_TYPE_TO_MIXED_MODEL_MAPPING):
        table.pop(member, None)
    if mapping.PEFT_TYPE_TO_PREFIX_MAPPING.get(member) == PREFIX:
        del mapping.PEFT_TYPE_TO_PREFIX_MAPPING[member]
    # is_mixed_compatible stays False: PeftMixedModel accepts only the types hard-coded in
    # peft.tuners.mixed.COMPATIBLE_TUNER_TYPES and dispatches on their config classes.
    register_peft_method(name=NAME, config_cls=config_cls, model_cls=model_cls, prefix=PREFIX, is_mixed_compatible=False)
