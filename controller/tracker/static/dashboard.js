/* onbox tracker dashboard (controller/tracker/API.md, "Dashboard").
 *
 * Two views: "/" lists every run, "/run/<run>" draws one run's curves with uPlot (vendored: uPlot.iife.min.js).
 * Live by short polls with cursors: the list sends the highest beat id it has seen and gets back only the runs
 * with newer beats (plus every run's liveness, which changes with time alone); a run page sends the last seq it
 * has and gets back only newer beats, the last beat id whose trainer points it has and gets back only newer
 * ones (every record the agent parsed: the loss, eval loss, lr and tokens/s curves have the trainer's own
 * resolution; a tracker or agent older than them sends none and those curves come from the beats), and the last
 * event id it has (the keeper's decisions, marked as recoveries and failures; a tracker without events answers
 * 404 or 405 and the page then draws no such marks). A chart with nothing to draw is not shown; each chart's
 * legend shows the newest values until the pointer is over it; `?compare=<run>` (or the "compare loss with"
 * picker) draws another run's loss and eval loss on the loss chart. A legend's value is each curve's NEWEST point
 * (by arrival: after a restart from scratch, a step below the old ones), over time a curve breaks where nothing was
 * reported, and a commit's tick sits at its checkpoint's step. A run page says what the run is (command, start,
 * elapsed, durable target, profile, heartbeat, deadline, work at risk, the next step of a run that stopped short)
 * and where its time went (its goodput ledger: a bar and a row per part); the list adds the fleet's ledgers
 * (`/api/v1/goodput`, every 10 s). Polls pause while the tab is hidden. Every
 * value from the tracker is written with textContent, never as HTML. State for tests and the curious:
 * window.onboxDashboard.
 */
(function () {
  "use strict";

  var params = new URLSearchParams(location.search);
  var POLL_MS = Math.min(60, Math.max(0.2, parseFloat(params.get("poll")) || 2)) * 1000;
  var PAGE = 20000;
  var S = window.onboxDashboard = {
    view: null, pollMs: POLL_MS, polls: 0, errors: 0, lastError: null,
    cursor: -1, runs: {}, live: {},                       // the list
    run: null, summary: null, after: -1, events: [],      // a run page: its beats (points, by seq) and
    tafter: -1, trainer: null, served: null,              // its trainer's points (by beat id; served: false when
    compare: null, others: null,                          // the tracker sent none); the run drawn beside it
    points: null, xmode: "step", charts: [], painted: {},
    keeper: {after: 0, served: null, events: []},         // the run's events (served: false on an older tracker)
    marks: [], drawn: {}                                  // the keeper's marks; what each chart drew, by chart id
  };
  var CHARTS = [
    // [column, label, colour, scale, join the gaps (eval loss comes every few hundred steps)]; y: the axis label
    {id: "loss", title: "loss", y: "loss",
     series: [["loss", "loss", "#0969da"], ["eval_loss", "eval loss", "#cf222e", 1, true]]},
    {id: "lr", title: "learning rate", y: "learning rate", series: [["lr", "lr", "#8250df"]]},
    {id: "tps", title: "tokens/s", y: "tokens/s", series: [["tokens_per_s", "tokens/s", "#1a7f37"]]},
    {id: "gpu", title: "GPU utilisation %", y: "GPU utilisation (%)", series: [["gpu_util", "GPU %", "#bc4c00"]]},
    {id: "mem", title: "GPU memory used (GiB)", y: "GPU memory used (GiB)",
     series: [["gpu_mem", "GiB", "#0550ae", 1 / 1073741824]]}
  ];
  // the compared run's curves on the loss chart: [column, label (after the run's name), colour, scale, join]
  var COMPARE_SERIES = [["loss", "loss", "#bf8700"], ["eval_loss", "eval loss", "#953800", 1, true]];
  var EVENT_COLORS = {restart: "#cf222e", box: "#8250df", preempted: "#bf3989", commit: "#1a7f37", failed: "#82071e",
                      recovery: "#0f8b8d", failed_no_resource: "#82071e", failed_max_recoveries: "#82071e",
                      failed_launch: "#82071e", needs_a_person: "#9a6700"};
  // the keeper's events (API.md, "Events"): the ones of one recovery make one mark, each of these one of its own
  var KEEPER_MARKS = {failed_no_resource: "no box", failed_max_recoveries: "max recoveries",
                      failed_launch: "launch failed", needs_a_person: "needs a person"};
  var RECOVERY_KINDS = ["detected", "declared_lost", "spare_skipped", "provisioned", "provision_failed", "no_box",
                        "box_chosen", "box_failed", "pushed", "launch_failed", "relaunched", "first_new_step",
                        "failed_no_resource", "failed_launch"];
  var EVENTS_PAGE = 1000;
  var COLUMNS = ["seq", "time", "attempt", "step", "loss", "eval_loss", "lr", "tokens_per_s", "gpu_util", "gpu_mem"];
  var TRAINER = ["seq", "attempt", "time", "step", "loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s", "epoch",
                 "steps_per_s"];
  var FROM_TRAINER = {loss: true, eval_loss: true, lr: true, tokens_per_s: true};  // the rest: from the beats
  var TRAINER_PAGE = 100000;
  // a run's goodput ledger (API.md, "Goodput"): the parts of its wall time, in this order everywhere
  var PARTS = ["productive", "recomputed", "down", "restoring", "starting", "stalled"];

  // -- small helpers ---------------------------------------------------------------------------------------------
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtNum(v, digits) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "string") return v;  // "NaN", "Infinity" as the beat carried them
    if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
    return Number(v.toPrecision(digits || 4)).toString();
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    var gib = n / 1073741824;
    return gib >= 1 ? gib.toFixed(1) + "G" : Math.floor(n / 1048576) + "M";
  }
  function fmtAge(s) {  // as `onboxctl status` prints it (controller/tracker/runview.py fmt_age)
    if (s === null || s === undefined) return "-";
    if (s < 90) return Math.floor(s) + "s";
    if (s < 5400) return Math.floor(s / 60) + "m";
    return (s / 3600).toFixed(1) + "h";
  }
  function fmtAxis(v) {  // small values (a learning rate) keep their digits: 3e-4, not 0.000
    if (v === null || v === undefined) return "";
    var a = Math.abs(v);
    if (a !== 0 && (a < 0.01 || a >= 1e6)) return v.toExponential(1);
    return Number(v.toPrecision(4)).toLocaleString("en-US");
  }
  function fmtTime(t) {
    return t ? new Date(t * 1000).toLocaleString() : "-";
  }
  function isNum(v) {
    return typeof v === "number" && isFinite(v);
  }
  function afterPaint(name) {  // the frame after the one that drew it: the content is on screen
    requestAnimationFrame(function () {
      requestAnimationFrame(function () {
        if (!S.painted[name]) {
          S.painted[name] = performance.now();
          performance.mark("onbox:" + name + "-painted");
        }
      });
    });
  }
  function LoginNeeded() { this.login = true; }

  function api(path) {
    return fetch(path, {credentials: "same-origin", cache: "no-store", headers: {"Accept": "application/json"}})
      .then(function (r) {
        if (r.status === 401) {
          location.assign("/login?next=" + encodeURIComponent(location.pathname));
          throw new LoginNeeded();
        }
        if (!r.ok) {
          return r.json().catch(function () { return {}; }).then(function (d) {
            var e = new Error("HTTP " + r.status + (d.error ? ": " + d.error : ""));
            e.status = r.status;
            throw e;
          });
        }
        return r.json();
      });
  }
  function banner(text) {
    var b = document.getElementById("banner");
    b.hidden = !text;
    b.textContent = text || "";
  }
  function stateCell(td, row) {
    td.textContent = "";
    td.appendChild(el("span", "state st-" + String(row.state || "unknown").replace(/[^a-z_]/g, ""), row.state || "?"));
    if (row.mark) td.appendChild(el("span", "mark mark-" + row.mark, row.mark));
  }
  function alertsInto(node, alerts, withMessage) {
    node.textContent = "";
    (alerts || []).forEach(function (a) {
      var line = el("span", "alert sev-" + (a.severity || "warning"));
      line.appendChild(el("span", "code", a.code));
      if (withMessage && a.message) line.appendChild(document.createTextNode(": " + a.message));
      if (a.hint) {
        line.appendChild(el("br"));
        line.appendChild(el("span", "hint", "hint: " + a.hint));
      }
      node.appendChild(line);
    });
  }
  function pulledText(p) {
    if (!p) return "-";
    return {verified: "pulled ✓ verified", stale: "pulled, stale", failed: "verify FAILED",
            older: "older pulled", not_pulled: "not pulled", no_checkpoint: "-", unknown: "?"}[p.status] || p.status;
  }
  function ckptLabel(row) {
    var d = row.durable;
    if (!d) return row.checkpoint || "-";
    return d.name + (d.step !== null && d.step !== undefined && String(d.name).indexOf(String(d.step)) < 0 ?
      " @" + d.step : "");
  }

  // -- the run list ---------------------------------------------------------------------------------------------
  var LIST_HEAD = ["run", "box", "state", "att", "step", "loss", "tok/s", "GPU%", "GPU mem", "durable ckpt",
                   "at risk", "pulled", "beat", "alerts"];

  function listView() {
    S.view = "list";
    document.getElementById("where").textContent = "runs";
    var main = document.getElementById("main");
    main.textContent = "";
    main.appendChild(el("div", "counts")).id = "counts";
    var table = el("table", "runs");
    table.id = "runs";
    var tr = table.appendChild(el("thead")).appendChild(el("tr"));
    LIST_HEAD.forEach(function (h) { tr.appendChild(el("th", null, h)); });
    table.appendChild(el("tbody"));
    main.appendChild(table);
    main.appendChild(el("p", "note")).id = "pulls-note";
    var fleet = main.appendChild(el("section"));
    fleet.id = "fleet";
    fleet.hidden = true;
    fleet.appendChild(el("h2", null, "Goodput: where each run's time went"));
    var ft = fleet.appendChild(el("table", "runs fleet"));
    ft.id = "fleet-table";
    var fh = ft.appendChild(el("thead")).appendChild(el("tr"));
    FLEET_HEAD.forEach(function (h) { fh.appendChild(el("th", null, h)); });
    ft.appendChild(el("tbody"));
    fleet.appendChild(el("p", "note", "Each run's wall time since its first launch, split as `onboxctl report` " +
                                      "splits it (the parts add up to it); cost at its boxes' prices per hour."));
    return pollList();
  }

  var FLEET_HEAD = ["run", "wall", "goodput", "split"].concat(PARTS, ["losses", "cost", "lost"]);
  var fleetServed = null, fleetAt = 0;

  function pollFleet() {  // the fleet's ledgers, every 10 s (a tracker without them: 404, asked no more)
    if (fleetServed === false || Date.now() - fleetAt < 10000) return Promise.resolve();
    fleetAt = Date.now();
    return api("/api/v1/goodput?segments=1").then(function (d) {
      fleetServed = true;
      S.fleet = d.runs;
      var tbody = document.querySelector("#fleet-table tbody");
      if (!tbody) return;
      document.getElementById("fleet").hidden = !d.runs.length;
      tbody.textContent = "";
      d.runs.forEach(function (r) {
        var tr = tbody.appendChild(el("tr"));
        tr.dataset.run = r.run;
        var a = tr.appendChild(el("td")).appendChild(el("a", null, r.run));
        a.href = "/run/" + encodeURIComponent(r.run);
        tr.appendChild(el("td", "num", fmtDur(r.wall_s)));
        tr.appendChild(el("td", "num", r.goodput === null ? "-" : (100 * r.goodput).toFixed(1) + "%"));
        var bar = tr.appendChild(el("td")).appendChild(el("div", "ledger-bar mini"));
        (r.segments || []).forEach(function (sg) {
          var seg = bar.appendChild(el("span", "seg part-" + sg[2]));
          seg.style.width = (100 * (sg[1] - sg[0]) / r.wall_s) + "%";
          seg.title = sg[2] + " on " + sg[3] + ": " + fmtDur(sg[1] - sg[0]);
        });
        PARTS.forEach(function (p) { tr.appendChild(el("td", "num", fmtDur(r.parts[p]))).dataset.part = p; });
        tr.appendChild(el("td", "num", r.losses.length));
        var m = r.money || {}, parts = m.parts || {}, keys = Object.keys(parts);
        var cost = keys.reduce(function (t, k) { return t + parts[k]; }, 0);
        tr.appendChild(el("td", "num", keys.length ? cost.toFixed(2) : "-"));
        tr.appendChild(el("td", "num", keys.length ? (cost - (parts.productive || 0)).toFixed(2) : "-"));
      });
    }, function (e) {
      if (e && (e.status === 404 || e.status === 405)) {
        fleetServed = false;
        return;
      }
      throw e;
    });
  }

  function listRow(name) {
    var tbody = document.querySelector("#runs tbody");
    var tr = tbody.querySelector('tr[data-run="' + CSS.escape(name) + '"]');
    if (tr) return tr;
    tr = el("tr");
    tr.dataset.run = name;
    LIST_HEAD.forEach(function (_, i) { tr.appendChild(el("td", (i >= 4 && i <= 8) || i === 10 ? "num" : null)); });
    var a = el("a", null, name);
    a.href = "/run/" + encodeURIComponent(name);
    tr.cells[0].appendChild(a);
    // ordered like `onboxctl status`: by box, then run
    var key = function (r) { return [r.box || "", r.run]; };
    var mine = key(S.runs[name]);
    var before = null;
    Array.prototype.some.call(tbody.rows, function (other) {
      var k = key(S.runs[other.dataset.run]);
      if (k[0] > mine[0] || (k[0] === mine[0] && k[1] > mine[1])) { before = other; return true; }
      return false;
    });
    tbody.insertBefore(tr, before);
    return tr;
  }

  function deadlineText(d) {  // "<at> (slurm), 1h 2m left; checkpoint asked for at <ask_at>", times as fmtTime prints them
    var left = d.at - Date.now() / 1000;
    return fmtTime(d.at) + " (" + (d.source || "?") + "), " + (left > 0 ? fmtAge(left) + " left" : "passed") +
      "; checkpoint asked for at " + fmtTime(d.asked_at || d.ask_at);
  }

  function phaseText(p) {  // "phase 2/3 finetune"
    return "phase " + (p.index + 1) + "/" + p.count + (p.name ? " " + p.name : "");
  }

  function fillRow(row) {
    var tr = listRow(row.run), c = tr.cells;
    tr.className = "live-" + row.liveness;
    tr.dataset.liveness = row.liveness;
    tr.dataset.state = row.state;
    c[1].textContent = row.box + (row.node ? " · node " + row.node.rank + "/" + row.node.nnodes : "");
    stateCell(c[2], row);
    if (row.phase) c[2].appendChild(el("span", "phase", " · " + phaseText(row.phase)));
    c[3].textContent = row.attempt === null ? "-" : row.attempt;
    c[4].textContent = row.step === null ? "-" : row.step;
    c[5].textContent = fmtNum(row.loss, 4);
    c[6].textContent = fmtNum(row.tokens_per_s, 3);
    c[7].textContent = row.gpu_util === null ? "-" : Math.round(row.gpu_util);
    c[8].textContent = row.gpu_mem_used === null ? "-" : fmtBytes(row.gpu_mem_used) + "/" + fmtBytes(row.gpu_mem_total);
    c[9].textContent = ckptLabel(row);
    c[10].textContent = row.at_risk_text || "-";  // as `onboxctl status` shows it: time/steps since the durable step
    c[10].title = "work at risk: time/steps since the newest durable checkpoint's step";
    c[11].textContent = "";
    var p = c[11].appendChild(el("span", "pulled pulled-" + (row.pulled ? row.pulled.status : "unknown"),
                                 pulledText(row.pulled)));
    p.title = row.pulled ? row.pulled.text : "";
    c[12].textContent = fmtAge(row.age_s);
    alertsInto(c[13], row.alerts, false);
  }

  function pollList() {
    return api("/api/v1/overview?after=" + S.cursor).then(function (d) {
      S.polls++;
      if (d.full) {  // every run again (another database, or a cursor far behind): the ones it lacks are gone
        Object.keys(S.runs).forEach(function (name) {
          if (Object.prototype.hasOwnProperty.call(d.live, name)) return;
          delete S.runs[name];
          var gone = document.querySelector('#runs tbody tr[data-run="' + CSS.escape(name) + '"]');
          if (gone) gone.remove();
        });
      }
      d.runs.forEach(function (row) { S.runs[row.run] = row; });
      Object.keys(d.live).forEach(function (name) {
        var row = S.runs[name];
        if (row) Object.assign(row, d.live[name]);
      });
      S.cursor = d.cursor;
      S.live = d.live;
      var names = Object.keys(S.runs);
      names.forEach(function (name) { fillRow(S.runs[name]); });
      var count = function (f) { return names.filter(function (n) { return f(S.runs[n]); }).length; };
      var counts = document.getElementById("counts");
      counts.textContent = "";
      [["runs", names.length], ["running", count(function (r) { return r.state === "running"; })],
       ["LATE", count(function (r) { return r.mark === "LATE"; })],
       ["SILENT", count(function (r) { return r.mark === "SILENT"; })],
       ["with alerts", count(function (r) { return r.alerts && r.alerts.length; })]].forEach(function (kv) {
        var s = counts.appendChild(el("span"));
        s.appendChild(el("b", null, kv[1]));
        s.appendChild(document.createTextNode(" " + kv[0]));
      });
      if (!names.length) counts.appendChild(el("span", null, "no runs yet: start one with `onboxctl run ... --tracker`"));
      document.getElementById("pulls-note").textContent = "pulled: " +
        (d.pulls_problem ? d.pulls_problem + "; " : "") + d.pulls_note;
      document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
      afterPaint("list");
      return pollFleet();
    });
  }

  // -- a run page ----------------------------------------------------------------------------------------------
  function runData(R, name) {  // a run's curves as the page keeps them: S for its own run, S.compare for another
    R.run = name;
    R.after = -1;
    R.tafter = -1;
    R.served = null;
    R.points = {};
    COLUMNS.forEach(function (c) { R.points[c] = []; });
    R.trainer = {};
    TRAINER.forEach(function (c) { R.trainer[c] = []; });
    R.tsorted = true;  // the trainer's points arrived in seq order (a late backlog's do not: then they are sorted)
    R.tfirst = null;   // the lowest seq of a beat that brought points: the beats before it draw the trainer's curves
    return R;
  }

  function runView(name) {
    S.view = "run";
    runData(S, name);
    var wanted = params.get("compare");
    S.compare = wanted && wanted !== name ? runData({}, wanted) : null;
    document.title = name + " · onbox tracker";
    document.getElementById("where").textContent = "run " + name;
    var main = document.getElementById("main");
    main.textContent = "";
    var h = main.appendChild(el("h1"));
    h.appendChild(el("span", null, name + " "));
    h.appendChild(el("span")).id = "run-state";
    main.appendChild(el("div", "facts")).id = "facts";
    var panels = main.appendChild(el("div", "panels"));
    var ck = panels.appendChild(el("div", "panel"));
    ck.appendChild(el("h2", null, "Newest durable checkpoint"));
    ck.appendChild(el("div")).id = "ckpt";
    var al = panels.appendChild(el("div", "panel"));
    al.appendChild(el("h2", null, "Open alerts"));
    al.appendChild(el("div")).id = "alerts";
    var what = main.appendChild(el("div", "panels"));
    var ru = what.appendChild(el("div", "panel"));
    ru.id = "run-panel";
    ru.appendChild(el("h2", null, "What it is"));
    ru.appendChild(el("dl", "kv")).id = "run-facts";
    ru.appendChild(el("div", "next-step")).id = "next-step";
    var gp = what.appendChild(el("div", "panel"));
    gp.id = "goodput-panel";
    gp.appendChild(el("h2", null, "Where its time went"));
    gp.appendChild(el("div", "ledger-bar")).id = "ledger-bar";
    gp.appendChild(el("table", "ledger")).id = "ledger";
    gp.appendChild(el("div", "note")).id = "ledger-note";
    var bar = main.appendChild(el("div", "toolbar"));
    bar.appendChild(el("span", "muted", "x axis:"));
    [["step", "steps"], ["time", "time"]].forEach(function (m) {
      var b = bar.appendChild(el("button", m[0] === S.xmode ? "on" : null, m[1]));
      b.type = "button";
      b.id = "x-" + m[0];
      b.addEventListener("click", function () {
        S.xmode = m[0];
        Array.prototype.forEach.call(bar.querySelectorAll("button"), function (x) {
          x.className = x.id === "x-" + m[0] ? "on" : "";
        });
        makeCharts();
      });
    });
    var cmp = bar.appendChild(el("label", "compare", "compare loss with "));
    var pick = cmp.appendChild(el("select"));
    pick.id = "compare";
    pick.appendChild(el("option", null, "(no other run)")).value = "";
    if (S.compare) {
      pick.appendChild(el("option", null, S.compare.run)).value = S.compare.run;
      pick.value = S.compare.run;
    }
    pick.addEventListener("change", function () { compareWith(pick.value); });
    main.appendChild(el("div", "events")).id = "events";
    main.appendChild(el("div", "charts")).id = "charts";
    var lg = main.appendChild(el("section"));
    lg.id = "log";
    lg.hidden = true;
    lg.appendChild(el("h2", null, "Log tail")).appendChild(el("span", "note")).id = "log-count";
    lg.appendChild(el("pre", "log")).id = "log-tail";
    return loadAll().then(function () {
      return S.compare ? loadCompare(S.compare) : null;
    }).then(function () {
      makeCharts();
      afterPaint("run");
      listOthers();
    });
  }

  function loadAll() {  // the whole history, in pages, before the first draw
    return pollRun().then(function (more) { return more ? loadAll() : loadKeeper(); });
  }
  function loadCompare(R) {  // the compared run's whole history; a run the tracker does not know draws nothing
    return fetchSeries(R).then(function (got) { return got.more && S.compare === R ? loadCompare(R) : null; });
  }

  function listOthers() {  // the picker's runs: every run the tracker has but this one (once, after the first draw)
    return api("/api/v1/overview").then(function (d) {
      var pick = document.getElementById("compare");
      if (!pick) return;
      S.others = d.runs.map(function (r) { return r.run; }).filter(function (n) { return n !== S.run; }).sort();
      var keep = pick.value;
      pick.textContent = "";
      pick.appendChild(el("option", null, "(no other run)")).value = "";
      S.others.concat(keep && S.others.indexOf(keep) < 0 ? [keep] : []).forEach(function (n) {
        pick.appendChild(el("option", null, n)).value = n;
      });
      pick.value = keep;
    }, function (e) {
      if (e && e.login) throw e;  // the picker keeps what it has; the next poll says what is wrong
    });
  }

  function compareWith(name) {  // draw another run's loss beside this one's (name "": none); kept in the URL
    var q = new URLSearchParams(location.search);
    if (name) q.set("compare", name); else q.delete("compare");
    history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q.toString() : ""));
    S.compare = name && name !== S.run ? runData({}, name) : null;
    var R = S.compare;
    return (R ? loadCompare(R) : Promise.resolve()).then(function () {
      if (S.compare === R) makeCharts();
    }, failed);
  }
  function loadKeeper() {
    return pollKeeper().then(function (more) { return more ? loadKeeper() : null; });
  }

  function pollKeeper() {  // the run's events since the last one seen; true while there are more
    if (S.keeper.served === false) return Promise.resolve(false);
    var url = "/api/v1/runs/" + encodeURIComponent(S.run) + "/events?after=" + S.keeper.after + "&limit=" + EVENTS_PAGE;
    return api(url).then(function (d) {
      S.keeper.served = true;
      Array.prototype.push.apply(S.keeper.events, d.events);
      var moved = d.next_after > S.keeper.after;
      S.keeper.after = Math.max(S.keeper.after, d.next_after);
      if (d.events.length) updateCharts();
      return moved && d.events.length + (d.skipped_rows || 0) >= EVENTS_PAGE;
    }, function (e) {
      if (e && (e.status === 404 || e.status === 405)) {  // a tracker older than events: no marks, not asked again
        S.keeper.served = false;
        return false;
      }
      throw e;
    });
  }

  function fetchSeries(R) {  // a run's new beats and trainer points since its cursors: {d, n (new points), more}
    var url = "/api/v1/runs/" + encodeURIComponent(R.run) + "/series?after=" + R.after + "&limit=" + PAGE +
      "&points_after=" + R.tafter + "&points_limit=" + TRAINER_PAGE;
    return api(url).then(function (d) {
      var n = d.points.seq.length, more = d.more;
      COLUMNS.forEach(function (c) { Array.prototype.push.apply(R.points[c], d.points[c]); });
      R.after = d.next_after;
      if (d.trainer) {  // a tracker older than the trainer's points ignores points_after and sends none
        var T = R.trainer, t = d.trainer.points, k = t.seq.length, last = T.seq.length ? T.seq[T.seq.length - 1] : null;
        TRAINER.forEach(function (c) {
          Array.prototype.push.apply(T[c], t[c] || new Array(k).fill(null));
        });
        for (var i = 0; i < k; i++) {
          if (last !== null && t.seq[i] < last) R.tsorted = false;
          last = t.seq[i];
          if (R.tfirst === null || t.seq[i] < R.tfirst) R.tfirst = t.seq[i];
        }
        R.served = true;
        R.tafter = d.trainer.next_after;
        n += k;
        more = more || d.trainer.more;
      } else {
        R.served = false;
      }
      return {d: d, n: n, more: more};
    });
  }

  function pollRun() {
    return fetchSeries(S).then(function (got) {
      var d = got.d;
      S.polls++;
      Array.prototype.push.apply(S.events, d.events);
      if (d.summary) S.summary = Object.assign({}, S.summary || {}, d.summary);
      showSummary();
      if (got.n || d.events.length) updateCharts();
      document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
      return got.more;
    });
  }

  function pollCompare() {  // the compared run's new points, with the page's own poll
    var R = S.compare;
    if (!R) return Promise.resolve(false);
    return fetchSeries(R).then(function (got) {
      if (S.compare === R && got.n) updateCharts();
      return got.more;
    });
  }

  function showSummary() {
    var r = S.summary;
    if (!r) {
      document.getElementById("facts").textContent = "No beats from this run (yet).";
      return;
    }
    stateCell(document.getElementById("run-state"), r);
    document.getElementById("run-state").dataset.liveness = r.liveness;
    var facts = document.getElementById("facts");
    facts.textContent = "";
    [["box", r.box], ["attempt", r.attempt], ["step", r.step], ["loss", fmtNum(r.loss, 5)],
     ["lr", fmtNum(r.lr, 3)], ["tokens/s", fmtNum(r.tokens_per_s, 3)],
     ["GPU", r.gpu_util === null ? "-" : Math.round(r.gpu_util) + "%"],
     ["GPU mem", r.gpu_mem_used === null ? "-" : fmtBytes(r.gpu_mem_used) + "/" + fmtBytes(r.gpu_mem_total)],
     ["last beat", fmtAge(r.age_s) + " ago"]].concat(
      r.phase ? [["phase", phaseText(r.phase) + (r.phase.status ? " (" + r.phase.status + ")" : "")]] : [],
      r.node ? [["node", r.node.rank + " of " + r.node.nnodes]] : [],
      r.deadline && r.deadline.at ? [["deadline", deadlineText(r.deadline)]] : []).forEach(function (kv) {
      var s = facts.appendChild(el("span", null, kv[0] + " "));
      s.appendChild(el("b", null, kv[1] === null || kv[1] === undefined ? "-" : kv[1]));
    });
    var ck = document.getElementById("ckpt");
    ck.textContent = "";
    var d = r.durable;
    ck.appendChild(el("div", null, d ? ckptLabel(r) + (d.committed_at ? ", committed " + fmtTime(d.committed_at) : "")
                                     : r.checkpoint === "none" ? "none: nothing is committed" : "none reported yet"));
    if (d) ck.appendChild(el("div", null, "verified on the box: " + (r.box_verified ? "yes" : "not reported")));
    if (r.last_sync) {
      ck.appendChild(el("div", r.last_sync.ok ? null : "error", "last sync: " +
        (r.last_sync.ok ? "ok" : "FAILED " + (r.last_sync.error || "")) + ", " + fmtTime(r.last_sync.at)));
    }
    var p = ck.appendChild(el("div", "pulled pulled-" + (r.pulled ? r.pulled.status : "unknown"),
                              "pulled home: " + (r.pulled ? r.pulled.text : "-")));
    p.id = "pulled";
    ck.appendChild(el("div", "note", r.pulls_note));
    var alerts = document.getElementById("alerts");
    if (r.alerts && r.alerts.length) alertsInto(alerts, r.alerts, true);
    else alerts.textContent = "none";
    showPage(r.page, r);
    if (r.log_tail) {
      document.getElementById("log").hidden = false;
      document.getElementById("log-tail").textContent = r.log_tail.join("\n");
      document.getElementById("log-count").textContent = r.log_lines_total ?
        " (the last " + r.log_tail.length + " of " + r.log_lines_total + " lines)" : "";
    }
  }

  // -- what the run is: its launch, start, elapsed time, durable target, profile, heartbeat, work at risk, next step
  function fmtDur(s) {  // 3h 12m, 4m 05s, 12.5s
    if (s === null || s === undefined) return "-";
    if (s < 60) return (s < 10 ? s.toFixed(1) : Math.round(s)) + "s";
    var h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), sec = Math.floor(s % 60);
    return h ? h + "h " + (m < 10 ? "0" : "") + m + "m" : m + "m " + (sec < 10 ? "0" : "") + sec + "s";
  }
  function quoteWord(w) {  // as a shell would need it
    return /^[A-Za-z0-9_@%+=:,./-]+$/.test(w) ? w : "'" + String(w).replace(/'/g, "'\\''") + "'";
  }
  var PART_TEXT = {productive: "training it kept", recomputed: "steps trained again", down: "no trainer running",
                   restoring: "fetch and verify before the start", starting: "start to the first step",
                   stalled: "no step, stall alert up"};

  function showPage(pg, r) {
    var dl = document.getElementById("run-facts");
    if (!dl) return;
    dl.textContent = "";
    pg = pg || {};
    var risk = pg.at_risk || {};
    var rows = [
      ["command", pg.command ? pg.command.map(quoteWord).join(" ") : "not launched from this machine"],
      ["started", pg.started_at ? fmtTime(pg.started_at) : "-"],
      ["elapsed", fmtDur(pg.elapsed_s)],
      ["durable target", pg.durable || "-"],
      ["profile", (pg.profile || "-") + (pg.pool ? " (pool " + pg.pool + ")" : "") +
        (isNum(pg.price) ? ", " + pg.price + " an hour" : "")],
      ["heartbeat", isNum(pg.interval_s) ? "every " + fmtDur(pg.interval_s) : "-"],
      ["deadline", r.deadline && r.deadline.at ? deadlineText(r.deadline) : "none"],
      // the figure `onboxctl status` shows (its AT RISK cell: time/steps since the durable checkpoint's step)
      ["work at risk", risk.steps === null || risk.steps === undefined ? "-" :
        risk.steps + " steps" + (isNum(risk.seconds) ? ", " + fmtDur(risk.seconds) : "") +
        (isNum(risk.durable_step) ? " since step " + risk.durable_step + " (durable)" : " (nothing durable yet)") +
        (risk.text ? "; AT RISK " + risk.text : "")]];
    rows.forEach(function (kv) {
      var dt = dl.appendChild(el("dt", null, kv[0]));
      var dd = dl.appendChild(el("dd", kv[0] === "command" ? "cmd" : null, kv[1]));
      dd.dataset.fact = dt.dataset.fact = kv[0].replace(/ /g, "-");
    });
    var next = document.getElementById("next-step");
    next.textContent = "";
    next.hidden = !pg.next_step;
    if (pg.next_step) {
      next.dataset.by = pg.next_step.by;
      next.appendChild(el("b", null, "next: "));
      next.appendChild(document.createTextNode(pg.next_step.text));
    }
    showLedger(pg.ledger);
  }

  function showLedger(led) {  // a bar of the run's wall time, each segment where it went; a row per part
    var bar = document.getElementById("ledger-bar"), table = document.getElementById("ledger");
    var note = document.getElementById("ledger-note");
    bar.textContent = "";
    table.textContent = "";
    if (!led || !led.wall_s) {
      note.textContent = "No ledger yet: it starts with the run's first beat.";
      return;
    }
    (led.segments || []).forEach(function (sg) {
      var seg = bar.appendChild(el("span", "seg part-" + sg[2]));
      seg.style.width = (100 * (sg[1] - sg[0]) / led.wall_s) + "%";
      seg.dataset.part = sg[2];
      seg.title = sg[2] + " on " + sg[3] + ": " + fmtDur(sg[1] - sg[0]) + " from " + fmtTime(sg[0]);
    });
    var money = led.money && led.money.parts ? led.money.parts : {};
    var head = table.appendChild(el("tr"));
    ["", "part", "time", "share", "cost"].forEach(function (h) { head.appendChild(el("th", null, h)); });
    PARTS.forEach(function (part) {
      var tr = table.appendChild(el("tr"));
      tr.dataset.part = part;
      tr.appendChild(el("td")).appendChild(el("span", "swatch part-" + part));
      var name = tr.appendChild(el("td", null, part));
      name.title = PART_TEXT[part];
      tr.appendChild(el("td", "num", fmtDur(led.parts[part])));
      tr.appendChild(el("td", "num", (100 * led.parts[part] / led.wall_s).toFixed(1) + "%"));
      tr.appendChild(el("td", "num", isNum(money[part]) ? money[part].toFixed(2) : "-"));
    });
    note.textContent = "goodput " + (led.goodput === null ? "-" : (100 * led.goodput).toFixed(1) + "%") +
      " of " + fmtDur(led.wall_s) + "; " + led.kept_steps + " steps kept, " + led.recomputed_steps +
      " trained again over " + led.losses.length + (led.losses.length === 1 ? " loss" : " losses") +
      (Object.keys(led.overlap_s || {}).length ? "; " + Object.keys(led.overlap_s).map(function (b) {
        return fmtDur(led.overlap_s[b]) + " on " + b + " beside a newer life";
      }).join(", ") : "");
  }

  // -- the keeper's marks: a recovery (one mark, whatever its number of events) and the keeper's failures -------
  function stepAt(t) {  // the step of the newest beat at or before time t (null before the first)
    var P = S.points, best = null, bt = -Infinity;
    for (var i = 0; i < P.seq.length; i++) {
      if (P.step[i] !== null && P.time[i] !== null && P.time[i] <= t && P.time[i] >= bt) {
        bt = P.time[i];
        best = P.step[i];
      }
    }
    return best;
  }
  function eventLine(ev) {
    return new Date(ev.time * 1000).toLocaleTimeString() + " " + ev.kind + ": " + (ev.text || "");
  }
  function boxList(names, provisioned) {  // "spare s0", "provisioned box p0", "spares s0, s1"
    var prov = provisioned || [];
    var spares = names.filter(function (n) { return prov.indexOf(n) < 0; });
    var out = [];
    if (spares.length) out.push((provisioned ? (spares.length > 1 ? "spares " : "spare ") : "") + spares.join(", "));
    if (names.length > spares.length) {
      out.push((names.length - spares.length > 1 ? "provisioned boxes " : "provisioned box ") +
               names.filter(function (n) { return prov.indexOf(n) >= 0; }).join(", "));
    }
    return out.join(" and ");
  }

  function recoveryMark(g) {
    // "recovery 1: gpu1 lost → spare s0, resumed at step 1350 (41.5 s to the first new step)"; at the time the
    // box was declared lost (a relaunch on the same box: detected), and over steps at the step it resumed from
    // (until the keeper knows it, the step of the newest beat before that time)
    var e = g.last, lost = e.declared_lost, det = e.detected, first = e.first_new_step;
    var at = lost || det || g.all[0];
    var from = (at.boxes || []).join(", ") || "?";
    var placed = first || e.relaunched || e.box_chosen;
    var to = placed && Array.isArray(placed.to_boxes) ? placed.to_boxes : first && Array.isArray(first.boxes) ?
      first.boxes : null;
    var chosen = e.box_chosen && Array.isArray(e.box_chosen.to_boxes) ? e.box_chosen : null;
    if (lost && !e.relaunched && e.box_failed && (!e.box_chosen || e.box_failed.id > e.box_chosen.id)) {
      to = chosen = null;  // the chosen box failed before the launch: another is being found
    }
    var step = first && isNum(first.resume_step) ? first.resume_step : null;
    var text;
    if (lost) {
      text = from + " lost → " + (e.failed_no_resource ? "no box found" :
                                  to ? boxList(to, chosen && chosen.provisioned) : "finding a box");
    } else {
      text = (e.relaunched ? "relaunched" : "relaunching") + " on the same box " + from;
    }
    if (first) {
      var took = isNum(first.took_s) ? first.took_s : first.time - (det || at).time;
      text += (step !== null ? ", resumed at step " + step : isNum(first.first_step) ?
               ", trains again at step " + first.first_step : ", trains again") +
              " (" + Number(took.toFixed(1)) + " s to the first new step)";
    } else if (e.failed_launch) {
      text += ": every launch failed";
    } else if (e.relaunched) {
      text += (lost ? ", relaunched" : "") + ", waiting for its first new step";
    } else if (!lost && e.box_failed) {
      text += ": " + e.box_failed.text;
    } else if (lost && to && !e.failed_no_resource) {
      text += ", relaunching";
    }
    text = "recovery " + g.id + ": " + text;
    return {kind: "recovery", recovery: g.id, time: at.time, step: step !== null ? step : stepAt(at.time),
            resumed: step !== null, done: !!first, text: text, title: g.all.map(eventLine).join("\n")};
  }

  function buildMarks() {
    var groups = {}, order = [], marks = [];
    S.keeper.events.forEach(function (ev) {
      if ((ev.source || "keeper") !== "keeper" || !isNum(ev.time)) return;
      if (KEEPER_MARKS[ev.kind]) {
        marks.push({kind: ev.kind, recovery: isNum(ev.recovery) ? ev.recovery : null, time: ev.time,
                    step: stepAt(ev.time), text: KEEPER_MARKS[ev.kind] + ": " + (ev.text || ""), title: eventLine(ev)});
      }
      if (RECOVERY_KINDS.indexOf(ev.kind) >= 0 && isNum(ev.recovery)) {
        var g = groups[ev.recovery];
        if (!g) {
          g = groups[ev.recovery] = {id: ev.recovery, last: {}, all: []};
          order.push(g);
        }
        g.all.push(ev);
        g.last[ev.kind] = ev;  // the newest of each kind (a box that failed is chosen again)
      }
    });
    order.forEach(function (g) { marks.push(recoveryMark(g)); });
    marks.sort(function (a, b) { return a.time - b.time; });
    S.marks = marks;
  }

  function showEvents() {  // restarts, boxes, preemptions, failures, the keeper's recoveries one by one, in time
    var box = document.getElementById("events");  // order; commits counted (ticks on the axis)
    box.textContent = "";
    var commits = S.events.filter(function (ev) { return ev.kind === "commit"; });
    var shown = S.events.filter(function (ev) { return ev.kind !== "commit"; }).concat(S.marks);
    shown.sort(function (a, b) { return (a.time || 0) - (b.time || 0); });
    shown.slice(-30).forEach(function (ev) {
      var e = box.appendChild(el("span", "ev ev-" + ev.kind));
      if (ev.title !== undefined) {  // a mark of the keeper's
        e.dataset.mark = ev.kind;
        if (ev.recovery !== null) e.dataset.recovery = ev.recovery;
        e.title = ev.title;
        e.appendChild(el("span", null, ev.text));
        return;
      }
      e.appendChild(el("span", null, ev.kind + ": " + ev.text + (ev.step !== null ? " (step " + ev.step + ")" : "")));
    });
    if (commits.length) {
      var last = commits[commits.length - 1];
      var c = box.appendChild(el("span", "ev ev-commit"));
      c.appendChild(el("span", null, commits.length + (commits.length === 1 ? " commit" : " commits") +
                       " (ticks on the axis), newest " + last.text + (last.step !== null ? " at step " + last.step : "")));
    }
  }

  function trainerOrder(R) {  // the trainer's points in (seq, arrival) order: the newest value of a step comes last
    var T = R.trainer, n = T.seq.length, idx = new Array(n);
    for (var i = 0; i < n; i++) idx[i] = i;
    if (!R.tsorted) idx.sort(function (a, b) { return T.seq[a] - T.seq[b] || a - b; });
    return idx;
  }

  function curve(R, col, xmode, order, join) {
    // one column of a run as a Map x -> value, over steps (a step done twice, after a resume from an older
    // checkpoint, keeps its newest value) or over time. The trainer's own points where the tracker sent them; the
    // beats for the rest (GPU), and for the trainer's columns the beats before the first that brought points (an
    // agent older than them) or all of them (a tracker older than them). A value that is not a finite number is a
    // gap (null) in a beat; in a trainer's point, a field its record did not carry.
    // The x of the newest point (the last in seq and arrival order, not the largest x: after a restart from scratch
    // the newest step is below the old ones) is kept as out.newest, for the legend.
    var out = new Map(), P = R.points, T = R.trainer, i, j, x, v;
    var useT = FROM_TRAINER[col] && R.served && T.seq.length > 0;
    out.newest = null;
    for (i = 0; i < P.seq.length; i++) {
      if (useT && P.seq[i] >= R.tfirst) break;  // the beats are in seq order
      x = xmode === "step" ? P.step[i] : P.time[i];
      // (with points: not a gap, nothing yet; a sparse curve, eval loss: a beat without one is no point of it)
      if (x !== null && !((useT || join) && P[col][i] === null)) {
        out.set(x, P[col][i]);
        if (P[col][i] !== null) out.newest = x;
      }
    }
    if (useT) {
      var ys = T[col], xs = xmode === "step" ? T.step : T.time;
      for (j = 0; j < order.length; j++) {
        i = order[j];
        v = ys[i];
        x = xs[i];
        if (v !== null && x !== null) {
          out.set(x, v);
          out.newest = x;
        }
      }
    }
    return out;
  }

  function chartSeries(def) {  // [run data, column, label, colour, scale, join gaps] of every curve on a chart
    var out = def.series.map(function (s) { return [S, s[0], s[1], s[2], s[3] || 1, !!s[4]]; });
    if (def.id === "loss" && S.compare) {
      out.forEach(function (s) { s[2] = S.run + " " + s[2]; });
      COMPARE_SERIES.forEach(function (s) {
        out.push([S.compare, s[0], S.compare.run + " " + s[1], s[2], s[3] || 1, !!s[4]]);
      });
    }
    return out;
  }

  function chartData(def) {
    // x: every step (or time) some curve of the chart has, ascending; a curve without a point at an x has
    // `undefined` there (uPlot draws across it), a gap in a beat is null (uPlot breaks the line)
    var orders = new Map(), maps = chartSeries(def).map(function (s) {
      if (!orders.has(s[0])) orders.set(s[0], FROM_TRAINER[s[1]] ? trainerOrder(s[0]) : []);
      return curve(s[0], s[1], S.xmode, orders.get(s[0]), s[5]);
    });
    var seen = new Set();
    maps.forEach(function (m) { m.forEach(function (_, x) { seen.add(x); }); });
    var xs = Array.from(seen).sort(function (a, b) { return a - b; });
    var breaks = new Set();
    if (S.xmode === "time") {  // the axis breaks where nothing was reported (a preemption, a box lost): no flat line
      var gap = gapSeconds(), broken = [];
      xs.forEach(function (x, i) {
        if (i && x - xs[i - 1] > gap) {
          var mid = (x + xs[i - 1]) / 2;
          broken.push(mid);
          breaks.add(mid);
        }
        broken.push(x);
      });
      xs = broken;
    }
    var data = [xs];
    data.newest = [null];
    chartSeries(def).forEach(function (s, k) {
      var m = maps[k], scale = s[4];
      data.newest.push(m.newest);
      data.push(xs.map(function (x) {
        if (breaks.has(x)) return null;
        var v = m.get(x);
        return v === undefined ? undefined : v === null ? null : v * scale;
      }));
    });
    return data;
  }

  function gapSeconds() {  // no point for this long over time: a gap (three heartbeat intervals, at least 2 s)
    var pg = S.summary && S.summary.page, interval = pg && isNum(pg.interval_s) ? pg.interval_s : 30;
    return Math.max(2, 3 * interval);
  }

  function drawEvents(u, id) {
    var ctx = u.ctx, top = u.bbox.top, h = u.bbox.height, left = u.bbox.left, right = left + u.bbox.width;
    var px = devicePixelRatio || 1;
    var drawn = S.drawn[id] = [];
    S.events.forEach(function (ev) {
      // a commit's tick sits at the checkpoint's own step (the beat that saw it was further on)
      var xv = S.xmode === "step" ? (ev.kind === "commit" && isNum(ev.ckpt_step) ? ev.ckpt_step : ev.step) : ev.time;
      if (xv === null || xv === undefined) return;
      var x = Math.round(u.valToPos(xv, "x", true));
      if (x < left || x > right) return;
      ctx.save();
      ctx.strokeStyle = EVENT_COLORS[ev.kind] || "#59636e";
      ctx.lineWidth = (ev.kind === "commit" ? 2 : 1.5) * px;
      ctx.beginPath();
      if (ev.kind === "commit") {  // a tick on the x axis: commits are frequent, the curve stays readable
        ctx.moveTo(x, top + h - 8 * px);
        ctx.lineTo(x, top + h);
      } else {
        ctx.setLineDash([5 * px, 4 * px]);
        ctx.moveTo(x, top);
        ctx.lineTo(x, top + h);
      }
      ctx.stroke();
      ctx.restore();
    });
    S.marks.forEach(function (m) {  // the keeper's, on top: a recovery a solid line, a failure a dashed one
      var xv = S.xmode === "step" ? m.step : m.time;
      if (xv === null || xv === undefined) return;
      var x = Math.round(u.valToPos(xv, "x", true));
      if (x < left || x > right) return;
      ctx.save();
      ctx.strokeStyle = EVENT_COLORS[m.kind] || "#59636e";
      ctx.lineWidth = 2 * px;
      if (m.kind !== "recovery") ctx.setLineDash([9 * px, 3 * px]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + h);
      ctx.stroke();
      ctx.restore();
      drawn.push({kind: m.kind, recovery: m.recovery, x: x, at: xv});
    });
  }

  function xRange(u, min, max) {  // the data's, widened to the keeper's marks (a failure after the last beat)
    if (min === null || max === null) return [min, max];
    S.marks.forEach(function (m) {
      var v = S.xmode === "step" ? m.step : m.time;
      if (isNum(v)) {
        min = Math.min(min, v);
        max = Math.max(max, v);
      }
    });
    return min === max ? [min - 1, max + 1] : [min, max];
  }

  function chartWidth(holder) {  // the grid cell's width (two columns, one on a narrow window), less padding
    var shown = document.querySelector("#charts .chart:not([hidden])");  // a hidden one has no width of its own
    return Math.max(280, ((holder && !holder.hidden ? holder : shown) || holder).clientWidth - 10);
  }

  function latestText(u) {  // the newest value of each curve, in its legend, while the pointer is not on the chart
    if (u.cursor.idx !== null && u.cursor.idx !== undefined) return;
    var cells = u.root.querySelectorAll(".u-legend .u-series .u-value"), xs = u.data[0], newest = [];
    var at = u.onboxNewest || [];  // the x of each curve's newest point (chartData), not its largest x
    u.series.forEach(function (ser, k) {
      var ys = u.data[k], i = ys.length - 1;
      if (k > 0 && at[k] !== null && at[k] !== undefined) i = xs.indexOf(at[k]);
      if (k > 0) while (i >= 0 && (ys[i] === null || ys[i] === undefined)) i--;
      var text = i < 0 ? "-" : k === 0 ? (S.xmode === "step" ? String(xs[i]) : fmtTime(xs[i])) : fmtNum(ys[i], 4);
      if (k > 0 && i >= 0 && i < xs.length - 1) {  // older than the chart's newest x (an eval loss): say where
        text += S.xmode === "step" ? " @ step " + xs[i] : " @ " + new Date(xs[i] * 1000).toLocaleTimeString();
      }
      newest.push(text);
      if (cells[k]) cells[k].textContent = text;
    });
    u.onboxLatest = newest;
  }

  function hasData(data) {
    return data.slice(1).some(function (ys) { return ys.some(function (y) { return y !== null && y !== undefined; }); });
  }

  function makeCharts() {
    buildMarks();
    S.charts.forEach(function (u) { u.destroy(); });
    S.charts = [];
    var box = document.getElementById("charts");
    box.textContent = "";
    CHARTS.forEach(function (def) {
      var holder = box.appendChild(el("div", "chart"));
      holder.id = "chart-" + def.id;
      var data = chartData(def);
      var opts = {
        title: def.id === "loss" && S.compare ? def.title + ": " + S.run + " and " + S.compare.run : def.title,
        width: chartWidth(holder), height: 220,
        scales: {x: {time: S.xmode === "time", range: xRange}},
        series: [{label: S.xmode === "step" ? "step" : "time"}].concat(chartSeries(def).map(function (s) {
          // no spanGaps: a curve joins its points across x's it has none at (undefined), and breaks at a null (a
          // value that was not a number, a gap in time); a sparse curve's beats without one are no points of it
          return {label: s[2], stroke: s[3], width: 1.5, spanGaps: false, points: {show: s[5], size: 4},
                  value: function (u, v) { return v === null || v === undefined ? "-" : fmtNum(v, 4); }};
        })),
        axes: [{space: S.xmode === "time" ? 90 : 60, label: S.xmode === "step" ? "step" : "time (the box's clock)",
                labelSize: 22},
               {size: 64, label: def.y, labelSize: 22, values: function (u, vals) { return vals.map(fmtAxis); }}],
        hooks: {draw: [function (u) { drawEvents(u, def.id); }], setLegend: [latestText]}
      };
      var u = new uPlot(opts, data, holder);
      u.onboxId = def.id;
      u.onboxNewest = data.newest;
      latestText(u);
      S.charts.push(u);
    });
    showCharts();
    showEvents();
  }

  function showCharts() {  // a chart with nothing to draw is not shown (a GPU-less box, a trainer without an lr)
    var shown = 0;
    S.charts.forEach(function (u) {
      var holder = u.root.parentNode, empty = !hasData(u.data), was = holder.hidden;
      holder.hidden = empty;
      holder.dataset.empty = String(empty);
      if (!empty) shown++;
      if (was && !empty) u.setSize({width: chartWidth(holder), height: 220});  // it was laid out hidden
      latestText(u);
    });
    var note = document.getElementById("no-curves");
    if (!shown && !note) {
      note = el("p", "note", "No metrics in this run's beats yet: its curves appear with its first step or loss.");
      note.id = "no-curves";
      document.getElementById("charts").appendChild(note);
    } else if (shown && note) {
      note.remove();
    }
  }

  function updateCharts() {
    if (!S.charts.length) return;  // the first draw happens once the history is loaded
    buildMarks();
    S.charts.forEach(function (u, i) {
      var data = chartData(CHARTS[i]);
      u.onboxNewest = data.newest;
      u.setData(data);
    });
    showCharts();
    showEvents();
  }

  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      S.charts.forEach(function (u) { u.setSize({width: chartWidth(u.root.parentNode), height: 220}); });
    }, 150);
  });

  // -- polling ---------------------------------------------------------------------------------------------------
  function schedule() {
    clearTimeout(S.timer);
    S.timer = setTimeout(tick, POLL_MS);
  }
  function tick() {
    if (document.hidden) return;  // resumed by visibilitychange
    (S.view === "run" ? pollRun().then(pollKeeper).then(pollCompare) : pollList()).then(function () {
      S.errors = 0;
      banner(null);
      schedule();
    }, failed);
  }
  function failed(e) {
    if (e && e.login) return;
    S.errors++;
    S.lastError = String(e && e.message || e);
    banner("The tracker did not answer (" + S.lastError + "); retrying.");
    schedule();
  }
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) {
      clearTimeout(S.timer);
      tick();
    }
  });

  function start() {
    var m = location.pathname.match(/^\/run\/([^/]+)$/);
    (m ? runView(decodeURIComponent(m[1])) : listView()).then(schedule, failed);
  }
  start();
})();
