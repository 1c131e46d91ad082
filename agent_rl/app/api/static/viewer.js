// agent-rl viewer: optional enhancements (pages read fully without this file).
// - token strip: hover or click a token to see its logprobs and version in a fixed line;
// - replay: POST /api/v1/episodes/{id}/replay with the bearer token typed by the user.
(function () {
  "use strict";
  var strip = document.getElementById("token-strip");
  var detail = document.getElementById("token-detail");
  var pinned = null;
  if (strip && detail) {
    var show = function (el) { if (el && el.dataset.i !== undefined) detail.textContent = el.title + "  text=" + JSON.stringify(el.textContent); };
    strip.addEventListener("mouseover", function (ev) { if (!pinned) show(ev.target); });
    strip.addEventListener("click", function (ev) {
      var el = ev.target;
      if (el.dataset.i === undefined) return;
      if (pinned) pinned.classList.remove("pinned");
      pinned = pinned === el ? null : el;
      if (pinned) { pinned.classList.add("pinned"); show(pinned); }
    });
  }
  // A running episode: follow its server-sent events and reload when a new turn or the end
  // arrives (events for turns already on the page are replayed by the stream and ignored).
  var section = document.getElementById("actions");
  if (section && window.EventSource && /^(waiting|running)$/.test(section.dataset.status)) {
    var shown = parseInt(section.dataset.turns, 10) - 1;
    var events = new EventSource("/api/v1/episodes/" + section.dataset.episode + "/events");
    events.addEventListener("turn", function (ev) {
      if (parseInt(ev.lastEventId, 10) > shown) { events.close(); location.reload(); }
    });
    events.addEventListener("end", function () { events.close(); location.reload(); });
  }
  var form = document.getElementById("replay-form");
  if (!form) return;
  var out = document.getElementById("replay-result");
  var statusEl = document.getElementById("replay-status");
  var tokenInput = document.getElementById("api-token");
  try { tokenInput.value = sessionStorage.getItem("agent-rl-token") || ""; } catch (e) {}
  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    try { sessionStorage.setItem("agent-rl-token", tokenInput.value); } catch (e) {}
    statusEl.textContent = "replaying…";
    out.textContent = "";
    fetch("/api/v1/episodes/" + section.dataset.episode + "/replay", {
      method: "POST", headers: { "Authorization": "Bearer " + tokenInput.value }
    }).then(function (r) { return r.json().then(function (body) { return [r.status, body]; }); })
      .then(function (res) {
        var code = res[0], body = res[1];
        if (code !== 200) { statusEl.textContent = "error " + code + ": " + body.detail; return; }
        statusEl.innerHTML = body.reproduced ? '<span class="diff-ok">reproduced exactly</span>' : '<span class="diff-bad">differs</span>';
        var h = document.createElement("div");
        h.textContent = "reward: recorded " + body.recorded_reward + ", replayed " + body.replayed_reward;
        out.appendChild(h);
        body.turns.forEach(function (t) {
          if (t.equal) return;
          var pre = document.createElement("pre");
          pre.className = "box";
          pre.textContent = (t.turn < 0 ? "reset" : "turn " + t.turn) + "\n" + t.diff;
          out.appendChild(pre);
        });
        body.notes.forEach(function (n) { var p = document.createElement("div"); p.className = "muted"; p.textContent = n; out.appendChild(p); });
      })
      .catch(function (e) { statusEl.textContent = "error: " + e; });
  });
  var forkButton = document.getElementById("fork-button");
  if (forkButton) forkButton.addEventListener("click", function () {
    try { sessionStorage.setItem("agent-rl-token", tokenInput.value); } catch (e) {}
    var turn = document.getElementById("fork-turn").value;
    statusEl.textContent = "forking from turn " + turn + "…";
    out.textContent = "";
    fetch("/api/v1/episodes/" + section.dataset.episode + "/fork?turn=" + encodeURIComponent(turn), {
      method: "POST", headers: { "Authorization": "Bearer " + tokenInput.value }
    }).then(function (r) { return r.json().then(function (body) { return [r.status, body]; }); })
      .then(function (res) {
        var code = res[0], body = res[1];
        if (code !== 200) { statusEl.textContent = "error " + code + ": " + body.detail; return; }
        statusEl.textContent = "";
        var a = document.createElement("a");
        a.href = "/episodes/" + body.episode_id;
        a.textContent = "episode " + body.episode_id + " (" + body.status + ", reward " + body.reward + ")";
        out.appendChild(a);
      })
      .catch(function (e) { statusEl.textContent = "error: " + e; });
  });
})();
