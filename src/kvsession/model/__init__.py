"""The model: GGUF weights in, logits out. It never owns a cache (the session hands one in per layer).

    transformer.py   Model and Block: forward(tokens, positions, caches) and forward_many (batched decode)
    weights.py       GGUF tensors as Linears: kept in their blocks for the C kernels, or dense
    archs.py         the architecture table: per architecture its RoPE and what its file adds to the llama graph
    gguf.py          the GGUF reader: checked metadata and tensors, dequantization
    fingerprint.py   what a session file carries to refuse the wrong model, and the weights digest cache
    moe.py           mixture-of-experts routing
    ssm.py           the hybrids' recurrent layers: short convolution, Mamba2, gated DeltaNet (chunked scans)
    rope.py          rotary position tables (norm, neox, YaRN, per-dimension factors)
    cuda_graph.py    decode steps captured as CUDA graphs (on a GPU)

Import order: transformer > ssm > weights, cuda_graph > moe, rope > gguf > archs, fingerprint.
"""
