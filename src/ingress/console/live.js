// The live transcript of a session page (docs/reference.md, "Console"): entries arrive as
// server-sent events, each rendered by the server as the page renders it (every value escaped
// there), and are added as they come.
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
    item.value = entry.n;
    item.id = "entry-" + entry.n;
    item.insertAdjacentHTML("beforeend", entry.html);
    list.append(item);
  });
  source.addEventListener("state", (message) => {
    const session = JSON.parse(message.data);
    if (state) {
      state.textContent = session.reason ? session.state + " (" + session.reason + ")" : session.state;
    }
  });
})();
