"""The vLLM engines: `vllm` (a server, server.py) and `vllm-offline` (in-process, offline.py); logprob_mode.py is what both measure."""
