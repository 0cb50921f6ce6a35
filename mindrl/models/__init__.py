"""Model construction (megatron-core GPTModel from a ModelArch) and weight layouts.

Import the submodules directly; this package stays light so the checkpoint converter
does not pay for importing megatron-core.
"""
