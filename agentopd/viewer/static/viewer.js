// agentopd viewer: progressive enhancement only; every page works without this file.
// Episode page: turn replay (previous / next / all), keyboard keys, token numbers on focus.
(function () {
  "use strict";
  const turns = Array.from(document.querySelectorAll("section.turn"));
  const bar = document.getElementById("replay");
  if (!bar || !turns.length) return;
  bar.hidden = false;
  const pos = document.getElementById("turn-pos");
  const info = document.getElementById("tok-info");
  let current = -1; // -1: all turns shown

  function show(k, scroll) {
    current = k;
    document.body.classList.toggle("replaying", k >= 0);
    turns.forEach(function (t, i) {
      t.classList.toggle("later", k >= 0 && i > k);
      t.classList.toggle("current", i === k);
    });
    pos.textContent = k < 0 ? "all turns" : "turn " + k + " of " + (turns.length - 1);
    const hash = k < 0 ? "" : "#turn-" + k;
    history.replaceState(null, "", location.pathname + location.search + hash);
    if (scroll && k >= 0) turns[k].scrollIntoView({ block: "start" });
  }
  function next() { show(Math.min(current + 1, turns.length - 1), true); }
  function prev() { show(current < 0 ? turns.length - 1 : Math.max(current - 1, 0), true); }

  document.getElementById("turn-next").addEventListener("click", next);
  document.getElementById("turn-prev").addEventListener("click", prev);
  document.getElementById("turn-all").addEventListener("click", function () { show(-1, false); });

  document.addEventListener("keydown", function (e) {
    if (e.altKey || e.ctrlKey || e.metaKey) return;
    const tag = (e.target.tagName || "").toLowerCase();
    if (tag === "input" || tag === "select" || tag === "textarea") return;
    const go = function (id) { const a = document.getElementById(id); if (a) location.href = a.href; };
    if (e.key === "ArrowRight" || e.key === "j") { next(); e.preventDefault(); }
    else if (e.key === "ArrowLeft" || e.key === "k") { prev(); e.preventDefault(); }
    else if (e.key === "a") { show(-1, false); }
    else if (e.key === "n") { go("next-episode"); }
    else if (e.key === "p") { go("prev-episode"); }
  });

  // the exact numbers of a focused or hovered token, also for keyboard users
  function describe(e) {
    const t = e.target;
    if (t.classList && t.classList.contains("t")) info.textContent = t.title;
  }
  document.addEventListener("focusin", describe);
  document.addEventListener("mouseover", describe);

  const m = /^#turn-(\d+)$/.exec(location.hash);
  if (m && +m[1] < turns.length) show(+m[1], true);
})();
