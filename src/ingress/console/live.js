// The live transcript of a session page (docs/reference.md, "Console"): entries arrive as
// server-sent events and are added as text, never as markup.
"use strict";
(function () {
  const list = document.querySelector("ol.transcript[data-live]");
  if (!list || !window.EventSource) {
    return;
  }
  const status = document.getElementById("live-status");
  const state = document.getElementById("session-state");
  const say = (text) => {
    if (status) {
      status.textContent = text;
    }
  };
  const source = new EventSource(list.dataset.live);
  source.addEventListener("open", () => say("live"));
  source.addEventListener("error", () => say("reconnecting…"));
  source.addEventListener("entry", (message) => {
    const entry = JSON.parse(message.data);
    const empty = list.querySelector("li.empty");
    if (empty) {
      empty.remove();
    }
    const item = document.createElement("li");
    item.className = "entry " + entry.kind;
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.append(entry.kind + " · " + entry.created_at + " · turn ");
    const turn = document.createElement("code");
    turn.textContent = entry.turn_id;
    meta.append(turn);
    const body = document.createElement("pre");
    body.textContent = entry.text;
    item.append(meta, body);
    list.append(item);
  });
  source.addEventListener("state", (message) => {
    const session = JSON.parse(message.data);
    if (state) {
      state.textContent = session.reason ? session.state + " (" + session.reason + ")" : session.state;
    }
  });
})();
