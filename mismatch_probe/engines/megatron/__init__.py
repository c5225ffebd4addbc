"""The `megatron` training engine (megatron-core): the engine, its shims, R3 replay, split-vocabulary log-probs, adapters/."""
