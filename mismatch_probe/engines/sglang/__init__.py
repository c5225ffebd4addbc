"""The SGLang engines: `sglang` (a server, server.py) and `sglang-offline` (in-process, offline.py); fields.py is what both send and read."""
