"""Text <-> token ids, built from a GGUF file's tokenizer metadata.

The `tokenizers` library does the work; this module only assembles it so
that ids equal llama.cpp's for the same file:

- gpt2-style BPE (`tokenizer.ggml.model = gpt2`): the file's vocabulary and
  merges, behind the pre-tokenizer regexes llama.cpp uses for its
  `tokenizer.ggml.pre`;
- SentencePiece-style (`llama`, Gemma's): llama.cpp merges the adjacent pair
  whose concatenation is the highest-scoring token, then falls back to
  <0xXX> byte tokens. That is BPE whose merges are every split of every
  token into two tokens, ranked by the whole token's score -- Hugging
  Face's SentencePieceExtractor construction -- over text whose spaces are
  written as U+2581;

and for both: control and user-defined tokens matched as whole tokens in
the text (llama.cpp's parse_special), the BOS rule from the metadata, and
the end-of-generation tokens found as llama.cpp finds them.

Text a user typed must not become a control token (`<|im_end|><|im_start|>
system` in a message would otherwise open a system turn): `encode(text,
special=False)` reads control-token text as plain text, and
`encode_guarded(text, literals)` does so only inside the given character
spans, so a rendered chat prompt keeps its template's control tokens while
its message contents stay text. User-defined tokens (Qwen's `<tool_call>`)
are matched in both, as llama.cpp and Hugging Face match them.
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import xxhash
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelFileError
from ..model.fingerprint import cache_dir
from ..model.gguf import GGUFFile

# token types in tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in order; the
# last one of each is the byte-level split itself.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (  # llama.cpp's rewrite of o200k's regex (runs of upper case, then lower case, by lookaheads)
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {}
for _names, _regexes in (
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2)),
    (("gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2,)),
    (("qwen2", "stablelm2", "deepseek-r1-qwen"), (_QWEN2,)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    (("gpt-4o", "llama4"), (_GPT4O,)),  # gpt-oss, Llama 4
):
    for _name in _names:
        PRE_TOKENIZERS[_name] = _regexes

# token texts llama.cpp treats as end of generation, besides the eos/eot/eom ids
EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
}
# gpt-oss's harmony markers: control tokens that llama.cpp renders as text (user-defined), so that a reply's
# channels and calls reach its parser; and where a vocabulary has <|return|> and <|call|> (o200k_harmony), its
# <|end|> ends a message, not the reply, and is rendered too (llama-vocab.cpp)
RENDERED_CONTROLS = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}
HARMONY_ENDS = {"<|return|>", "<|call|>"}


# fill-in-the-middle's tokens: the file's ids (tokenizer.ggml.fim_*_token_id, or the older prefix/suffix/middle
# keys), else the first of these texts the vocabulary has (llama-vocab.cpp's lists); they are control tokens, and
# pad, repo and file separator end a generation, as in llama.cpp
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_LEGACY_KEYS = {"pre": "prefix", "suf": "suffix", "mid": "middle"}


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens (None where it has none): prefix, suffix, middle, pad, the
    repository's name (Qwen2.5-Coder's <|repo_name|>) and the file separator."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def infill(self) -> bool:
        """Whether the model can fill in the middle: it has prefix, suffix and middle tokens."""
        return None not in (self.pre, self.suf, self.mid)


def fim_tokens(f: GGUFFile, tokens: list[str]) -> FimTokens:
    ids = {t: i for i, t in enumerate(tokens)}
    found = {}
    for kind, texts in FIM_TEXTS.items():
        i = f.meta(f"tokenizer.ggml.fim_{kind}_token_id")
        if i is None and kind in FIM_LEGACY_KEYS:
            i = f.meta(f"tokenizer.ggml.{FIM_LEGACY_KEYS[kind]}_token_id")
        if i is None:
            i = next((ids[t] for t in texts if t in ids), None)
        found[kind] = i if i is not None and 0 <= i < len(tokens) else None
    return FimTokens(**found)


class UnsupportedTokenizer(ModelFileError):
    pass


class Tokenizer:
    def __init__(self, f: GGUFFile):
        kind = f.meta("tokenizer.ggml.model")
        tokens: list[str] = f.meta("tokenizer.ggml.tokens") or []
        if not tokens:
            raise UnsupportedTokenizer(f"{f.path}: the file has no tokenizer vocabulary")
        types: list[int] = list(f.meta("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        rendered = RENDERED_CONTROLS | ({"<|end|>"} if HARMONY_ENDS <= set(tokens) else set())
        types = [USER_DEFINED if ty == CONTROL and t in rendered else ty for t, ty in zip(tokens, types)]
        self.fim = fim_tokens(f, tokens)
        for i in dataclasses.astuple(self.fim):
            if i is not None:
                types[i] = CONTROL
        if kind == "gpt2":
            tok = _gpt2_bpe(f, tokens)
            add_bos_default = False
        elif kind == "llama":
            tok = _sentencepiece(f, tokens)
            add_bos_default = True
        else:
            raise UnsupportedTokenizer(
                f"{f.path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
            )
        tok.add_tokens(
            [AddedToken(t, special=ty in (CONTROL, UNKNOWN), normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)]
        )
        self._tok = tok
        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.control = {i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)}
        self.bos_id: int | None = f.meta("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = f.meta("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(f.meta("tokenizer.ggml.add_bos_token", add_bos_default)) and self.bos_id is not None
        eog = {f.meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id")}
        eog |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS} | {self.fim.pad, self.fim.rep, self.fim.sep}
        self.eog_ids = frozenset(i for i in eog
                                 if i is not None and not (0 <= i < len(tokens) and tokens[i] in rendered))
        self.types = types
        self._kind = kind
        self._plain: HFTokenizer | None = None  # a copy that reads control-token text as text, made when first needed
        self._plain_lock = threading.Lock()

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; control tokens written in the text become their ids unless special=False."""
        return self._with_bos(_ids(self._tok if special else self._plain_tokenizer(), text), add_bos)

    def encode_guarded(self, text: str, literals: Sequence[tuple[int, int]], *,
                       add_bos: bool | None = None) -> list[int]:
        """`encode(text)`, except that control-token text inside the character spans [start, end) of `literals`
        stays plain text. Without control-token text in those spans the ids equal encode(text)'s."""
        if not any(self.control_pattern.search(text, a, b) for a, b in literals):
            return self.encode(text, add_bos=add_bos)
        # the template's own control tokens are the cut points, as the tokenizer's added-token split makes them;
        # each piece between them is encoded with control-token parsing off
        ids: list[int] = []
        start = pos = 0
        while (m := self.control_pattern.search(text, pos)) is not None:
            inside = next(((a, b) for a, b in literals if a < m.end() and m.start() < b), None)
            if inside is not None:  # control text typed in a message: skip it, look again after its first character
                pos = m.start() + 1
                continue
            if m.start() > start:
                ids += _ids(self._plain_tokenizer(), text[start:m.start()])
            ids.append(self._control_ids[m.group()])
            start = pos = m.end()
        if start < len(text):
            ids += _ids(self._plain_tokenizer(), text[start:])
        return self._with_bos(ids, add_bos)

    @cached_property
    def control_pattern(self) -> re.Pattern:
        """Matches the text of any control token, longest first (the tokenizer's leftmost-longest split)."""
        texts = sorted(self._control_ids, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts)) if texts else r"(?!)")

    @cached_property
    def _control_ids(self) -> dict[str, int]:
        return {self.tokens[i]: i for i in sorted(self.control) if self.tokens[i]}

    def _plain_tokenizer(self) -> HFTokenizer:
        with self._plain_lock:
            if self._plain is None:
                plain = HFTokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each token stands for (b"" for control tokens, which stand for none), as a grammar sees them."""
        out: list[bytes] = []
        if self._kind == "gpt2":
            byte_of = {c: b for b, c in _bytes_to_unicode().items()}
            for t, ty in zip(self.tokens, self.types):
                if ty in (CONTROL, UNKNOWN, UNUSED):
                    out.append(b"")
                elif ty == USER_DEFINED:
                    out.append(t.encode("utf-8"))
                else:
                    out.append(bytes(byte_of[c] for c in t) if all(c in byte_of for c in t) else t.encode("utf-8"))
        else:
            for t, ty in zip(self.tokens, self.types):
                if ty in (CONTROL, UNKNOWN, UNUSED):
                    out.append(b"")
                elif ty == BYTE and len(t) == 6 and t.startswith("<0x"):
                    out.append(bytes([int(t[3:5], 16)]))
                else:
                    out.append(t.replace("\u2581", " ").encode("utf-8"))
        return out

    def piece(self, token: int) -> bytes:
        """A token's bytes as a client is shown them (log-probabilities, /tokenize's pieces); a control token's
        name, which stands for no text."""
        raw = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        return raw or (self.tokens[token] if 0 <= token < len(self.tokens) else "").encode("utf-8")

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def agreeing_prefix(self, ids: Sequence[int], text: str, at_least: int = 0) -> tuple[int, int]:
        """The most leading ids whose text (control tokens as their names) begins `text`: (ids, characters).

        ds4's text match for a conversation that parted from a session: a model
        may sample a split that a fresh tokenization of the same text does not
        make (`[9207, 532, 73594]` where the text re-tokenizes as `[95642,
        73594]`), so the ids part while the text still agrees; the sampled ids
        are kept as far as their text does. `at_least` ids are known to agree.
        A binary search over decodes: the predicate fails only past the
        agreement, and at an id that ends inside a UTF-8 character (its text
        ends in U+FFFD), which is read as agreeing when what precedes it does.
        The text agrees no further than the ids' first U+FFFD (matching_text):
        bytes that are no character are not the U+FFFD a client sends back.
        """
        ids = list(ids)
        whole = self.decode(ids)
        if text.startswith(whole) and "\ufffd" not in whole:
            return len(ids), len(whole)
        limit = len(os.path.commonprefix([matching_text(whole), text]))

        def agrees(n: int) -> bool:
            piece = self.decode(ids[:n]).rstrip("\ufffd")
            return len(piece) <= limit and text.startswith(piece)

        lo, hi = at_least, len(ids) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if agrees(mid) else (lo, mid - 1)
        while lo > at_least and self.decode(ids[:lo]).endswith("\ufffd"):  # not inside a character
            lo -= 1
        return lo, len(self.decode(ids[:lo]))

    def stream(self, *, skip_special: bool = True) -> "TextStream":
        return TextStream(self, skip_special)


def matching_text(text: str) -> str:
    """What of a session's decoded text a client's text may match (ds4's text match): all of it up to its first
    U+FFFD. A sampled token can be part of a character, bytes that decode as U+FFFD; a client shown that reply
    sends the character U+FFFD back, which a fresh tokenization makes other tokens of (and a genuine U+FFFD in
    a reply is rare enough to pay a recomputation)."""
    cut = text.find("\ufffd")
    return text if cut < 0 else text[:cut]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character its vocabulary writes it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Encoding holds the GIL, encode_batch lets it go: a long text in a server's thread would otherwise stop its
# event loop for as long as it takes (seen: 90 ms for 240k characters of SmolLM2's, seconds for megabytes).
LONG_TEXT = 4096  # characters


def _ids(tok: HFTokenizer, text: str) -> list[int]:
    if len(text) > LONG_TEXT:
        return tok.encode_batch([text], add_special_tokens=False)[0].ids
    return tok.encode(text, add_special_tokens=False).ids


def _gpt2_bpe(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    pre = f.meta("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"{f.path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = [tuple(m.split(" ", 1)) for m in (f.meta("tokenizer.ggml.merges") or [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores: list[float] = f.meta("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise UnsupportedTokenizer(f"{f.path}: {len(scores)} token scores for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [(tokens[a], tokens[b]) for a, b in _sentencepiece_merges(tokens, scores, vocab)]
    unk = f.meta("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                 unk_token=tokens[unk] if unk is not None else None, fuse_unk=True))
    space = "\u2581"
    steps = [normalizers.Replace(" ", space)]
    strip = []
    if f.meta("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(space))
        strip = [decoders.Strip(" ", 1, 0)]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> np.ndarray:
    """A SentencePiece vocabulary as BPE merges [n, 2] (token ids), best first: every split of a token into
    two tokens, ranked by the whole token's score. Deriving them takes ~1.3 s for Gemma's 262k tokens, so
    they are cached (the cache folder's `merges/`), named by a digest of the tokens and scores."""
    key = xxhash.xxh3_128("\0".join(tokens).encode("utf-8", "surrogatepass"))
    key.update(np.asarray(scores, dtype="<f4").tobytes())
    path = cache_dir() / "merges" / f"{key.hexdigest()}.npy"
    try:
        merges = np.load(path, allow_pickle=False)
        if merges.dtype == np.int32 and merges.ndim == 2 and merges.shape[1] == 2 and \
                (merges.size == 0 or 0 <= merges.min() <= merges.max() < len(tokens)):
            return merges
    except (OSError, ValueError):
        pass
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right]))
    ranked.sort()
    merges = np.array([(a, b) for _, a, b in ranked], dtype=np.int32).reshape(-1, 2)
    try:  # a cache that cannot be written costs the next load the same work, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, merges)
        os.replace(tmp, path)
    except OSError:
        pass
    return merges


class TextStream:
    """Incremental detokenizer: feed ids one by one, get text that never splits a UTF-8 character.

    Bytes that do not (yet) form a character are held back; `finish()`
    returns what is still held, with U+FFFD for bytes that never completed
    one, so the streamed text always adds up to `decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def step(self, token: int) -> str:
        self._ids.append(token)
        text = self._stream.step(self._tokenizer._tok, token) or ""
        self._emitted += len(text)
        return text

    def finish(self) -> str:
        full = self._tokenizer.decode(self._ids, skip_special=self._skip_special)
        rest = full[self._emitted :]
        self._emitted = len(full)
        return rest
