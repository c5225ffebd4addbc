"""What the sglang and vllm engines share: the HTTP client, the server and in-process bases, answer -> record."""
