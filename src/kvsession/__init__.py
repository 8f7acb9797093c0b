"""kvsession: local LLM inference whose KV cache is a first-class disk citizen."""
from __future__ import annotations

__version__ = "0.1.0"
