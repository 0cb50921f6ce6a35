"""The device check (scripts/device_check.sh): mindrl's Megatron path on an accelerator without Ray or vLLM — the
GPU-marked tests, HF parity of a dense, an MoE and a vision-language model in fp32 and bf16, the Megatron engine
against HF and the actor, offload, `bf16: auto`, and throughput beside a plain matmul — written as one JSON.

It lives beside the tests because it is their checks at other sizes, reusing their HF builders and helpers; with
`--device cpu` it runs at tiny sizes, and the suite runs it so (tests/test_device_check.py) so that it cannot rot
between the rare sessions that hold a GPU.
"""
