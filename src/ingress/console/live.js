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
  const forms = document.getElementById("rerun-forms");
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
    if (entry.rerun && forms) {
      // The page's own forms, for this entry's number.
      const copy = forms.content.cloneNode(true);
      copy.querySelectorAll("input[name=to], input[name=at]").forEach((input) => {
        input.value = String(entry.n);
      });
      copy.querySelectorAll("span.n").forEach((span) => {
        span.textContent = String(entry.n);
      });
      item.append(copy);
    }
    list.append(item);
  });
  source.addEventListener("state", (message) => {
    const session = JSON.parse(message.data);
    if (state) {
      state.textContent = session.reason ? session.state + " (" + session.reason + ")" : session.state;
    }
    // A rewind is offered only while the session is idle; the daemon refuses it otherwise.
    const idle = session.state === "idle";
    document.querySelectorAll("form.rewind").forEach((form) => {
      form.hidden = !idle;
    });
    if (forms) {
      forms.content.querySelectorAll("form.rewind").forEach((form) => {
        form.hidden = !idle;
      });
    }
  });
})();
