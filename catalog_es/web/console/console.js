// The catalog-es console: plain JavaScript over the HTTP API, no build step.
// Pages are routed by the hash: #/models[?at=R][&q=TEXT] and #/model/NAME[?at=R];
// a past revision may add &declared=then (over the declared config recorded then).
// Everything shown is built with textContent, never innerHTML: model names,
// reasons and actors are data typed by other people.
"use strict";

const TOKEN_KEY = "catalog-es-token";
// How long a request of the API may take before the page gives up on it.
const API_TIMEOUT_MS = 60000;
// ``lost``: the log went back under this page (a restored backup, a failover),
// the heads before and after, told until dismissed or signing out.
// ``shownNow``: the page ``shown`` was drawn as now (a revision asked for
// that was the head is).
// ``dragging``: the slider is held by the pointer; ``held``: a redraw waits
// for its release.
const state = { head: 0, me: null, follow: null, rendering: 0, flash: null, shown: null, shownNow: false, lost: null, replacing: false, dragging: false, held: false };

// -- small helpers -------------------------------------------------------------

function h(tag, attrs, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) element.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

const $ = (selector) => document.querySelector(selector);

// Counts go up to 2^63 - 1, and a double holds whole numbers exactly only up
// to 2^53: JSON.parse read 9007199254740993 as 9007199254740992, and the page
// showed it so. Whole numbers past that are read from their source text as
// BigInt, and written back as the same digits. The reviver reads a list of
// 20,000 models (9 MB) ten times as slowly as JSON.parse alone (0.4 s, not
// 0.04 s): it is used only on text holding 16 digits in a row, as any number
// past 2^53 does, and only where the browser gives a reviver the source text
// (with JSON.rawJSON: Chromium 114, Firefox 135): elsewhere the reviver threw
// on every such answer, and the page showed none.
const SOURCE_TEXT = typeof JSON.rawJSON === "function";
const exactNumber = (key, value, context) =>
  typeof value === "number" && !Number.isSafeInteger(value) && /^-?[0-9]+$/.test(context.source) ? BigInt(context.source) : value;
const exactDigits = (key, value) => (typeof value === "bigint" ? JSON.rawJSON(String(value)) : value);
const parsed = (text) => (SOURCE_TEXT && /[0-9]{16}/.test(text) ? JSON.parse(text, exactNumber) : JSON.parse(text));
const show = (value) => JSON.stringify(value, exactDigits);
const short = (text, length = 12) => (text && text.length > length ? text.slice(0, length) + "…" : text || "—");
const scaling = (m) => `${m.scaling.min}..${m.scaling.max}`;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path, { method = "GET", body, ifMatch } = {}) {
  const headers = { Authorization: `Bearer ${token()}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (ifMatch !== undefined) headers["If-Match"] = String(ifMatch);
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : show(body),
      // An answer that never comes must not hold up the next redraw for good.
      signal: AbortSignal.timeout(API_TIMEOUT_MS),
    });
  } catch (error) {
    // The server stopped, or out of reach: the browser's words alone
    // ("Failed to fetch", "signal timed out") were shown.
    throw new Error(`No answer from the server (${error.message}).`);
  }
  const data = await response.text().then(parsed).catch(() => null);
  if (response.status === 401) signOut(data && data.error);
  // Refused what the page offered: the token's role was lowered in the
  // tokens file since the page learnt it (the header and the rollback's
  // Confirm stayed until the next sign-in). The page learns it again.
  if (response.status === 403 && path !== "/me") await relearnRole();
  // A 200 that is no JSON (a proxy's sign-in page) was read as the answer
  // and failed as a script ("Cannot read properties of null").
  if (!response.ok || data === null) throw new ApiError(response.status, said(response, data));
  return data;
}

// What an answer says went wrong: the API's one line or, from something in
// the way (a proxy's error page), its status. The status's text alone was
// shown, and over HTTP/2 there is none: a blank page, no word of why.
function said(response, data) {
  if (data && typeof data.error === "string") return data.error;
  const status = `${response.status} ${response.statusText}`.trim();
  return `the server answered ${status}, not the catalog's API (a proxy in the way?)`;
}

// The head of the log as the server has it now. Lower than the one this page
// knew (asked before the question was sent, so no change seen since can make
// it so), the log went back: a backup restored, a failover to a copy that had
// not received the last writes. The page follows it down and says so, where
// it kept the lost head for good and asked the stream for changes after it.
async function readHead() {
  const known = state.head;
  const head = (await api("/revision")).revision;
  if (head < known) {
    state.lost = { from: Math.max(known, state.lost ? state.lost.from : 0), to: head };
    state.head = head;
    return true;
  }
  state.head = Math.max(state.head, head);
  return false;
}

function route() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  // A revision as typed: anything but a whole number is told, not read as 0 or now.
  // One of more digits than a number here holds exactly is past any log's
  // head (it was told as no whole number); leading zeros are none of its
  // digits, as the server reads them (17 of them were told past the head).
  const atText = params.get("at");
  const digits = atText === null ? 0 : atText.replace(/^0+/, "").length;
  const at = atText === null ? null : !/^[0-9]+$/.test(atText) ? NaN : digits > 15 ? Infinity : Number(atText);
  // Before revision 1 no declared config was recorded: there is none "then".
  const declaredThen = at !== null && at > 0 && params.get("declared") === "then";
  if (path.startsWith("/model/")) {
    return { page: "model", name: decoded(path.slice(7)), at, atText, declaredThen };
  }
  return { page: "models", at, atText, declaredThen, filter: params.get("q") || "" };
}

// The address with one query key set (or taken out, for null).
function withParam(key, value) {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  if (value === null) params.delete(key);
  else params.set(key, value);
  const rest = params.toString();
  return `#${path}${rest ? `?${rest}` : ""}`;
}

// The API query of a read at ``at``: over the config recorded then, if asked.
function pastQuery(at) {
  const params = new URLSearchParams();
  if (at !== null) params.set("at", String(at));
  if (at !== null && route().declaredThen) params.set("declared", "then");
  const query = params.toString();
  return query ? `?${query}` : "";
}

// A name as the address spells it; null when it is no %-encoding at all.
function decoded(text) {
  try {
    return decodeURIComponent(text);
  } catch {
    return null;
  }
}

// ``declaredThen``: read the past over the config recorded then.
function href(page, name, at, filter, declaredThen = route().declaredThen) {
  const base = page === "model" ? `#/model/${encodeURIComponent(name)}` : "#/models";
  const params = new URLSearchParams();
  if (at !== null && at !== undefined) {
    params.set("at", String(at));
    // Moving about the past keeps reading it over the config recorded then.
    if (declaredThen) params.set("declared", "then");
  }
  if (filter) params.set("q", filter);
  const query = params.toString();
  return query ? `${base}?${query}` : base;
}

// -- signing in ----------------------------------------------------------------

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  stopFollowing();
  state.me = null;
  $("#whoami").textContent = "";
  $("#logout").hidden = true;
  $("#page").replaceChildren();
  // The last page's error is no longer about anything on screen.
  $("#error").textContent = "";
  state.lost = null;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
}

// What could be a token: printable ASCII, as a header carries it. Anything
// else made fetch throw ("non ISO-8859-1 code point"), or the server answer
// 400 (a 100 kB one), and the raw exception was shown, the token kept.
const TOKEN_MOST = 1024;
const tokenLike = (text) => text.length <= TOKEN_MOST && /^[\x21-\x7e]+$/.test(text);
const NOT_A_TOKEN = "That token is not valid.";

async function signIn() {
  if (!tokenLike(token())) {
    sessionStorage.removeItem(TOKEN_KEY);
    $("#login-error").textContent = NOT_A_TOKEN;
    return false;
  }
  try {
    state.me = await api("/me");
  } catch (error) {
    // Refused for any reason, the token is not kept (a 401 signed out already).
    sessionStorage.removeItem(TOKEN_KEY);
    if (error.status === 401) return false;
    // Another refusal of the request is of the token it carried; an outage
    // or a timeout is told as it is.
    const ofTheToken = error.status >= 400 && error.status < 500;
    $("#login-error").textContent = ofTheToken ? NOT_A_TOKEN : error.message;
    return false;
  }
  $("#login").hidden = true;
  $("#logout").hidden = false;
  showWhoami();
  return true;
}

function showWhoami() {
  $("#whoami").textContent = `${state.me.actor} (${state.me.role})`;
}

async function relearnRole() {
  try {
    state.me = await api("/me");
  } catch {
    return; // the refusal in hand is told; a 401 signed out already
  }
  showWhoami();
}

// -- following the log ---------------------------------------------------------

// How long the page waits to ask for the stream again once it ended or was refused.
const FOLLOW_RETRY_MS = 2000;

function stopFollowing() {
  if (state.follow) state.follow.abort();
  state.follow = null;
  live(null);
}

// The dot in the header, and what it says: following the log (true), not
// (null: signed out), or paused, and why, retrying. A stream refused (503:
// the server's watches all taken) only turned the dot grey, its tooltip still
// saying "following the log", while the page went stale.
function live(following, why) {
  const dot = $("#live");
  const note = $("#live-note");
  dot.classList.toggle("on", following === true);
  if (following === true || following === null) {
    dot.title = following ? "following the log" : "not following the log";
    note.textContent = "";
    note.title = "";
    return;
  }
  const text = `Live updates paused: ${why}. Retrying every ${FOLLOW_RETRY_MS / 1000} s; what is shown may be out of date.`;
  dot.title = text;
  note.title = text;
  note.textContent = "live updates paused";
}

// Server-sent events through fetch, since EventSource cannot send a token.
async function follow() {
  // The dot keeps what it said until this stream is answered: a pause stays told while retrying.
  if (state.follow) state.follow.abort();
  const controller = new AbortController();
  state.follow = controller;
  try {
    const response = await fetch(`/events?from=${state.head}`, {
      headers: { Authorization: `Bearer ${token()}` },
      signal: controller.signal,
    });
    if (response.status === 401) {
      // Revoked (a stream ends once its token is): as any other request's 401.
      const data = await response.json().catch(() => null);
      signOut(data && data.error);
      return;
    }
    if (!response.ok) {
      const data = await response.json().catch(() => null);
      const why = said(response, data);
      live(false, `the server refused the stream (${response.status}: ${why})`);
      // Refused as past the head: the log went back under the page (422
      // "revision 4 is beyond the head of the log (2)", every 2 s, while the
      // page showed the lost catalog). Follow it down, and say so. A head
      // the server will not name (the log's last events deleted by hand) is
      // told by the redraw, as every page tells it, over the page it kept.
      const wentBack = response.status === 422 && (await readHead().catch(() => null));
      if (wentBack !== false) await render();
      if (wentBack) {
        if (state.follow === controller) setTimeout(() => state.follow === controller && follow(), 0);
        return;
      }
      throw new ApiError(response.status, why);
    }
    live(true);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data: "))
          .map((line) => line.slice(6))
          .join("\n");
        if (data) changed(parsed(data));
      }
    }
    live(false, "the stream ended");
  } catch (error) {
    if (controller.signal.aborted) return;
    if (!(error instanceof ApiError)) live(false, `the stream was cut (${error.message})`);
  }
  if (state.follow === controller) setTimeout(() => state.follow === controller && follow(), FOLLOW_RETRY_MS);
}

// A redraw for changes that arrived: one at a time, the next 150 ms after the
// one before ends. Several events of one transaction arrive together and are
// drawn once; and a busy log (an autoscaler's change every 50 ms) still shows
// it moving, where a redraw put off until the changes paused was put off for
// as long as they kept coming, and one started before the last had ended
// threw the last away.
const redraw = { timer: null, missed: false };
function redrawSoon() {
  if (redraw.timer !== null) {
    redraw.missed = true;
    return;
  }
  redraw.timer = setTimeout(async () => {
    try {
      await render();
    } finally {
      redraw.timer = null;
      if (redraw.missed) {
        redraw.missed = false;
        redrawSoon();
      }
    }
  }, 150);
}

function changed(event) {
  if (event.revision <= state.head) return;
  state.head = event.revision;
  // Redraw only the view of now (or a page still being drawn), and never
  // under an open rollback preview; a view of the past just learns that the
  // log moved on. A revision asked for that was the head is drawn as now: it
  // went on saying "now" over what the log had left, its Now button disabled;
  // redrawn, it is the past it has become.
  const past = state.shown === location.hash && !state.shownNow;
  if (past || $(".rollback.open")) {
    const behind = $("#behind");
    if (behind) behind.textContent = `The log has moved on: now at revision ${state.head}.`;
    return;
  }
  redrawSoon();
}

// -- shared pieces -------------------------------------------------------------

// What a page's heading says of the moment it shows.
function moment(at) {
  if (at === null) return `now, revision ${state.head}`;
  return route().declaredThen ? `at revision ${at}, over the declared config recorded then` : `at revision ${at}`;
}

function picker(at, onPick) {
  const value = at === null ? state.head : at;
  const label = h("output", { id: "revision-label" }, at === null ? `now (${state.head})` : String(at));
  const slider = h("input", {
    id: "revision",
    type: "range",
    min: "0",
    max: String(state.head),
    value: String(value),
    "aria-label": "revision",
    oninput: () => (label.textContent = slider.value),
    onchange: () => onPick(Number(slider.value) >= state.head ? null : Number(slider.value)),
    onpointerdown: () => (state.dragging = true),
  });
  // Taken as typed, into the address, which refuses what is no revision
  // (empty, past the head) in its own words: an empty box was read as
  // Number("") = 0, and one past the head as now, without a word.
  const take = () => {
    if (state.replacing) return;
    const text = number.value.trim();
    onPick(/^[0-9]{1,15}$/.test(text) && Number(text) === state.head ? null : text);
  };
  const number = h("input", {
    id: "revision-number",
    type: "number",
    min: "0",
    max: String(state.head),
    value: String(value),
    "aria-label": "revision number",
    onchange: take,
    // Enter also takes what a redraw kept typed in the box, which tells no
    // change of its own; taking it twice sets the same address once.
    onkeydown: (event) => event.key === "Enter" && take(),
  });
  // Reads of the past are over today's declared config unless this is ticked.
  const then =
    at === null || at === 0
      ? ""
      : h(
          "label",
          { class: "then", title: "Read over the declared config the log had recorded at that revision: what the nodes ran" },
          h("input", {
            type: "checkbox",
            id: "declared-then",
            checked: route().declaredThen,
            onchange: (event) => (location.hash = withParam("declared", event.target.checked ? "then" : null)),
          }),
          " declared config as recorded then"
        );
  return h(
    "div",
    { class: "picker" },
    h("label", { for: "revision" }, "Revision"),
    slider,
    number,
    label,
    h("button", { type: "button", id: "now", onclick: () => onPick(null), disabled: at === null }, "Now"),
    then
  );
}

function diffTable(diff) {
  const rows = [];
  for (const m of diff.added) rows.push(["+", m.name, "", "", m.source]);
  for (const m of diff.removed) rows.push(["−", m.name, "", m.source, ""]);
  for (const change of diff.changed) {
    for (const [field, values] of Object.entries(change.fields)) {
      rows.push(["~", change.model, field, show(values.before), show(values.after)]);
    }
  }
  if (!rows.length) return h("p", { class: "quiet" }, "No change.");
  const [drawn, note] = firstOf(rows, "change");
  return [
    h(
      "table",
      { class: "diff" },
      h("thead", {}, h("tr", {}, ["", "Model", "Field", "Before", "After"].map((t) => h("th", {}, t)))),
      h(
        "tbody",
        {},
        drawn.map(([sign, ...cells]) =>
          h("tr", { class: { "+": "added", "−": "removed", "~": "changed" }[sign] }, h("td", {}, sign), cells.map((c) => h("td", {}, c)))
        )
      )
    ),
    note,
  ];
}

// The first ROWS_SHOWN of a long list, to draw, and a line saying how many
// there are: a rollback of 20,000 models drew 20,000 events and a diff of as
// many rows, 7.2 s and a page 1.5 million pixels tall (hostile test).
function firstOf(items, noun) {
  if (items.length <= ROWS_SHOWN) return [items, ""];
  return [items.slice(0, ROWS_SHOWN), h("p", { class: "quiet shown-of" }, `Showing the first ${ROWS_SHOWN} of ${counted(items.length, noun)}.`)];
}

// "1 change", "1,000 changes".
function counted(count, noun) {
  return `${count.toLocaleString("en")} ${noun}${count === 1 ? "" : "s"}`;
}

// A rollback is shown first (a dry run), then confirmed with If-Match set to
// the revision the preview was made at: what is written is what was shown.
// ``to`` is the revision the page read, never one inside a write: the server
// reads that as the end of the write before it, and the rollback was labelled
// "to revision 3" while it planned (and wrote) one to 0. The plan says the
// revision it read ("to"), and that is what is shown and confirmed.
function rollbackPanel(to, model) {
  const panel = h("div", { class: "rollback", id: "rollback" });
  const what = (revision) => (model ? `${model} to revision ${revision}` : `the catalog to revision ${revision}`);
  const preview = async () => {
    panel.classList.add("open");
    panel.replaceChildren(h("p", { class: "quiet" }, "Working out the compensating events…"));
    try {
      const plan = await api("/rollback", { method: "POST", body: { to, model, dry_run: true } });
      const confirm = async () => {
        try {
          const done = await api("/rollback", {
            method: "POST",
            body: { to: plan.to, model, dry_run: false },
            ifMatch: plan.revision,
          });
          // Shown for a while, across the redraws its own events cause.
          const text = done.written ? `Rolled back ${what(done.to)}: now at revision ${done.revision}.` : "Nothing to write.";
          state.flash = { text, until: Date.now() + 10000 };
          location.hash = href(route().page, model, null);
        } catch (error) {
          // The plan goes with its refusal, to be worked out again on asking:
          // each click added the same refusal under a plan that, the log
          // having moved, could no longer be confirmed.
          panel.replaceChildren(
            h("p", { class: "error", id: "rollback-refused" }, error.message),
            h("button", { type: "button", id: "rollback-again", onclick: preview }, "Work out the rollback again"),
            h("button", { type: "button", id: "rollback-cancel", onclick: cancel }, "Cancel")
          );
        }
      };
      const [events, more] = firstOf(plan.events, "compensating event");
      // Flattened: replaceChildren takes nodes, and wrote a list of notes
      // as the text "[object HTMLParagraphElement]".
      const children = [
        h("h3", {}, `Dry run: roll back ${what(plan.to)}`),
        plan.notes.map((note) => h("p", { class: "note" }, note)),
        h("p", {}, `${counted(plan.events.length, "compensating event")} would be written:`),
        h("ul", { class: "events" }, events.map((e) => h("li", {}, `${e.model} ${e.event} ${show(e.fields)}`))),
        more,
        diffTable(plan.diff),
        !plan.events.length
          ? h("p", { class: "quiet" }, "Already as it was: nothing to roll back.")
          : state.me?.role === "admin"
            ? h("button", { type: "button", class: "danger", id: "rollback-confirm", onclick: confirm }, "Confirm rollback")
            : h("p", { class: "quiet", id: "rollback-admin-only" }, `Only an admin confirms a rollback; this token is ${state.me?.role}.`),
        h("button", { type: "button", id: "rollback-cancel", onclick: cancel }, "Cancel"),
      ];
      panel.replaceChildren(...children.flat());
    } catch (error) {
      panel.replaceChildren(start, h("p", { class: "error" }, error.message));
    }
  };
  const cancel = () => {
    panel.classList.remove("open");
    panel.replaceChildren(start);
  };
  const start = h("button", { type: "button", id: "rollback-preview", onclick: preview }, `Roll back ${what(to)}…`);
  panel.append(start);
  return panel;
}

// The diff from revision ``at`` to now; its ``from`` is the revision the
// server read for ``at``: one inside a write of several changes (an apply, a
// rollback) is read as the last before it where a write ends, as every read
// of the past reads it.
async function pastDiff(at, model) {
  const query = new URLSearchParams({ since: String(at) });
  if (model) query.set("model", model);
  if (route().declaredThen) query.set("declared", "then");
  return api(`/diff?${query}`);
}

// Said when the revision asked for is not the one read (as the CLI warns).
function takenAs(at, read) {
  if (at === null || read === at) return "";
  return h(
    "p",
    { class: "note", id: "taken-as" },
    `No write ends at revision ${at} (a write of several changes lands whole): taken as revision ${read}, the last one that does before it.`
  );
}

function diffSection(diff, model) {
  return h(
    "section",
    { id: "diff" },
    h("h2", {}, `Changes from revision ${diff.from} to now (${diff.to})`),
    diffTable(diff),
    rollbackPanel(diff.from, model)
  );
}

// -- the Models page -----------------------------------------------------------

// Rows drawn at most: all 20,000 rows of a large catalog took Chromium 15 s to
// draw, and 10 s again on every change (500: 1.3 s, most of it reading the
// list). The filter finds the rest.
const ROWS_SHOWN = 500;

function modelRow(m, at) {
  return h(
    "tr",
    { "data-model": m.name },
    h("td", {}, h("a", { href: href("model", m.name, at) }, m.name)),
    h("td", {}, h("span", { class: `badge ${m.declared ? "declared" : "runtime"}` }, m.declared ? "declared" : "runtime")),
    h("td", {}, m.engine),
    h("td", {}, m.effective_class, m.class ? "" : h("span", { class: "quiet" }, " (from scaling)")),
    h("td", {}, m.owner || h("span", { class: "quiet" }, "shared")),
    h("td", {}, scaling(m)),
    h("td", { class: "source" }, m.source),
    h("td", { title: (m.origin && m.origin.revision) || "" }, short(m.origin && m.origin.revision)),
    h("td", { class: "warning" }, (m.warnings || []).join("; "))
  );
}

// Whether a model's name, engine, owner or source holds the filter's text.
function matches(m, filter) {
  const text = filter.toLowerCase();
  return [m.name, m.engine, m.owner, m.source].some((field) => (field || "").toLowerCase().includes(text));
}

async function modelsPage(at, filter) {
  const [models, skipped, diff] = await Promise.all([
    api(`/models${pastQuery(at)}`),
    api("/skipped"),
    at === null ? null : pastDiff(at, null),
  ]);
  // What is shown is the catalog at the revision read, said as that one.
  const read = diff ? diff.from : null;
  // The skips up to it: the later ones were listed under a past revision too.
  const skippedThen = read === null ? skipped : skipped.filter((s) => s.revision <= read);
  const [skippedDrawn, skippedMore] = firstOf(skippedThen, "skipped event");
  const body = h("tbody", {});
  const shown = h("p", { id: "shown", class: "quiet" });
  // Filtered as it is typed, from the list already read; the address keeps
  // the filter (replaced, not pushed: no history entry per key) for the
  // redraws that changes bring, a reload and a link.
  const fill = (text) => {
    const found = text ? models.filter((m) => matches(m, text)) : models;
    const rows = found.slice(0, ROWS_SHOWN).map((m) => modelRow(m, read));
    const none = text ? `No model matches “${text}”.` : "No models.";
    body.replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td", { colspan: "9", class: "quiet" }, none))]));
    shown.textContent =
      found.length > ROWS_SHOWN
        ? `Showing the first ${ROWS_SHOWN} of ${counted(found.length, "model")} by name: narrow the filter to see the rest.`
        : text
          ? `${counted(found.length, "model")} of ${models.length} match.`
          : "";
  };
  const search = h("input", {
    id: "filter",
    type: "search",
    value: filter,
    placeholder: "Filter by name, engine, owner or source",
    "aria-label": "filter models",
    size: "40",
    oninput: () => {
      history.replaceState(null, "", href("models", null, at, search.value));
      // Still the page shown: a redraw's error must not clear it, nor the box.
      state.shown = location.hash;
      fill(search.value);
    },
  });
  fill(filter);
  const page = [
    h("h1", {}, "Models ", h("small", {}, moment(read))),
    takenAs(at, read),
    picker(read, (picked) => (location.hash = href("models", null, picked, route().filter))),
    h("div", { class: "filter" }, search, shown),
    h(
      "table",
      { id: "models", class: "models" },
      h(
        "thead",
        {},
        h("tr", {}, ["Name", "Layer", "Engine", "Class", "Owner", "Scaling", "Source", "Source revision", "Warnings"].map((t) => h("th", {}, t)))
      ),
      body
    ),
  ];
  if (diff) page.push(diffSection(diff, null));
  page.push(
    h(
      "section",
      { id: "skipped" },
      h("h2", {}, "Skipped events"),
      skippedThen.length
        ? [h("ul", {}, skippedDrawn.map((s) => h("li", {}, `revision ${s.revision}: ${s.model || "?"} ${s.event}: ${s.reason}`))), skippedMore]
        : h("p", { class: "quiet" }, "None: every stored event is in force.")
    )
  );
  return page;
}

// -- a model's page ------------------------------------------------------------

function definition(m) {
  const profiles = m.profiles.map((p) => {
    const parts = [p.gpus ? `${p.gpus} GPU` : "CPU"];
    if (p.gpu_memory_gb) parts.push(`${p.gpu_memory_gb} GB GPU`);
    if (p.min_memory_gb) parts.push(`${p.min_memory_gb} GB`);
    if (p.cpu_cores) parts.push(`${p.cpu_cores} cores`);
    return `${p.name} (${parts.join(", ")})`;
  });
  const rows = [
    ["Layer", m.declared ? "declared (edit the config file to change it)" : "runtime"],
    ["Engine", m.engine],
    ["Source", m.source],
    ["Source revision", m.origin ? `${m.origin.repository || ""}@${m.origin.revision || ""}` : "—"],
    ["Profiles", profiles.join("; ")],
    ["Scaling", scaling(m)],
    ["Class", m.effective_class + (m.class ? "" : " (from scaling)")],
    ["Owner", m.owner || "shared"],
    ["Adapters", m.adapters.map((a) => `${a.name}=${a.source}`).join(", ") || "—"],
    ["Fallbacks", m.fallbacks.join(", ") || "—"],
  ];
  for (const warning of m.warnings || []) rows.push(["Warning", warning]);
  return h("table", { class: "definition", id: "definition" }, h("tbody", {}, rows.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, v)))));
}

function summary(m) {
  return `${m.engine} ${m.source}, scaling ${scaling(m)}`;
}

function change(c) {
  return h("li", {}, h("code", {}, c.field || "(definition)"), ": ", h("span", { class: "before" }, show(c.before)), " → ", h("span", { class: "after" }, show(c.after)));
}

// What one history row did: a whole definition (added, removed) is
// summarised, anything else listed field by field, before → after.
function changes(r) {
  if (r.skipped) return h("p", { class: "warning" }, `skipped on load: ${r.skipped}`);
  if (!r.before && r.after) return h("ul", { class: "changes" }, h("li", {}, "defined: ", h("span", { class: "after" }, summary(r.after))));
  if (r.before && !r.after) return h("ul", { class: "changes" }, h("li", {}, "removed: ", h("span", { class: "before" }, summary(r.before))));
  return h("ul", { class: "changes" }, (r.changes || []).map(change));
}

// A page's worth of a model's history, the most recent: a model scaled
// every minute for a year has half a million rows, which no page can show.
const HISTORY_ROWS = 1000;

// The most recent of a model's history that an answer holds: pages shrink
// until one fits its bytes (64 MiB; a page of one always does), each asking
// for one more than it shows, to tell whether there are older ones.
async function recentHistory(name) {
  for (const asked of [HISTORY_ROWS + 1, 101, 11, 2, 1]) {
    const shown = Math.max(asked - 1, 1);
    try {
      const rows = await api(`/history/${encodeURIComponent(name)}?limit=${asked}`);
      return { rows: rows.slice(-shown), shown, older: asked === 1 || rows.length > shown };
    } catch (error) {
      if (error.status === 404) return { rows: [], shown, older: false };
      if (error.status !== 422 || asked === 1) throw error;
    }
  }
}

// Where each row's write ends, as far as this model's rows tell: the events of
// one write (an apply, a rollback) share its time, and no two writes do. A
// link to a revision inside a write read as the end of the write before it
// ("revision 3" of an apply of 1–4 showed the model not there yet); it goes
// to the last of the write's rows instead. (A write whose later events are
// of other models only ends later still: the page read says so.) A config
// record's rows say where its write ends: the record is its first event,
// and the rest are mostly other models' (a deploy's link showed the model
// as it was before the deploy).
function writeEnds(rows) {
  const ends = new Array(rows.length);
  for (let i = rows.length - 1; i >= 0; i--) {
    const sameWrite = i + 1 < rows.length && rows[i].time && rows[i + 1].time === rows[i].time;
    ends[i] = rows[i].write_end ?? (sameWrite ? ends[i + 1] : rows[i].revision);
  }
  return ends;
}

// What the config did to the model (Declared, Redeclared, Undeclared) shows
// over the config recorded then: over today's, the model is today's.
const CONFIG_ROWS = new Set(["Declared", "Redeclared", "Undeclared"]);

// ``at``: the revision the page read (null: now); the rows after it are dimmed.
async function timeline(name, at) {
  const { rows, shown, older } = await recentHistory(name);
  const note = older ? h("p", { class: "quiet" }, `The most recent ${counted(shown, "change")}; all of them: catalog-es history ${name}`) : "";
  const ends = writeEnds(rows);
  const link = (r, end) => href("model", name, end, null, CONFIG_ROWS.has(r.event) || route().declaredThen);
  const items = rows.map((r, i) =>
    h(
      "li",
      { class: `entry${at !== null && r.revision > at ? " later" : ""}`, "data-revision": r.revision },
      h(
        "div",
        { class: "when" },
        ends[i] === r.revision
          ? h("a", { href: link(r, r.revision), title: "the model at this revision" }, `revision ${r.revision}`)
          : h(
              "a",
              { href: link(r, ends[i]), title: `the model once the write of this change had landed, at revision ${ends[i]}` },
              `revision ${r.revision}`,
              h("span", { class: "write" }, ` (written together with revision ${ends[i]}: shown there)`)
            ),
        ` · ${r.time || "?"} · `,
        h("strong", {}, r.by || "?")
      ),
      h("div", { class: "what" }, r.event, r.rollback_to !== null ? ` (rollback to ${r.rollback_to})` : "", r.reason ? h("span", { class: "reason" }, ` “${r.reason}”`) : ""),
      changes(r)
    )
  );
  return h("section", { id: "history" }, h("h2", {}, "History"), note, items.length ? h("ol", { class: "timeline" }, items) : h("p", { class: "quiet" }, "No changes."));
}

async function modelPage(name, at) {
  const asked = async () => {
    try {
      return await api(`/models/${encodeURIComponent(name)}${pastQuery(at)}`);
    } catch (error) {
      if (error.status !== 404) throw error;
      return null;
    }
  };
  // The diff says the revision read, a 404 of the model not.
  const [model, diff] = await Promise.all([asked(), at === null ? null : pastDiff(at, name)]);
  const read = diff ? diff.from : null;
  const page = [
    h("p", {}, h("a", { href: href("models", null, read) }, "← Models")),
    h("h1", {}, name, " ", model ? h("span", { class: `badge ${model.declared ? "declared" : "runtime"}` }, model.declared ? "declared" : "runtime") : "", h("small", {}, ` ${moment(read)}`)),
    takenAs(at, read),
    picker(read, (picked) => (location.hash = href("model", name, picked))),
    model ? definition(model) : h("p", { class: "quiet", id: "definition" }, read === null ? "Not in the catalog now." : `Not in the catalog at revision ${read}.`),
  ];
  if (diff) page.push(diffSection(diff, name));
  page.push(await timeline(name, read));
  return page;
}

// -- drawing -------------------------------------------------------------------

// Told on every page until dismissed: revisions this page saw are gone.
function wentBack() {
  if (!state.lost) return "";
  const { from, to } = state.lost;
  const gone = from === to + 1 ? `revision ${from} was` : `revisions ${to + 1}–${from} were`;
  const note = h(
    "p",
    { class: "error", id: "went-back", role: "alert" },
    `The log went back: its last revision is now ${to}, where this page had seen ${from}; ${gone} lost ` +
      "(a backup restored, or a failover to a copy that had not received them; catalog-es verify says " +
      "whether the log was edited). What is shown is the log as it is now. ",
    h("button", { type: "button", id: "went-back-dismiss", onclick: () => ((state.lost = null), note.remove()) }, "Dismiss")
  );
  return note;
}

async function render() {
  if (!state.me) return;
  const number = ++state.rendering;
  const where = route();
  $("#error").textContent = "";
  try {
    if (where.page === "model" && !where.name) {
      // Empty, it drew a page of a model "not in the catalog" with no name.
      const why = where.name === null ? ": its %-escapes are broken" : "";
      throw new Error(`This address names no model${why}.`);
    }
    if (Number.isNaN(where.at)) {
      throw new Error(`This address's revision, "${where.atText}", is not a whole number.`);
    }
    await readHead();
    if (where.at !== null && where.at > state.head) {
      throw new Error(`Revision ${where.atText} is past the log's last, ${state.head}.`);
    }
    const at = where.at !== null && where.at < state.head ? where.at : null;
    const content = where.page === "model" ? await modelPage(where.name, at) : await modelsPage(at, where.filter);
    if (number !== state.rendering) return; // a newer draw started meanwhile
    if (state.dragging) {
      // Not under the pointer: the slider replaced mid-drag told the
      // revision it was passing over as picked, and the release was lost.
      state.held = true;
      return;
    }
    const flash = state.flash && Date.now() < state.flash.until ? h("p", { class: "ok", id: "flash" }, state.flash.text) : "";
    const active = document.activeElement;
    // Someone typing in the filter as a change redraws the page keeps typing.
    const typing = active && active.id === "filter" ? active : null;
    // A control stepped on with the keyboard (the slider, the number box, the
    // tick) keeps the focus across the redraw the step causes: it fell to the
    // page, and the next arrow key did nothing.
    const kept = active && active.id && $("#page").contains(active) ? active.id : null;
    // And what was typed into it and not yet taken (a revision half-typed as
    // a change arrived) stays typed: the redraw put back the head's number.
    const typed = kept && active.type !== "checkbox" && active.value !== active.defaultValue ? active.value : null;
    // The box losing the focus as it is replaced tells Chromium's change of
    // what was typed into it, never entered: it is not taken (the page went
    // to a half-typed revision as a change arrived).
    state.replacing = true;
    try {
      $("#page").replaceChildren(flash, wentBack(), h("p", { id: "behind", class: "note" }), ...content);
    } finally {
      state.replacing = false;
    }
    state.shown = location.hash;
    state.shownNow = at === null;
    if (typing) {
      const search = $("#filter");
      if (search.value !== typing.value) {
        search.value = typing.value;
        search.dispatchEvent(new Event("input"));
      }
      search.focus();
      search.setSelectionRange(typing.selectionStart, typing.selectionEnd);
    } else if (kept) {
      const control = document.getElementById(kept);
      if (control && typed !== null && control.value !== typed) {
        control.value = typed;
        control.dispatchEvent(new Event("input"));
      }
      control?.focus();
    }
    document.title = where.page === "model" ? `${where.name} · catalog-es` : "Models · catalog-es";
  } catch (error) {
    if (number !== state.rendering || !state.me) return;
    $("#error").textContent = error.message;
    // Another page's content under the error would read as this one's; the
    // same page's, redrawn as the log moved, stays until the next draw.
    if (location.hash !== state.shown) $("#page").replaceChildren();
  }
}

async function start() {
  $("#login").addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    $("#token").value = "";
    if (await signIn()) begin();
    else if (!$("#login-error").textContent) $("#login-error").textContent = NOT_A_TOKEN;
  });
  $("#logout").addEventListener("click", () => signOut());
  window.addEventListener("hashchange", render);
  for (const end of ["pointerup", "pointercancel"]) {
    window.addEventListener(end, () => {
      state.dragging = false;
      if (state.held) {
        state.held = false;
        render();
      }
    });
  }
  if (token() && (await signIn())) begin();
  else signOut();
}

async function begin() {
  await render();
  follow();
}

start();
