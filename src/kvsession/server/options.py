"""The server's settings, shared by the HTTP side (app.py) and the worker."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplerParams
from ..store import StoreOptions


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"  # an address, or several comma-separated (as llama-server's --host takes them)
    port: int = 8000
    ctx: int | None = None  # tokens per session (default: the model's context)
    kv_disk_dir: str | None = None  # the disk KV cache; None: no store
    store: StoreOptions = field(default_factory=StoreOptions)  # its policy, budget, row format, shared tier
    kv_disk_retry_seconds: float = 10.0  # while the store's folder fails, try it again this often
    api_keys: tuple[str, ...] = ()  # any of them is accepted; a stored response belongs to the one that made it
    sessions_dir: str | None = None  # named sessions (/v1/sessions)
    kv_dtype: str = "f16"
    live_kv_mb: int = 1024  # memory for the live sessions' KV; the least recently used leave first
    max_body_bytes: int = 16 << 20  # a bigger body is a 413 before it is read
    read_timeout: float = 30.0  # seconds a client has to send a request's headers, and again its body
    keepalive_seconds: float = 5.0
    max_tokens: int = 4096  # the reply limit of a request that names none (the room left in the context bounds it)
    max_chars_per_token: int = 8  # text over this many characters per context token: refused before tokenizing
    max_request_tokens: int = 65536  # n choices times their max_tokens, at most
    grammar_timeout: float = 10.0  # seconds a request's grammar (schema, tools, GBNF) may take to compile
    responses_space_mb: int = 256  # stored responses (the Responses API); the oldest leave first
    parallel: int = 4  # requests run at once (decoded together); the rest wait in arrival order
    step_tokens: int = 256  # prompt tokens a step prefills, between two decode steps of the others
    spec: str = "ngram"  # speculative decoding: "ngram" (drafts from the conversation, speculative.py) or "off"
    trace: str | None = None  # a file: one JSON line per request (where its prefix came from, speeds)
    cors: tuple[str, ...] = ()  # browser origins allowed to call the server; others are refused
    sampling: SamplerParams = SamplerParams()  # for the fields a request leaves out (Claude Code sends none)
    keep_billing_header: bool = False  # render Claude Code's x-anthropic-billing-header system block (anthropic.py)
    aliases: tuple[str, ...] = ()  # the model's names (llama-server's --alias; none: the file's stem)
    tags: tuple[str, ...] = ()  # labels /v1/models lists with the model (llama-server's --tags)
    metrics: bool = False  # GET /metrics (Prometheus), off by default as in llama-server
    slots_endpoint: bool = True  # GET /slots, on by default as in llama-server
    context_shift: bool = False  # a generation that reaches the context drops the oldest half after n_keep and goes on
    reasoning: str = "auto"  # on | off | auto: whether a thinking model thinks, unless a request's template variables say
    verbose: bool = False  # every chat completion carries __verbose, as llama-server's --verbose gives it
    webui: bool = True  # the chat page at / (webui/), as llama-server serves one; --no-ui: none, / is a 404
    embeddings: bool = False  # POST /v1/embeddings, /embedding(s) (embeddings.py); off as in llama-server
    pooling: str = "last"  # how an embedding pools its tokens' outputs: none, mean, cls, last

    @property
    def hosts(self) -> list[str]:
        """The addresses to bind, without IPv6's brackets."""
        return [h.strip().strip("[]") for h in self.host.split(",")]
