#include "server/chat_page.h"

namespace microspec::server {

namespace {

// Text is always inserted with textContent, never as HTML, so replies cannot inject markup.
constexpr std::string_view kChatPage = R"HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>microspec chat</title>
<style>
  :root { --bg: #f6f7f9; --fg: #1d2330; --muted: #6b7280; --user: #dbeafe; --bot: #ffffff; --accent: #2563eb; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 15px/1.5 system-ui, sans-serif; background: var(--bg); color: var(--fg);
         display: flex; flex-direction: column; height: 100vh; }
  header { padding: 10px 16px; border-bottom: 1px solid #e5e7eb; background: #fff; display: flex;
           gap: 16px; align-items: center; flex-wrap: wrap; }
  header h1 { font-size: 16px; margin: 0; }
  header .info { color: var(--muted); font-size: 13px; }
  header label { font-size: 13px; color: var(--muted); }
  header input[type=number] { width: 70px; }
  #messages { flex: 1; overflow-y: auto; padding: 16px; display: flex; flex-direction: column; gap: 10px; }
  .msg { max-width: 780px; padding: 10px 14px; border-radius: 10px; white-space: pre-wrap; word-wrap: break-word; }
  .msg.user { align-self: flex-end; background: var(--user); }
  .msg.assistant { align-self: flex-start; background: var(--bot); border: 1px solid #e5e7eb; }
  .msg.error { align-self: flex-start; background: #fee2e2; }
  .stats { margin-top: 6px; font-size: 12px; color: var(--muted); font-family: ui-monospace, monospace; }
  form { display: flex; gap: 8px; padding: 12px 16px; background: #fff; border-top: 1px solid #e5e7eb; }
  textarea { flex: 1; resize: vertical; min-height: 44px; padding: 8px; font: inherit; }
  button { padding: 0 18px; background: var(--accent); color: #fff; border: 0; border-radius: 6px; font: inherit; }
  button:disabled { opacity: 0.5; }
</style>
</head>
<body>
<header>
  <h1>microspec</h1>
  <span class="info" id="model">connecting...</span>
  <label><input type="checkbox" id="spec" checked> speculative</label>
  <label>max tokens <input type="number" id="max_tokens" value="256" min="1"></label>
  <label>temperature <input type="number" id="temperature" value="0" min="0" max="2" step="0.1"></label>
  <label>API key <input type="password" id="key" size="12"></label>
</header>
<div id="messages"></div>
<form id="form">
  <textarea id="prompt" placeholder="Ask something (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
$("key").value = localStorage.getItem("microspec_key") || "";
$("key").addEventListener("change", () => { localStorage.setItem("microspec_key", $("key").value); loadModel(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (!r.ok) { $("model").textContent = j.error ? j.error.message : "HTTP " + r.status; return; }
    const m = j.data[0];
    const spec = m.microspec.spec === "none" ? "no speculation"
      : "spec " + m.microspec.spec + ", draft vocabulary " + m.microspec.draft_vocab;
    $("model").textContent = m.id + " | " + spec + " | " + m.microspec.n_ctx + " tokens context";
    $("spec").disabled = m.microspec.spec === "none";
    $("spec").checked = m.microspec.spec !== "none";
  } catch (e) { $("model").textContent = "server unreachable: " + e; }
}

function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function fmt(x, digits) { return (typeof x === "number" && isFinite(x)) ? x.toFixed(digits) : "-"; }

function showStats(el, s) {
  el.textContent = (s.final ? "" : "streaming | ") + fmt(s.tps, 1) + " tok/s | acceptance " +
    (s.acc === null ? "-" : fmt(s.acc, 2)) + " | active vocab " + (s.vocab === null ? "-" : fmt(s.vocab, 0)) +
    " | " + s.tokens + " tokens" + (s.note ? " | " + s.note : "");
  el.dataset.tps = s.tps; el.dataset.acceptance = s.acc; el.dataset.vocab = s.vocab; el.dataset.final = s.final;
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  const body = reply.querySelector(".text");
  const stats = document.createElement("div");
  stats.className = "stats";
  reply.appendChild(stats);
  $("send").disabled = true;
  const request = {
    model: "microspec", messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt($("max_tokens").value, 10) || 256, temperature: parseFloat($("temperature").value) || 0,
  };
  if (!$("spec").disabled && !$("spec").checked) request.microspec = { spec: "none" };
  const t0 = performance.now();
  let tFirst = null, pieces = 0, text_so_far = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(request) });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? j.error.message : "HTTP " + r.status);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", done = false;
    while (!done) {
      const chunk = await reader.read();
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") { done = true; break; }
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message);
          if (j.choices && j.choices.length && j.choices[0].delta && j.choices[0].delta.content) {
            if (tFirst === null) tFirst = performance.now();
            pieces += 1;
            text_so_far += j.choices[0].delta.content;
            body.textContent = text_so_far;
            // Live estimate: one streamed piece is about one token.
            const secs = (performance.now() - tFirst) / 1000;
            showStats(stats, { final: false, tps: secs > 0 ? (pieces - 1) / secs : NaN, acc: null, vocab: null, tokens: pieces });
            $("messages").scrollTop = $("messages").scrollHeight;
          }
          if (j.usage) {
            const m = j.usage.microspec || {};
            showStats(stats, { final: true, tps: m.decode_tokens_per_second,
              acc: m.speculative ? m.mean_acceptance_length : null,
              vocab: m.speculative ? (m.mean_active_vocab ?? null) : null, tokens: j.usage.completion_tokens, note: m.note });
          }
        }
      }
    }
    history.push({ role: "assistant", content: text_so_far });
  } catch (e) {
    reply.classList.add("error");
    stats.textContent = "error: " + e.message;
    history.pop();
  } finally {
    $("send").disabled = false;
    $("prompt").focus();
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
loadModel();
</script>
</body>
</html>
)HTML";

}  // namespace

std::string_view chat_page_html() {
  return kChatPage;
}

}  // namespace microspec::server
