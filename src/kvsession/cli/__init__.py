"""The command line: main.py parses and dispatches, one module per command that has logic of its own.

    main.py        `kvsession COMMAND`: the parser, every flag, `info`, `models`, `serve`, `bench`
    run.py         `kvsession run`: one prompt, --session to resume and save
    chat.py        `kvsession chat`: the REPL with /save /load /list /switch
    inspect.py     `kvsession inspect FILE`: a session file or raw export, checked
    cache.py       `kvsession cache ls|show|verify|stats|gc|clear`: the disk KV cache
    perplexity.py  `kvsession perplexity`: llama-perplexity's measure, against llama.cpp's
    diskprefix.py  run's and chat's use of the disk KV cache for their system prompt
    textfile.py    reading a prompt or document file, with a clear error
"""
