// The dashboard at `/`: draws the data the page was rendered with, then keeps it live
// over the WebSocket `/ws/dashboard/`, which sends a full snapshot on connect and again
// whenever something changed. The socket is re-opened with backoff when it drops; close
// code 4403 means the session may no longer see the page, and then it stops.
(function () {
  "use strict";

  const FORBIDDEN = 4403;
  const MIN_DELAY_MS = 500;
  const MAX_DELAY_MS = 30000;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = value;
      else if (name === "className") node.className = value;
      else if (name === "style") node.style.cssText = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function shortTime(iso) {
    if (!iso) return "";
    const when = new Date(iso);
    if (Number.isNaN(when.getTime())) return iso.slice(0, 19);
    const sameDay = when.toDateString() === new Date().toDateString();
    return sameDay ? when.toLocaleTimeString() : when.toLocaleString();
  }

  function timeNode(iso, className) {
    return el("time", { datetime: iso, className: className, title: iso, text: shortTime(iso) });
  }

  // How long ago, by this browser's clock ("3 s ago", "4 min ago"; older: the time itself).
  function agoText(iso) {
    const when = new Date(iso).getTime();
    if (Number.isNaN(when)) return shortTime(iso);
    const seconds = Math.max(0, Math.round((Date.now() - when) / 1000));
    if (seconds < 60) return seconds + " s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min ago";
    return shortTime(iso);
  }

  // A time shown as how long ago, kept current every second (see start).
  function agoNode(iso) {
    const node = el("time", { datetime: iso, title: shortTime(iso), text: agoText(iso) });
    node.dataset.ago = "";
    return node;
  }

  function refreshAgo() {
    for (const node of document.querySelectorAll("time[data-ago]")) {
      node.textContent = agoText(node.getAttribute("datetime"));
    }
  }

  // --- hosts and their pools ---------------------------------------------------------

  function segmentTitle(seg) {
    return (seg.deployment ? seg.deployment + ": " : "") + seg.size + " " + seg.status;
  }

  function poolNode(pool) {
    const bar = el("div", {
      className: "bar",
      role: "img",
      "aria-label": `${pool.pool}: ${pool.used} used of ${pool.capacity}`,
    });
    for (const seg of pool.segments) {
      bar.append(
        el("span", {
          className: "seg seg-" + seg.status,
          "data-status": seg.status,
          "data-deployment": seg.deployment,
          style: `width: ${seg.percent.toFixed(3)}%`,
          title: segmentTitle(seg),
        }),
      );
    }
    return el(
      "div",
      { className: "pool" + (pool.over ? " over" : ""), "data-pool": pool.pool },
      el(
        "div",
        { className: "pool-label" },
        el("strong", { text: pool.pool }),
        " ",
        el("span", {
          className: "muted",
          text: `${pool.used} used of ${pool.capacity} · ${pool.free} free · ${pool.reserve} reserved`,
        }),
      ),
      bar,
    );
  }

  function hostNode(host) {
    const meta = [host.local ? "this machine" : host.address];
    if (host.probe) meta.push("probe " + host.probe);
    if (host.measures) meta.push("measures " + host.measures);
    const metaNode = el("span", { className: "muted host-meta", text: meta.join(" · ") });
    if (host.last_seen_at) metaNode.append(" · last seen ", agoNode(host.last_seen_at));
    const card = el(
      "article",
      { className: "card host", "data-host": host.name },
      el(
        "h2",
        {},
        host.name + " ",
        el("span", { className: "host-state host-" + host.state, text: host.state }),
        " ",
        metaNode,
      ),
    );
    if (host.pools.length === 0) {
      card.append(
        el("p", { className: "muted", text: "No pools: this host has not reported its devices yet." }),
      );
    }
    for (const pool of host.pools) card.append(poolNode(pool));
    return card;
  }

  function drawHosts(hosts) {
    const section = document.getElementById("hosts");
    const nodes = hosts.map(hostNode);
    if (nodes.length === 0) nodes.push(el("p", { className: "card muted", text: "No hosts yet." }));
    section.replaceChildren(...nodes);
  }

  // --- models ------------------------------------------------------------------------

  function deploymentRow(d) {
    const memory = el("td", { className: "memory" });
    for (const m of d.memory) {
      memory.append(
        el("span", {
          className: "mem mem-" + m.status,
          title: `${m.host}/${m.pool} ${m.status}`,
          text: `${m.pool} ${m.size}`,
        }),
      );
    }
    if (d.memory.length === 0) memory.append(el("span", { className: "muted", text: "—" }));

    const detail = el("td", { className: "detail" });
    if (d.parked_mode) detail.append(el("span", { className: "tag", text: d.parked_mode }), " ");
    detail.append(el("span", { className: "muted", text: d.state_reason }));

    const lastSwitch = el("td", { className: "switch" });
    if (d.last_switch) {
      const s = d.last_switch;
      lastSwitch.append(s.step + (s.took ? " in " + s.took : "") + " ", timeNode(s.at, "muted"));
    } else {
      lastSwitch.append(el("span", { className: "muted", text: "—" }));
    }

    return el(
      "tr",
      { "data-deployment": d.name, "data-state": d.observed_state },
      el(
        "td",
        { className: "name" },
        el("strong", { text: d.name }),
        d.pinned ? " " : null,
        d.pinned ? el("span", { className: "tag", text: "pinned" }) : null,
        (d.adapters || []).length
          ? el(
              "div",
              { className: "adapters muted" },
              "adapters: ",
              ...d.adapters.flatMap((a, i) => [
                i ? ", " : null,
                el("span", {
                  className: "adapter adapter-" + a.state.replaceAll(" ", "-"),
                  title: a.state,
                  text: a.name + (a.state === "loaded" ? " (loaded)" : ""),
                }),
              ]),
            )
          : null,
      ),
      el(
        "td",
        { className: "engine" },
        d.engine + " ",
        el("span", { className: "muted", text: d.kind }),
        d.engine_parks_kept_memory
          ? el("span", {
              className: "tag warn parks-kept",
              text: "parks kept memory: stopped instead",
              title: "A park of this engine left its GPU memory held; its models are stopped " +
                "instead of parked until a park check at an idle moment frees memory.",
            })
          : null,
      ),
      el("td", { className: "host", text: d.host || "—" }),
      el("td", { className: "state state-" + d.observed_state, text: d.observed_state }),
      detail,
      el("td", { className: "desired", text: d.desired_state }),
      memory,
      el("td", { className: "inflight num", text: d.in_flight }),
      el(
        "td",
        { className: "waiting num" },
        String(d.waiting),
        d.waiting_for_room_seconds === null || d.waiting_for_room_seconds === undefined
          ? null
          : el("span", { className: "muted room", text: ` for room ${d.waiting_for_room_seconds} s` }),
      ),
      lastSwitch,
    );
  }

  function drawDeployments(deployments) {
    const body = document.querySelector("#deployments tbody");
    const rows = deployments.map(deploymentRow);
    if (rows.length === 0) {
      const cell = el("td", { colspan: 10, className: "muted" }, "No models yet: add one with ");
      cell.append(el("code", { text: "capyctl deployment add" }), " or in the admin.");
      rows.push(el("tr", { className: "empty" }, cell));
    }
    body.replaceChildren(...rows);
  }

  // --- the timeline ----------------------------------------------------------------

  const SVG = "http://www.w3.org/2000/svg";
  const LANE = 22;
  const QUEUE = 28;
  const LABEL = 56;
  const WIDTH = 1000;

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children) if (child) node.append(child);
    return node;
  }

  // Each model its own colour: the models of the timeline in name order, around the wheel.
  const PALETTE = [210, 30, 140, 280, 0, 90, 180, 320];
  let hues = new Map();

  function assignHues() {
    const models = new Set();
    for (const host of timeline.hosts) {
      for (const pool of host.pools) for (const span of pool.spans) models.add(span.model);
    }
    hues = new Map([...models].sort().map((m, i) => [m, PALETTE[i % PALETTE.length] + 7 * Math.floor(i / PALETTE.length)]));
  }

  function hue(name) {
    return hues.has(name) ? hues.get(name) : 0;
  }

  function title(text) {
    const node = svg("title");
    node.textContent = text;
    return node;
  }

  function timelineHost(host, windowSeconds, now) {
    const start = now - windowSeconds;
    const plot = WIDTH - LABEL;
    const x = (t) => LABEL + Math.max(0, Math.min(1, (t - start) / windowSeconds)) * plot;
    const height = host.pools.length * LANE + QUEUE + 18;
    const chart = svg("svg", {
      viewBox: `0 0 ${WIDTH} ${height}`, width: "100%", role: "img", class: "timeline",
      "data-host": host.host, "aria-label": `${host.host}: the last hour of its GPUs`,
    });
    host.pools.forEach((pool, index) => {
      const y = index * LANE;
      const lane = svg("g", { "data-pool": pool.pool });
      const label = svg("text", { x: 0, y: y + 15, class: "lane-label" });
      label.textContent = pool.pool;
      lane.append(label, svg("rect", { x: LABEL, y: y + 2, width: plot, height: LANE - 4, class: "lane" }));
      for (const span of pool.spans) {
        const to = span.to === null ? now : span.to;
        if (to < start) continue;
        const from = x(span.from);
        const held = span.kind === "held";
        lane.append(svg("rect", {
          x: from, y: y + 2, width: Math.max(x(to) - from, 1), height: LANE - 4,
          class: "span span-" + span.kind, "data-model": span.model, "data-kind": span.kind,
          fill: `hsl(${hue(span.model)} 55% ${held ? 55 : 80}%)`,
        }, title(`${span.model}: ${held ? "held " + pool.pool : span.kind}`)));
      }
      for (const mark of pool.marks) {
        if (mark.at < start) continue;
        const mx = x(mark.at);
        lane.append(svg("path", {
          d: `M${mx - 4} ${y} L${mx + 4} ${y} L${mx} ${y + 7} Z`, class: "mark",
          "data-model": mark.model,
        }, title(mark.text)));
      }
      chart.append(lane);
    });
    const top = host.pools.length * LANE + 4;
    const most = Math.max(1, ...host.queue.map((p) => p[1]));
    let path = `M${LABEL} ${top + QUEUE}`;
    let last = 0;
    for (const [at, depth] of host.queue) {
      if (at < start) { last = depth; continue; }
      const px = x(at);
      path += ` L${px} ${top + QUEUE - (last / most) * QUEUE} L${px} ${top + QUEUE - (depth / most) * QUEUE}`;
      last = depth;
    }
    path += ` L${LABEL + plot} ${top + QUEUE - (last / most) * QUEUE} L${LABEL + plot} ${top + QUEUE} Z`;
    const queueLabel = svg("text", { x: 0, y: top + QUEUE - 4, class: "lane-label" });
    queueLabel.textContent = "waiting";
    chart.append(queueLabel, svg("path", { d: path, class: "queue" }, title(`at most ${most} waiting`)));
    const axis = top + QUEUE + 14;
    const ago = (seconds) => (seconds >= 60 ? `−${Math.round(seconds / 60)} min` : `−${Math.round(seconds)} s`);
    for (const [label, at] of [[ago(windowSeconds), start], [ago(windowSeconds / 2), start + windowSeconds / 2], ["now", now]]) {
      const tick = svg("text", { x: x(at), y: axis, class: "axis", "text-anchor": at === start ? "start" : at === now ? "end" : "middle" });
      tick.textContent = label;
      chart.append(tick);
    }
    const legend = el("p", { className: "legend" });
    const models = new Set(host.pools.flatMap((pool) => pool.spans.map((span) => span.model)));
    for (const model of [...models].sort()) {
      legend.append(el("span", {}, el("i", { className: "swatch", style: `background: hsl(${hue(model)} 55% 55%)` }), model));
    }
    legend.append(el("span", {}, el("i", { className: "swatch switching" }), "lighter: starting, waking, parking"));
    return el("article", { className: "card timeline-host", "data-host": host.host },
      el("strong", { text: host.host }), chart, legend);
  }

  let timeline = null;
  let zoom = "auto"; // or a window in seconds, chosen with the buttons

  // The window drawn: the one chosen, or the shortest of these that shows every span.
  const WINDOWS = [60, 300, 900, 1800, 3600];

  function windowSeconds(now) {
    if (zoom !== "auto") return Number(zoom);
    let earliest = now;
    for (const host of timeline.hosts) {
      for (const pool of host.pools) for (const span of pool.spans) earliest = Math.min(earliest, span.from);
    }
    const shown = WINDOWS.find((w) => w >= (now - earliest) * 1.05);
    return Math.min(shown || timeline.window, timeline.window);
  }

  function drawTimeline(data) {
    if (data) timeline = data;
    const section = document.getElementById("timeline");
    if (!section || !timeline) return;
    const now = Date.now() / 1000;
    assignHues();
    const seconds = windowSeconds(now);
    const nodes = timeline.hosts.map((host) => timelineHost(host, seconds, now));
    if (nodes.length === 0) {
      nodes.push(el("p", { className: "card muted", text: "No GPU has been held in the last hour." }));
    }
    section.replaceChildren(...nodes);
  }

  // --- events ------------------------------------------------------------------------

  function eventNode(e) {
    const extra = [];
    if (e.actor) extra.push("by " + e.actor);
    if (e.took) extra.push("took " + e.took);
    return el(
      "li",
      { "data-event": e.id, className: "level-" + e.level },
      timeNode(e.at),
      " ",
      el("span", { className: "level", text: e.level }),
      " ",
      el("span", { className: "kind", text: e.kind }),
      " ",
      e.subject ? el("strong", { className: "subject", text: e.subject }) : null,
      e.subject ? " " : null,
      el("span", { className: "message", text: e.message }),
      " ",
      el("span", { className: "muted", text: extra.join(" · ") }),
    );
  }

  function drawEvents(events) {
    const list = document.getElementById("events");
    const items = events.map(eventNode);
    if (items.length === 0) {
      items.push(el("li", { className: "muted empty", text: "Nothing has happened yet." }));
    }
    list.replaceChildren(...items);
  }

  function drawControlPlane(plane) {
    const banner = document.getElementById("control-plane");
    if (!banner || !plane) return;
    banner.hidden = plane.redis !== "down";
    if (banner.hidden) return;
    const since = plane.since ? [" since ", timeNode(plane.since)] : [];
    banner.replaceChildren("Redis does not answer", ...since,
      ": ready models keep answering; switches wait or are refused until it is back.");
  }

  function draw(data) {
    drawControlPlane(data.control_plane);
    drawHosts(data.hosts);
    drawDeployments(data.deployments);
    drawEvents(data.events);
    drawTimeline(data.timeline);
  }

  // --- the live feed -----------------------------------------------------------------

  function setStatus(status, text, title) {
    const badge = document.getElementById("live-status");
    badge.dataset.status = status;
    badge.title = title;
    badge.replaceChildren(text);
    if (status === "logged-out") {
      badge.append(" · ", el("a", { href: "/login/?next=/", text: "log in" }));
    }
  }

  let delay = MIN_DELAY_MS;

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/ws/dashboard/`);
    socket.addEventListener("open", () => {
      delay = MIN_DELAY_MS;
      setStatus("live", "live", "updates as they happen");
    });
    socket.addEventListener("message", (message) => {
      let payload;
      try {
        payload = JSON.parse(message.data);
      } catch (error) {
        console.warn("dashboard: a message that is not JSON", error);
        return;
      }
      if (payload.type === "snapshot") draw(payload.data);
    });
    socket.addEventListener("close", (event) => {
      if (event.code === FORBIDDEN) {
        setStatus("logged-out", "logged out", "this session may no longer see the dashboard");
        return;
      }
      const wait = Math.round(delay * (0.8 + Math.random() * 0.4));
      delay = Math.min(delay * 2, MAX_DELAY_MS);
      setStatus("reconnecting", "reconnecting…", `connection lost; trying again in ${Math.ceil(wait / 1000)} s`);
      window.setTimeout(connect, wait);
    });
  }

  function start() {
    const initial = document.getElementById("dashboard-data");
    if (initial) draw(JSON.parse(initial.textContent));
    window.setInterval(() => drawTimeline(null), 2000); // the window moves with the clock
    window.setInterval(refreshAgo, 1000);
    for (const button of document.querySelectorAll("[data-window]")) {
      button.addEventListener("click", () => {
        zoom = button.dataset.window;
        for (const other of document.querySelectorAll("[data-window]")) {
          other.setAttribute("aria-pressed", String(other === button));
        }
        drawTimeline(null);
      });
    }
    if ("WebSocket" in window) {
      setStatus("connecting", "connecting…", "opening the live feed");
      connect();
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
