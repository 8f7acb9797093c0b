"""Write a random-weight GGUF with the shapes of a model people run, to measure speed without downloading it.

    .venv/bin/python tools/random_model.py qwen3-30b-a3b /tmp/moe.gguf --layers 4
    .venv/bin/kvsession bench -m /tmp/moe.gguf --peer-python PYTHON --contexts 512

The file has the named model's widths, heads, experts and vocabulary size,
llama.cpp's tensor names and metadata keys (tests/tiny.py writes it), and
random weights in one block type (`--type`); `--layers` keeps the first N
layers of the shape (a step's time grows with them one for one), so that a
30B-A3B shape fits a small machine's memory and minutes. The tokenizer is
tests/tiny.py's byte-level one, padded with unused tokens to the vocabulary
size. Speed is all such a file is for: its text is noise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import TinySpec, write_tiny  # noqa: E402

SHAPES = {
    # Qwen3-30B-A3B and Qwen3-Coder-30B-A3B: 48 layers, 128 experts of which 8 a token
    "qwen3-30b-a3b": TinySpec(arch="qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                              d_ff=6144, experts=128, experts_used=8, d_ff_expert=768, vocab=151936,
                              context=40960, rope_base=1e6),
    "qwen3-8b": TinySpec(arch="qwen3", n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                         d_ff=12288, vocab=151936, context=40960, rope_base=1e6),
    "qwen2.5-7b": TinySpec(arch="qwen2", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, d_ff=18944,
                           vocab=152064, context=32768, rope_base=1e6),
    # gpt-oss-20b: 24 layers, every other one a window of 128, 32 experts of which 4 a token, in MXFP4, and its
    # own output head (llama.cpp requires one)
    # LFM2-1.2B (LiquidAI/LFM2-1.2B's config.json): 16 layers, attention at 2, 5, 8, 10, 12, 14, short convolutions
    # of 3 taps elsewhere
    "lfm2-1.2b": TinySpec(arch="lfm2", n_layers=16, layers="CCACCACCACACACAC", d_model=2048, n_heads=32, n_kv_heads=8,
                          d_ff=8192, ssm_conv=3, vocab=65536, context=128000, rope_base=1e6),
    # Granite-4.0-H-1B (ibm-granite/granite-4.0-h-1b's config.json): 40 layers, attention (no RoPE) at 5, 15, 25,
    # 35, Mamba2 elsewhere: 48 heads of 64, d_state 128, one group
    "granite-4.0-h-1b": TinySpec(arch="granitehybrid", n_layers=40, layers="MMMMMA" + "MMMMMMMMMA" * 3 + "MMMM",
                                 d_model=1536, n_heads=12, n_kv_heads=4, d_ff=4096, experts=0, ssm_heads=48,
                                 ssm_head_dim=64, ssm_state=128, ssm_groups=1, vocab=100352, context=131072),
    # NVIDIA-Nemotron-Nano-9B-v2: 56 layers, each one of Mamba2 (128 heads of 80, d_state 128, 8 groups), attention
    # without RoPE (40 heads of 128, 8 KV heads) or a squared-ReLU feed-forward network 15,680 wide; its
    # hybrid_override_pattern "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-" as recalled here, not
    # read from the file (27 Mamba2, 25 feed-forward, 4 attention layers, as published)
    "nemotron-nano-9b-v2": TinySpec(arch="nemotron_h", n_layers=56,
                                    layers="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-".replace(
                                        "-", "F").replace("*", "A"),
                                    d_model=4480, n_heads=40, n_kv_heads=8, head_dim=128, d_ff=15680, ssm_heads=128,
                                    ssm_head_dim=80, ssm_state=128, ssm_groups=8, vocab=131072, context=131072),
    # Qwen3.5-0.8B's published figures: 24 layers, 1,024 wide, gated attention (8 heads of 256, 2 KV heads, a
    # quarter of each head rotated, 3-axis M-RoPE) every fourth layer, gated DeltaNet elsewhere, a 248,320-token
    # vocabulary. Assumed, not published in what was at hand: DeltaNet's 16 key and 16 value heads of 128 and a
    # 3,584-wide feed-forward (the ratios of the larger Qwen3.5 configs)
    "qwen3.5-0.8b": TinySpec(arch="qwen35", n_layers=24, layers="DDDA" * 6, d_model=1024, n_heads=8, n_kv_heads=2,
                             head_dim=256, rope_dim=64, sections=(11, 11, 10, 0), d_ff=3584, ssm_state=128,
                             ssm_heads=16, ssm_groups=16, vocab=248320, context=262144, rope_base=1e7),
    # Falcon-H1-1.5B, its figures as recalled here, not read from a file: 24 layers, each attention (8 heads of
    # 128, 2 KV heads) beside a Mamba2 layer (24 heads of 128, d_state 256, one group) on the same input, a
    # 6,144-wide feed-forward, a 65,536-token vocabulary
    "falcon-h1-1.5b": TinySpec(arch="falcon-h1", n_layers=24, layers="A" * 24, d_model=2048, n_heads=8, n_kv_heads=2,
                               head_dim=128, d_ff=6144, ssm_heads=24, ssm_head_dim=128, ssm_state=256, ssm_groups=1,
                               vocab=65536, context=131072, rope_base=1e11, tied=False),
    # Qwen3.6-35B-A3B (and Qwen3.5-35B-A3B, the same shape), its figures as recalled here, not read from a file:
    # 40 layers, gated attention (16 heads of 256, 2 KV heads, a quarter of each head rotated) every fourth layer,
    # gated DeltaNet (16 key heads and 32 value heads of 128) elsewhere, 256 experts of 512 of which 8 a token
    # beside a gated shared expert of 512, a 248,320-token vocabulary
    "qwen3.6-35b-a3b": TinySpec(arch="qwen35moe", n_layers=40, layers="DDDA" * 10, d_model=2048, n_heads=16,
                                n_kv_heads=2, head_dim=256, rope_dim=64, sections=(11, 11, 10, 0), d_ff=512,
                                experts=256, experts_used=8, d_ff_expert=512, shared_expert=512, ssm_state=128,
                                ssm_heads=32, ssm_groups=16, vocab=248320, context=262144, rope_base=1e7,
                                tied=False),
    "gpt-oss-20b": TinySpec(arch="gpt-oss", n_layers=24, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                            d_ff=2880, experts=32, experts_used=4, d_ff_expert=2880, vocab=201088, context=131072,
                            rope_base=150000.0, yarn=32.0, sliding_window=128, expert_type="MXFP4", pre="gpt-4o",
                            tied=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--layers", type=int, default=0, help="the first N layers of the shape (0: all)")
    ap.add_argument("--type", default="Q4_0",
                    help="block type of the projections and experts (Q4_0, Q8_0, ...; gpt-oss's experts: MXFP4)")
    args = ap.parse_args()
    spec = SHAPES[args.shape]
    n = args.layers or spec.n_layers
    spec = spec.replace(weight_type=args.type, n_layers=n, layers=spec.layers[:n], noise=True)
    write_tiny(args.out, spec)
    print(f"wrote {args.out}: {args.shape}, {spec.n_layers} layers, {args.type}, {Path(args.out).stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
