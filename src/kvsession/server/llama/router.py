"""llama-server's own routes: POST /completion, /completions, /infill, /tokenize, /detokenize, /apply-template; GET
/props, /slots, /metrics; POST /slots/{id}?action=save|restore|erase.

Each goes through the same guard as every route (Host, Origin, content
type, API key) and answers errors in llama-server's shape
({"error": {"code", "message", "type"}}; protocol.error_shape). Slots are
the running set's lanes (--parallel): /slots shows each with the request in
it, and the live session it ran last; saving a slot writes that session as
a named session (the filename is its name, checked as every name is:
--slot-save-path is --sessions-dir), restoring one loads a named session
into the live sessions, where requests find it by prefix as they find any.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from ...errors import TemplateError
from ..http.bodies import BodyRouter
from ..protocol import BUILD, ApiError
from ..serving import Frontend, frontend
from . import completion, infill, metrics
from .protocol import (
    ApplyTemplateRequest,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    SlotAction,
    SlotFile,
    TokenizeRequest,
)

router = BodyRouter()


async def _completion(request: Request):
    fe = frontend(request)
    req = await fe.body(request, CompletionRequest)
    return await completion.answer(fe, request, req, await completion.prompts(fe, req.prompt), "completion")


router.body_post("/completion", CompletionRequest)(_completion)
router.body_post("/completions", CompletionRequest)(_completion)


@router.body_post("/infill", InfillRequest)
async def infill_route(request: Request):
    fe = frontend(request)
    req = await fe.body(request, InfillRequest)
    texts = [req.input_prefix, req.input_suffix, req.prompt] + [c.text + c.filename for c in req.input_extra]
    fe.check_length(sum(len(t) if isinstance(t, str) else len(str(t)) for t in texts), "input_extra")
    n_predict = req.n if req.n >= 0 else 0
    prompt = await fe.off_loop(infill.infill_prompt, fe.engine.tokenizer, req.input_prefix, req.input_suffix,
                               req.input_extra, req.prompt, fe.worker.ctx, n_predict)
    return await completion.answer(fe, request, req, [prompt], "infill")


@router.body_post("/tokenize", TokenizeRequest)
async def tokenize(request: Request):
    fe = frontend(request)
    req = await fe.body(request, TokenizeRequest)
    fe.check_length(len(req.content), "content")
    tk = fe.engine.tokenizer
    # add_special adds the special tokens the model's vocabulary asks for (a BOS where add_bos_token says so), as
    # llama-server's does; never one the model does not use
    add_bos = None if req.add_special else False
    tokens = await fe.off_loop(lambda: tk.encode(req.content, add_bos=add_bos, special=req.parse_special))
    if not req.with_pieces:
        return {"tokens": tokens}
    pieces = []
    for t in tokens:
        raw = tk.piece(t)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return {"tokens": pieces}


@router.body_post("/detokenize", DetokenizeRequest)
async def detokenize(request: Request):
    fe = frontend(request)
    req = await fe.body(request, DetokenizeRequest)
    n = fe.engine.config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < n), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is outside the vocabulary of {n}", param="tokens")
    return {"content": await fe.off_loop(fe.engine.tokenizer.decode, req.tokens)}


@router.body_post("/apply-template", ApplyTemplateRequest)
async def apply_template(request: Request):
    """The prompt the chat template renders for these messages (and tools), as chat completions would send it."""
    fe = frontend(request)
    req = await fe.body(request, ApplyTemplateRequest)
    variables = fe.reasoning_variables(fe.template_variables(req.chat_template_kwargs))

    def render() -> str:
        fe.check_length(len(str(req.messages)) + len(str(req.tools or "")), "messages")
        messages = [{**m, "content": _text(m.get("content"))} for m in req.messages]
        try:
            text = fe.engine.template.render(messages, tools=req.tools or None,
                                             add_generation_prompt=req.add_generation_prompt, variables=variables)
        except TemplateError as e:  # the template's own refusal, or a malformed message
            raise ApiError(400, f"messages: {e}", param="messages") from None
        return text + fe.reasoning_close(text, variables)

    return {"prompt": await fe.off_loop(render)}


def _text(content):
    """A message's content as the template takes it: text parts joined (OpenAI's list form)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


@router.get("/props")
async def props(request: Request):
    fe = frontend(request)
    tk = fe.engine.tokenizer
    engine = fe.engine
    return {
        "default_generation_settings": {"n_ctx": fe.worker.ctx, "params": _defaults(fe)},
        "total_slots": fe.options.parallel, "model_alias": fe.model_id, "model_path": str(engine.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": fe.options.slots_endpoint, "endpoint_props": False,
        "endpoint_metrics": fe.options.metrics, "ui": False, "chat_template": engine.template.source,
        "bos_token": tk.tokens[tk.bos_id] if tk.bos_id is not None else "",
        "eos_token": tk.tokens[tk.eos_id] if tk.eos_id is not None else "",
        "build_info": BUILD, "is_sleeping": False,
        "infill": tk.fim.infill,
    }


def _defaults(fe: Frontend) -> dict:
    d = fe.options.sampling
    return {"seed": d.seed if d.seed is not None else -1, "temperature": d.temperature, "top_k": d.top_k,
            "top_p": d.top_p, "min_p": d.min_p, "n_predict": fe.options.max_tokens, "max_tokens": fe.options.max_tokens,
            "stream": False, "n_probs": 0, "samplers": ["top_k", "top_p", "min_p", "temperature"],
            "speculative.types": "ngram" if fe.options.spec == "ngram" else "none"}


@router.get("/slots")
async def slots(request: Request):
    fe = frontend(request)
    if not fe.options.slots_endpoint:
        raise ApiError(501, "this server does not serve /slots: it was started with --no-slots", "not_supported_error")
    w = fe.worker
    out = []
    for i in range(fe.options.parallel):
        r = w.slots[i]
        live = r.live if r is not None else w.slot_session(i)
        entry = {"id": i, "n_ctx": w.ctx, "speculative": fe.options.spec == "ngram", "is_processing": r is not None,
                 "n_tokens": len(live.session) if live is not None else 0}
        if r is not None:
            c = r.choices[0] if r.choices else None
            decoded = c.stats.generated_tokens if c is not None else 0
            entry["n_prompt_tokens"] = r.total
            entry["n_prompt_tokens_cache"] = r.reuse.tokens
            entry["next_token"] = [{"has_next_token": True, "has_new_line": False,
                                    "n_remain": r.g.max_tokens - decoded, "n_decoded": decoded}]
        elif live is not None:
            entry["next_token"] = [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
        out.append(entry)
    return out


@router.post("/slots/{id_slot}")
async def slot_action(request: Request, id_slot: str, action: str = ""):
    """Save a slot's session (body: {"filename"}), restore a named session into a slot, or erase a slot."""
    fe = frontend(request)
    n = fe.options.parallel
    if not (id_slot.isascii() and id_slot.isdigit() and int(id_slot) < n):
        raise ApiError(400, f"invalid slot id {id_slot[:20]!r}: this server has {n} slots (0 to {n - 1})",
                       param="id_slot")
    slot = int(id_slot)
    if action not in SlotAction.__args__:
        raise ApiError(400, f"invalid action {action[:20]!r}: save, restore or erase", param="action")
    name = None
    if action != "erase":
        name = (await fe.body(request, SlotFile)).filename
        fe.worker.named_path(name)  # a bad name is a 400 before the job is queued
    _, answer = await fe.answer(request, fe.job(f"slot_{action}", (slot, name)))
    a = answer.body
    if action == "save":
        return {"id_slot": slot, "filename": name, "n_saved": a["tokens"], "n_written": a["bytes"],
                "timings": {"save_ms": a["ms"]}}
    if action == "restore":
        return {"id_slot": slot, "filename": name, "n_restored": a["tokens"], "n_read": a["bytes"],
                "timings": {"restore_ms": a["ms"]}}
    return {"id_slot": slot, "n_erased": a["tokens"]}


@router.get("/metrics")
async def metrics_route(request: Request):
    fe = frontend(request)
    if not fe.options.metrics:
        raise ApiError(501, "this server does not serve /metrics: start it with --metrics", "not_supported_error")
    registry = request.app.state.metrics
    body = await fe.off_loop(metrics.exposition, registry)
    response = Response(body, media_type=metrics.CONTENT_TYPE)
    # in llama-server's case: Starlette lowercases the headers it is given, and clients compare names exactly
    response.raw_headers.append((b"Process-Start-Time-Unix", str(int(request.app.state.started)).encode()))
    return response
