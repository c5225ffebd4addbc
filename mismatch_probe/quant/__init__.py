"""Quantization of a loaded torch model, as production rollouts quantize it and as their kernels compute.

`formats.py` rounds to the element formats (e4m3fn, e2m1) and the power-of-two e8m0 scale; `blocks.py` cuts a
batch of matrices into blocks; `schemes.py` holds each weight scheme and the fp8 activation schemes;
`targets.py` says which parameters of a model are linear weights and which the skip list keeps; `operands.py`
keeps a quantized weight's float32 operands (and, for the kernel path, its codes and scales); `compute.py`
computes each product of a quantized module as the kernel does; `checkpoint.py` reads FP8 checkpoints;
`apply.py` puts it together; `kv.py` rounds the KV cache. docs/production-rollouts.md gives each rounding.
"""
