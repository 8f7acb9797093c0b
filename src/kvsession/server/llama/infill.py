"""Fill-in-the-middle prompts, laid out as llama-server lays them out (format_prompt_infill).

    <|repo_name|>myproject\\n                      the FIM repo-level pattern (Qwen2.5-Coder's tokens)
    <|file_sep|>{filename}\\n{text}  ...             each input_extra chunk, oldest first
    <|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

The extra context comes first, so the part an editor resends unchanged on
every keystroke (its ring of chunks from other files) is the prompt's
prefix, and the cursor's neighbourhood, which changes, comes last: the
live session keeps the chunks' KV from one request to the next. The
prefix keeps its last 3/4 of a batch of tokens, the suffix its first
quarter less the prompt; the chunks' tail fills what the context has left
after a batch and twice the reply. The batch is llama-server's default
(2,048 tokens), or a quarter of a smaller context, where llama-server's
would leave no room for the chunks at all. Texts are tokenized as text (a file
holding "<|fim_prefix|>" does not open a prefix); the tokens come from the
GGUF (text/tokenizer.py: FimTokens).
"""
from __future__ import annotations

from ...text.template import ChatPrompt
from ...text.tokenizer import Tokenizer
from ..protocol import ApiError
from .protocol import ExtraChunk

N_BATCH = 2048  # llama-server's default --batch-size, which sizes the prefix and the suffix
REPO = "myproject\n"  # llama-server's repository name (it takes none from the request)


def infill_prompt(tk: Tokenizer, prefix: str | list, suffix: str | list, extra: list[ExtraChunk], prompt: str,
                  n_ctx: int, n_predict: int) -> ChatPrompt:
    """The prompt's tokens, and its text with each client text marked as a literal (ChatPrompt.literals), so that
    a text re-tokenized from the middle (sessions.py's text match) keeps control-token text as text."""
    fim = tk.fim
    if not fim.infill:
        missing = [name for name, i in (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid)) if i is None]
        raise ApiError(400, f"infill is not supported by this model: it has no fill-in-the-middle {' or '.join(missing)}"
                       " token", "not_supported_error")
    pieces = Pieces(tk)
    if fim.rep is not None:
        pieces.control(fim.rep)
        pieces.text(REPO, literal=False)
    for chunk in extra:
        if fim.sep is not None:
            pieces.control(fim.sep)
            pieces.text(chunk.filename + "\n")
        else:  # llama-server's separator where the vocabulary has no file token
            pieces.text("\n\n--- snippet ---\n\n", literal=False)
        pieces.text(chunk.text)
    if fim.sep is not None:
        pieces.control(fim.sep)
        pieces.text("filename\n", literal=False)
    head = _mixed(tk, prefix, "input_prefix")
    tail = _mixed(tk, suffix, "input_suffix")
    typed = tk.encode(prompt, add_bos=False) if prompt else []
    batch = min(N_BATCH, n_ctx // 4)
    n_prefix = min(len(head), 3 * (batch // 4))
    n_suffix = min(len(tail), max(0, batch // 4 - (2 + len(typed))))
    n_extra = min(max(0, n_ctx - batch - 2 * max(n_predict, 0)), len(pieces.tokens))

    out = Pieces(tk)
    out.take_tail(pieces, n_extra)
    if tk.add_bos and tk.bos_id is not None:
        out.control(tk.bos_id)
    out.control(fim.pre)
    out.tokens_of(head[len(head) - n_prefix:], literal=True)
    out.tokens_of(typed, literal=False)
    out.control(fim.suf)
    out.tokens_of(tail[:n_suffix], literal=True)
    out.control(fim.mid)
    return ChatPrompt("".join(out.texts), out.tokens, tuple(out.literals))


def _mixed(tk: Tokenizer, value: str | list, field: str) -> list[int]:
    """A text, or token ids and texts mixed (llama-server's tokenize_mixed), each text tokenized as text."""
    parts = [value] if isinstance(value, str) else value
    n = tk.vocab_size
    tokens: list[int] = []
    for part in parts:
        if isinstance(part, str):
            tokens += tk.encode(part, add_bos=False, special=False)
        elif isinstance(part, int) and not isinstance(part, bool) and 0 <= part < n:
            tokens.append(part)
        else:
            raise ApiError(400, f"{field}: a text, or token ids (0 to {n - 1}) and texts", param=field)
    return tokens


class Pieces:
    """Tokens with their text alongside, and which spans of that text are a client's (literals)."""

    def __init__(self, tk: Tokenizer):
        self.tk = tk
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.literals: list[tuple[int, int]] = []
        self.marks: list[tuple[int, int, bool]] = []  # (first token, text offset, literal) of each piece
        self.chars = 0

    def control(self, token: int) -> None:
        self.tokens_of([token], literal=False)

    def text(self, text: str, *, literal: bool = True) -> None:
        self.tokens_of(self.tk.encode(text, add_bos=False, special=False), literal=literal)

    def tokens_of(self, tokens: list[int], *, literal: bool) -> None:
        if not tokens:
            return
        text = self.tk.decode(tokens)
        self.marks.append((len(self.tokens), self.chars, literal))
        if literal:
            self.literals.append((self.chars, self.chars + len(text)))
        self.tokens += tokens
        self.texts.append(text)
        self.chars += len(text)

    def take_tail(self, other: "Pieces", n: int) -> None:
        """The last n tokens of `other`, piece by piece (a piece cut at its start is re-decoded)."""
        start = len(other.tokens) - n
        for (first, _, literal), nxt in zip(other.marks, [m[0] for m in other.marks[1:]] + [len(other.tokens)]):
            if nxt <= start:
                continue
            self.tokens_of(other.tokens[max(first, start):nxt], literal=literal)
