"use strict";
// A chat over the server's own OpenAI route (/v1/chat/completions, streamed). The conversation lives in this
// browser (localStorage) and is resent whole with each turn, as agents resend theirs: the server finds its KV
// live or on disk and prefills only what is new (each reply says how many prompt tokens were cached).
const $ = (id) => document.getElementById(id);
const settings = Object.assign({key: "", system: "", temperature: 0.7, maxTokens: 1024},
                               JSON.parse(localStorage.getItem("kvsession.settings") || "{}"));
let messages = JSON.parse(localStorage.getItem("kvsession.messages") || "[]");
let running = null;

function headers() {
  const h = {"Content-Type": "application/json"};
  if (settings.key) h["Authorization"] = "Bearer " + settings.key;
  return h;
}
function keep() { localStorage.setItem("kvsession.messages", JSON.stringify(messages)); }
function add(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}
function render() {
  $("log").textContent = "";
  for (const m of messages) add(m.role, m.content);
}
async function errorText(res) {
  try { const body = await res.json(); return (body.error && body.error.message) || JSON.stringify(body); }
  catch (e) { return res.status + " " + res.statusText; }
}

async function send(text) {
  messages.push({role: "user", content: text});
  keep();
  add("user", text);
  const div = add("assistant", "");
  const think = document.createElement("div"), body = document.createElement("div"), stats = document.createElement("div");
  think.className = "think"; stats.className = "stats";
  div.append(think, body, stats);
  const sent = (settings.system ? [{role: "system", content: settings.system}] : []).concat(messages);
  running = new AbortController();
  $("send").hidden = true; $("stop").hidden = false; $("status").textContent = "prefilling...";
  const t0 = performance.now();
  let first = 0, reply = "", usage = null;
  try {
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: running.signal,
      body: JSON.stringify({messages: sent, stream: true, stream_options: {include_usage: true},
                            temperature: Number(settings.temperature), max_tokens: Number(settings.maxTokens)})});
    if (!res.ok) throw new Error(await errorText(res));
    const reader = res.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
        if (ev.usage) usage = ev.usage;
        const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (!delta) continue;
        if (!first && (delta.content || delta.reasoning_content)) {
          first = performance.now(); $("status").textContent = "generating...";
        }
        if (delta.reasoning_content) think.textContent += delta.reasoning_content;
        if (delta.content) { reply += delta.content; body.textContent = reply; div.scrollIntoView({block: "end"}); }
      }
    }
    messages.push({role: "assistant", content: reply});
    keep();
    if (usage) {
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0, end = performance.now();
      const rate = first && end > first ? (usage.completion_tokens / ((end - first) / 1000)).toFixed(1) : "-";
      stats.textContent = `${usage.prompt_tokens} prompt tokens (${cached} cached), first token in ` +
        `${((first || end) - t0).toFixed(0)} ms; ${usage.completion_tokens} tokens at ${rate}/s`;
    }
    $("status").textContent = "ready";
  } catch (e) {
    if (e.name === "AbortError") {
      messages.push({role: "assistant", content: reply}); keep();
      $("status").textContent = "stopped";
    } else {
      messages.pop(); keep();  // the turn did not happen: it can be sent again
      div.className = "msg error"; div.textContent = String(e.message || e);
      $("status").textContent = "error";
    }
  } finally {
    running = null; $("send").hidden = false; $("stop").hidden = true;
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => running && running.abort());
$("new").addEventListener("click", () => { if (running) running.abort(); messages = []; keep(); render(); });
$("open-settings").addEventListener("click", () => {
  $("key").value = settings.key; $("system").value = settings.system;
  $("temperature").value = settings.temperature; $("max-tokens").value = settings.maxTokens;
  $("settings").showModal();
});
$("settings").addEventListener("close", () => {
  if ($("settings").returnValue !== "save") return;
  Object.assign(settings, {key: $("key").value, system: $("system").value,
                           temperature: Number($("temperature").value), maxTokens: Number($("max-tokens").value)});
  localStorage.setItem("kvsession.settings", JSON.stringify(settings));
  loadModel();
});

async function loadModel() {
  try {
    const res = await fetch("/v1/models", {headers: headers()});
    if (res.status === 401) { $("model").textContent = "kvsession: an API key is needed (Settings)"; return; }
    const body = await res.json();
    $("model").textContent = body.data[0].id;
  } catch (e) { $("model").textContent = "kvsession: the server does not answer"; }
}
fetch("/_app/version.json").then((r) => r.json()).then((v) => { $("version").textContent = "kvsession " + v.version; })
  .catch(() => {});
if ("serviceWorker" in navigator) navigator.serviceWorker.register("/sw.js").catch(() => {});
render();
loadModel();
