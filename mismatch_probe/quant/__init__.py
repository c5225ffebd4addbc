"""Fake quantization (quantize, then dequantize) of a loaded torch model, as production rollouts quantize it.

`formats.py` rounds to the element formats (e4m3fn, e2m1) and the power-of-two e8m0 scale; `blocks.py` cuts a
batch of matrices into blocks; `schemes.py` holds each weight scheme and the fp8 activation scheme;
`targets.py` says which parameters of a model are linear weights and which the skip list keeps; `apply.py`
quantizes them in place and hooks the activation quant. docs/production-rollouts.md gives each rounding.
"""
