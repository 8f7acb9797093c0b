"""`kvsession bench`: programs that print figures, with the peers measured in the same run.

    engine.py       prefill, decode, save and load against llama.cpp (peer.py, run in the peer's Python)
    attention.py    the attention kernel alone against the machine's peak, and prefill and decode at long contexts
    store.py        the disk KV cache: prefix sharing, incremental puts, lookups
    shared.py       the shared tier: one Valkey node and a cluster
    server.py       a conversation over HTTP: cold, live, disk, shared tier
    concurrency.py  streams at once against llama-server
    infill.py       an editor's code completion (/infill) against llama-server
    grammar.py      constrained decoding's cost
    corpus.py       the text every benchmark prefills (data/corpus.txt)
    perplexity_peer.py  llama.cpp's perplexity, run in the peer's Python
"""
