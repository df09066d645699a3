// The dashboard of `llm mlxs serve`: frames from dashboard/events (server-sent events,
// read with a streamed fetch so the API key can go in a header), drawn with plain DOM,
// SVG and a canvas. No framework, no build step, nothing from the network but this server.
(() => {
  'use strict';

  const KEY = 'mlxs-api-key';          // sessionStorage: this tab only
  const SERIES_SECONDS = 600;          // the curves' span
  const DECAY = 0.8;                   // per frame: how fast "recent" hits fade
  const MISS_DECAY = 0.5;              // per frame: how fast "recent" misses fade (about 1.5 s)
  const $ = (id) => document.getElementById(id);

  const state = {
    frames: 0, controller: null, retry: null,
    heat: { key: '', rows: [], experts: 0 },  // per row: resident, lookups, misses, hot, missHot
    series: [], recent: [],
  };

  // -- formatting ---------------------------------------------------------------------
  const size = (n) => {
    if (n === null || n === undefined || Number.isNaN(n)) return '–';
    if (n < 1000) return `${n.toFixed(0)} B`;
    for (const [unit, scale] of [['KB', 1e3], ['MB', 1e6], ['GB', 1e9]]) {
      if (Math.round(n / scale * 10) / 10 < 1000) return `${(n / scale).toFixed(1)} ${unit}`;
    }
    return `${(n / 1e12).toFixed(1)} TB`;
  };
  const num = (v, digits = 0) => (v === null || v === undefined ? '–' : Number(v).toLocaleString(undefined,
    { maximumFractionDigits: digits, minimumFractionDigits: 0 }));
  const pct = (v) => (v === null || v === undefined ? '–' : `${(v * 100).toFixed(1)}%`);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
  const slotsText = (s) => (Array.isArray(s) ? (Math.min(...s) === Math.max(...s) ? `${s[0]}` : `${Math.min(...s)}–${Math.max(...s)}`)
    : (s === null || s === undefined ? 'all' : `${s}`));
  const facts = (el, pairs) => {
    el.innerHTML = pairs.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${v}</dd>`).join('');
  };

  // -- the connection -----------------------------------------------------------------
  function setLive(mode, text) {
    const live = $('live');
    live.className = `live ${mode}`;
    live.querySelector('span').textContent = text;
  }

  function askKey(message, bad) {
    $('keygate').hidden = false;
    const m = $('key-message');
    m.textContent = message;
    m.classList.toggle('bad', !!bad);
    $('key-input').value = '';
    $('key-input').focus();
    setLive('off', 'needs key');
  }

  function problem(text) {
    const p = $('problem');
    p.hidden = !text;
    p.textContent = text || '';
  }

  function reconnect(ms) {
    clearTimeout(state.retry);
    state.retry = setTimeout(connect, ms);
  }

  async function connect() {
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const key = sessionStorage.getItem(KEY) || '';
    $('forget-key').hidden = !key;
    const headers = { Accept: 'text/event-stream' };
    if (key) headers.Authorization = `Bearer ${key}`;
    setLive('', 'connecting');
    let resp;
    try {
      resp = await fetch('dashboard/events', { headers, signal: controller.signal, cache: 'no-store' });
    } catch (e) {
      if (controller.signal.aborted) return;
      setLive('off', 'offline');
      problem('The server does not answer; retrying.');
      reconnect(2000);
      return;
    }
    if (resp.status === 401) {
      if (key) askKey('The server refused that key (401 Unauthorized): enter the key it was started with (--api-key).', true);
      else askKey('This server needs its API key.', false);
      return;
    }
    if (!resp.ok) {
      let why = `${resp.status} ${resp.statusText}`;
      try { const body = await resp.json(); why += `: ${body.error && body.error.message ? body.error.message : JSON.stringify(body)}`; } catch (e) { /* not JSON */ }
      setLive('off', 'refused');
      problem(`The server refused the event stream: ${why}`);
      reconnect(5000);
      return;
    }
    $('keygate').hidden = true;
    problem('');
    setLive('on', 'live');
    try {
      await readEvents(resp.body.getReader(), controller);
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    if (controller.signal.aborted) return;
    setLive('off', 'reconnecting');
    reconnect(1500);
  }

  async function readEvents(reader, controller) {
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done || controller.signal.aborted) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5)).join('\n');
        if (data) onFrame(JSON.parse(data));
      }
    }
  }

  $('key-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const value = $('key-input').value.trim();
    if (!value) return;
    sessionStorage.setItem(KEY, value);
    $('key-message').textContent = 'Connecting…';
    $('key-message').classList.remove('bad');
    connect();
  });
  $('forget-key').addEventListener('click', () => {
    sessionStorage.removeItem(KEY);
    connect();
  });

  // -- a frame --------------------------------------------------------------------------
  function onFrame(f) {
    state.frames += 1;
    header(f);
    model(f);
    memory(f);
    flights(f);
    queue(f);
    heatmap(f.heatmap, f.first);
    series(f);
    recent(f);
    models(f);
    ranks(f);
  }

  function header(f) {
    $('model-name').textContent = f.model || 'no model yet';
    const badge = $('state');
    const st = f.state || 'empty';
    badge.className = `badge ${st}`;
    badge.textContent = f.rebuilding ? 'rebuilding pools' : st;
    badge.title = f.error || f.rebuild_error || '';
  }

  function model(f) {
    const ckpt = f.checkpoint ? f.checkpoint.split('/').filter(Boolean).pop() : '–';
    const rows = [
      ['checkpoint', f.checkpoint ? `<span title="${esc(f.checkpoint)}">${esc(ckpt)}</span>` : 'nothing loaded'],
      ['slots per layer', `${esc(slotsText(f.expert_slots))}${f.heatmap && f.heatmap.experts ? ` of ${f.heatmap.experts} experts` : ''}`],
      ['policy', esc(f.policy || '–')],
      ['expert reads', `${esc(f.store || '–')}${f.threads ? `, ${f.threads} threads` : ''}${f.page_cache ? `, page cache ${esc(f.page_cache)}` : ''}`],
      ['overlap', esc(f.overlap || '–')],
      ['max tokens', num(f.max_tokens)],
    ];
    if (f.error) rows.push(['error', `<span class="bad">${esc(f.error)}</span>`]);
    if (f.rebuild_error) rows.push(['last rebuild', esc(f.rebuild_error)]);
    facts($('model-facts'), rows);
  }

  function memory(f) {
    const m = f.memory || {};
    const machine = m.machine_bytes || ((m.dense_bytes || 0) + (m.experts_bytes || 0) + (m.kv_bytes || 0)) || 1;
    const parts = [['dense', m.dense_bytes, 'var(--dense)'], ['expert pool', m.experts_bytes, 'var(--pool)'],
      ['KV cache', m.kv_bytes, 'var(--kv)']];
    let bar = parts.map(([name, v, colour]) => `<span title="${name} ${size(v || 0)}" style="width:${Math.min(100, 100 * (v || 0) / machine)}%;background:${colour}"></span>`).join('');
    if (m.budget_bytes) bar += `<div class="budget" title="memory budget ${size(m.budget_bytes)}" style="left:${Math.min(99.5, 100 * m.budget_bytes / machine)}%"></div>`;
    $('membar').innerHTML = bar;
    const used = (m.dense_bytes || 0) + (m.experts_bytes || 0) + (m.kv_bytes || 0);
    $('mem-legend').innerHTML = [
      ...parts.map(([name, v, colour]) => `<li><i class="sw" style="background:${colour}"></i>${name} <b>${size(v || 0)}</b></li>`),
      `<li><i class="sw" style="background:var(--free);border:1px solid var(--line)"></i>machine <b>${size(m.machine_bytes)}</b></li>`,
    ].join('');
    $('mem-note').textContent = `resident ${size(used)}` + (m.budget_bytes ? ` of a ${size(m.budget_bytes)} budget` : '')
      + ` · MLX active ${size(f.mlx_active_memory_bytes)} · peak RSS ${size(f.peak_rss_bytes)}`;
  }

  function flights(f) {
    const list = f.in_flight || [];
    const el = $('flights');
    if (!list.length) {
      el.innerHTML = `<p class="idle">idle${f.last_decode_tps ? ` · last decode ${num(f.last_decode_tps, 1)} tok/s` : ''}</p>`;
      return;
    }
    el.innerHTML = list.map((r) => {
      const total = r.prefill_total || 0;
      const done = r.phase === 'decode';
      const est = done ? total : (r.prefill_estimate || r.prefill_done || 0);
      const share = total ? est / total : 1;
      const where = !done && r.layers && r.layer ? ` · chunk at MoE layer ${r.layer} of ${r.layers}` : '';
      return `<div class="flight" data-id="${r.id}">
        <div class="row"><span class="chip ${r.phase}">${r.phase}</span><span class="small">${num(r.seconds, 1)} s</span></div>
        <div class="progress ${done ? 'done' : ''}"><div style="width:${(100 * share).toFixed(1)}%"></div></div>
        <div class="progress-text">prefill ${num(est)} / ${num(total)} tokens (${(100 * share).toFixed(0)}%)${where}</div>
        <div class="facts">
          <span>prompt</span><b>${num(r.prompt_tokens)} tokens</b>
          <span>reused from KV</span><b>${num(r.reused_tokens)} tokens</b>
          <span>generated</span><b>${num(r.generated)} tokens</b>
          <span>decode</span><b>${r.decode_tps ? `${num(r.decode_tps, 1)} tok/s` : '–'}</b>
        </div></div>`;
    }).join('');
  }

  function queue(f) {
    const s = f.server || {};
    facts($('queue-facts'), [
      ['running', `${s.running ? 'yes' : 'no'} · ${num((f.in_flight || []).length)} generating`],
      ['queued', `${num(s.queued)} of at most ${num(s.max_queue)}`],
      ['batch', `${num(f.batch || 0)} of ${num(f.max_batch)} (largest ${num(f.largest_batch || 0)})`],
      ['served', num(s.served)],
      ['disconnects', num(s.disconnects)],
    ]);
    const t = f.totals || {};
    const from = t.reused_from || {};
    $('totals').textContent = `since the start: ${num(t.responses)} responses, ${num(t.prompt_tokens)} prompt tokens `
      + `(${num(t.reused_tokens)} reused: prompt cache hit ratio ${pct(t.prompt_tokens ? t.reused_tokens / t.prompt_tokens : null)}, `
      + `${num(from.memory || 0)} from memory, ${num(from.snapshot || 0)} from snapshots, ${num(from.disk || 0)} from disk), `
      + `${num(t.generated_tokens)} generated · hit rate ${pct(f.hit_rate)}, `
      + `${size(f.bytes_read)} read · ${f.syncs_per_token === null || f.syncs_per_token === undefined ? '–' : num(f.syncs_per_token, 2)} syncs per token`;
  }

  // -- the heatmap ------------------------------------------------------------------------
  function heatmap(h, first) {
    const heat = state.heat;
    const key = h.rows.map((r) => `${r.name}:${r.experts}`).join(',');
    if (h.reset || first || key !== heat.key) {
      heat.key = key;
      heat.rows = h.rows.map((r) => ({ name: r.name, n: r.experts, lookups: new Float64Array(r.experts),
        misses: new Float64Array(r.experts), hot: new Float64Array(r.experts), missHot: new Float64Array(r.experts) }));
    }
    heat.experts = h.experts;
    h.rows.forEach((r, i) => {
      const row = heat.rows[i];
      row.slots = r.slots;
      row.resident = r.resident;
      for (let e = 0; e < row.n; e += 1) { row.hot[e] *= DECAY; row.missHot[e] *= MISS_DECAY; }
      const fresh = first || h.reset;  // the first frame's counts are since the pool was built: not "recent"
      for (const [e, n] of r.lookups) { row.lookups[e] += n; if (!fresh) row.hot[e] += n; }
      for (const [e, n] of r.misses) { row.misses[e] += n; if (!fresh) { row.missHot[e] += n; row.hot[e] -= n; } }
    });
    const resident = heat.rows.reduce((a, r) => a + [...(r.resident || '')].filter((c) => c === '1').length, 0);
    $('heat-sub').textContent = heat.rows.length ? `${heat.rows.length} layers × ${heat.experts} experts · ${num(resident)} resident` : 'no model loaded';
    drawHeatmap();
  }

  const LEFT = 34, TOP = 16, RIGHT = 44;
  let geometry = null;

  function mix(a, b, t) {
    return a.map((x, i) => Math.round(x + (b[i] - x) * Math.max(0, Math.min(1, t))));
  }
  const GREY = [232, 236, 241], COLD = [185, 211, 236], HOT = [31, 95, 168], RED = [224, 83, 61];

  // a cell's fill: resident or not, and how often it was hit lately
  function cellColour(row, e) {
    if (!row.resident || row.resident[e] !== '1') return GREY;
    const hot = Math.max(0, row.hot[e]);
    return mix(COLD, HOT, hot > 0 ? 0.3 + 0.7 * Math.min(1, Math.log1p(hot) / Math.log1p(6)) : 0);
  }
  // the mark of a recent miss (the expert was read from disk): a red square inside the cell
  function missShare(row, e) {
    return row.missHot[e] > 0.2 ? 0.45 + 0.55 * Math.min(1, row.missHot[e]) : 0;
  }

  function drawHeatmap() {
    const heat = state.heat;
    const canvas = $('heatmap');
    const wrap = $('heatwrap');
    const rows = heat.rows.length;
    const cols = heat.experts || 1;
    const avail = Math.max(200, wrap.clientWidth - LEFT - RIGHT);
    const cw = Math.max(3, Math.min(30, Math.floor(avail / cols)));
    const ch = Math.max(3, Math.min(22, Math.floor(440 / Math.max(1, rows)), cw));
    const width = LEFT + cw * cols + RIGHT, height = TOP + ch * Math.max(rows, 1) + 4;
    const ratio = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
      canvas.style.width = `${width}px`;
      canvas.style.height = `${height}px`;
    }
    geometry = { cw, ch, ratio };
    const g = canvas.getContext('2d');
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    g.font = '10px system-ui, sans-serif';
    g.fillStyle = '#6a7786';
    g.textBaseline = 'middle';
    const colStep = Math.ceil(22 / cw);
    g.textAlign = 'center';
    for (let e = 0; e < cols; e += colStep) g.fillText(String(e), LEFT + e * cw + cw / 2, TOP / 2);
    const rowStep = Math.ceil(12 / ch);
    heat.rows.forEach((row, i) => {
      const y = TOP + i * ch;
      if (i % rowStep === 0) { g.textAlign = 'right'; g.fillStyle = '#6a7786'; g.fillText(row.name, LEFT - 6, y + ch / 2); }
      for (let e = 0; e < row.n; e += 1) {
        const [r, gg, b] = cellColour(row, e);
        g.fillStyle = `rgb(${r},${gg},${b})`;
        const gap = cw >= 6 ? 1 : 0, vgap = ch >= 6 ? 1 : 0;
        g.fillRect(LEFT + e * cw, y, cw - gap, ch - vgap);
        const m = missShare(row, e);
        if (m) {
          const w = Math.max(2, Math.round((cw - gap) * 0.55)), h = Math.max(2, Math.round((ch - vgap) * 0.55));
          g.fillStyle = `rgba(${RED.join(',')},${m.toFixed(2)})`;
          g.fillRect(LEFT + e * cw + Math.floor((cw - gap - w) / 2), y + Math.floor((ch - vgap - h) / 2), w, h);
        }
      }
      if (i % rowStep === 0) {
        g.textAlign = 'left'; g.fillStyle = '#6a7786';
        g.fillText(`${row.slots}`, LEFT + cols * cw + 6, y + ch / 2);
      }
    });
    if (!rows) { g.textAlign = 'left'; g.fillText('no model loaded', LEFT, TOP + 8); }
  }

  $('heatmap').addEventListener('mousemove', (ev) => {
    const tip = $('tip');
    if (!geometry) return;
    const rect = ev.target.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const e = Math.floor((x - LEFT) / geometry.cw), i = Math.floor((y - TOP) / geometry.ch);
    const row = state.heat.rows[i];
    if (!row || e < 0 || e >= row.n) { tip.hidden = true; return; }
    const lookups = row.lookups[e], misses = row.misses[e];
    tip.innerHTML = `layer ${esc(row.name)} · expert ${e} · ${row.resident && row.resident[e] === '1' ? 'resident' : 'not resident'}<br>`
      + `${num(lookups - misses)} hits, ${num(misses)} misses since the pool was built`;
    tip.hidden = false;
    tip.style.left = `${Math.min(x + 14, ev.target.parentElement.clientWidth - 260)}px`;
    tip.style.top = `${y + 12}px`;
  });
  $('heatmap').addEventListener('mouseleave', () => { $('tip').hidden = true; });
  window.addEventListener('resize', () => drawHeatmap());

  // -- the curves -------------------------------------------------------------------------
  const CHARTS = [
    { key: 'hit_rate', title: 'hit rate', colour: '#1f5fa8', fmt: pct, max: 1 },
    { key: 'mb_per_token', title: 'MB read / token', colour: '#e0533d', fmt: (v) => `${num(v, 2)} MB` },
    { key: 'decode_tps', title: 'decode tok/s', colour: '#2e9d5b', fmt: (v) => num(v, 1) },
    { key: 'prefill_tps', title: 'prefill tok/s', colour: '#d99a1e', fmt: (v) => num(v, 0) },
    { key: 'syncs_per_token', title: 'host syncs / token', colour: '#8e6cc6', fmt: (v) => num(v, 1) },
  ];
  $('charts').innerHTML = CHARTS.map((c) => `<article class="card chart" id="chart-${c.key}">
      <h3><span>${c.title}</span><b>–</b></h3><svg preserveAspectRatio="none"></svg></article>`).join('');

  function series(f) {
    if (f.first) state.series = [];
    state.series.push(...(f.series || []));
    const cutoff = f.t - SERIES_SECONDS;
    while (state.series.length && state.series[0].t < cutoff) state.series.shift();
    for (const c of CHARTS) drawChart(c, f.t);
  }

  // an axis label with as many digits as the axis' scale needs
  const tick = (v, top) => (v === 0 ? '0' : top >= 10 ? num(v, 0) : top >= 1 ? num(v, 1) : String(Number(v.toPrecision(2))));

  function drawChart(c, now) {
    const card = $(`chart-${c.key}`);
    const svg = card.querySelector('svg');
    const W = Math.max(200, svg.clientWidth || 300), H = 120, L = 36, B = 16, T = 6, R = 6;
    svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
    const pts = state.series.filter((p) => p[c.key] !== null && p[c.key] !== undefined);
    const last = pts.length ? pts[pts.length - 1] : null;
    card.querySelector('h3 b').textContent = last && now - last.t < 10 ? c.fmt(last[c.key]) : '–';
    const span = Math.max(60, Math.min(SERIES_SECONDS, state.series.length ? now - state.series[0].t : 60));
    const x0 = now - span;
    let top = c.max || Math.max(...pts.map((p) => p[c.key]), 0) * 1.15;
    if (!top) top = 1;
    const X = (t) => L + (W - L - R) * (t - x0) / span, Y = (v) => T + (H - T - B) * (1 - v / top);
    let out = '';
    for (const v of [0, top / 2, top]) {
      out += `<line class="grid-line" x1="${L}" x2="${W - R}" y1="${Y(v)}" y2="${Y(v)}"/>`;
      out += `<text class="axis" x="${L - 4}" y="${Y(v) + 3}" text-anchor="end">${c.max ? `${Math.round(v * 100)}%` : tick(v, top)}</text>`;
    }
    out += `<text class="axis" x="${L}" y="${H - 3}">−${Math.round(span / 60)} min</text>`;
    out += `<text class="axis" x="${W - R}" y="${H - 3}" text-anchor="end">now</text>`;
    // a gap where nothing happened (more than 4 s between points)
    let d = '', prev = null;
    for (const p of state.series) {
      const v = p[c.key];
      if (v === null || v === undefined) { prev = null; continue; }
      d += `${prev === null || p.t - prev > 4 ? 'M' : 'L'}${X(p.t).toFixed(1)},${Y(v).toFixed(1)}`;
      prev = p.t;
    }
    if (d) out += `<path class="series" stroke="${c.colour}" d="${d}"/>`;
    else out += `<text class="nodata" x="${(L + W) / 2}" y="${H / 2}" text-anchor="middle">no tokens in this window</text>`;
    if (last) out += `<circle cx="${X(last.t)}" cy="${Y(last[c.key])}" r="2.5" fill="${c.colour}"/>`;
    svg.innerHTML = out;
  }

  // -- the last responses and the ranks -------------------------------------------------------
  function recent(f) {
    if (f.first) state.recent = [];
    state.recent.push(...(f.recent || []));
    state.recent = state.recent.slice(-12);
    const body = $('recent').querySelector('tbody');
    if (!state.recent.length) return;
    body.innerHTML = state.recent.slice().reverse().map((r) => `<tr>
      <td>${new Date(r.t * 1000).toLocaleTimeString()}</td><td>${num(r.prompt_tokens)}</td>
      <td title="${esc(r.reuse_note || '')}">${num(r.reused_tokens)}${r.reused_from ? ` (${esc(r.reused_from)})` : ''}</td>
      <td>${num(r.generated_tokens)}</td><td>${num(r.prefill_tps, 1)}</td><td>${num(r.decode_tps, 1)}</td>
      <td>${r.ttft_seconds === null || r.ttft_seconds === undefined ? '–' : `${num(r.ttft_seconds, 3)} s`}</td>
      <td>${pct(r.hit_rate)}</td><td>${num(r.mb_read, 2)}</td><td>${num(r.syncs_per_token, 2)}</td></tr>`).join('');
  }

  // one row per loaded model: several share the memory budget (engine/residents.py)
  function models(f) {
    const list = f.models || [];
    const body = $('models').querySelector('tbody');
    if (!list.length) {
      body.innerHTML = '<tr class="empty"><td colspan="10">none loaded</td></tr>';
      return;
    }
    body.innerHTML = list.map((m) => `<tr data-model="${esc(m.model)}"><td>${esc(m.model)}</td>
      <td>${m.running ? 'running' : 'waiting'}${m.pinned ? ', pinned' : ''}</td><td>${esc(slotsText(m.expert_slots))}</td>
      <td>${size(m.dense_bytes)}</td><td>${size(m.experts_bytes)}</td><td>${size(m.kv_bytes)}</td>
      <td>${size(m.memory_bytes)}</td><td>${num(m.counters && m.counters.hits)}</td><td>${num(m.counters && m.counters.misses)}</td>
      <td>${m.expires_at ? new Date(m.expires_at * 1000).toLocaleTimeString() : 'when its room is needed'}</td></tr>`).join('');
  }

  function ranks(f) {
    const list = f.ranks || [];
    $('card-ranks').hidden = !list.length && !f.pipeline_error && !f.pipeline_restarts;
    $('ranks').querySelector('tbody').innerHTML = list.map((r) => `<tr><td>${r.rank}</td><td>${esc(r.host)}</td>
      <td>${r.layers[0]}–${r.layers[1] - 1}</td><td>${esc(slotsText(r.expert_slots))}</td><td>${num(r.hits)}</td>
      <td>${num(r.misses)}</td><td>${pct(r.hit_rate)}</td><td>${num(r.bytes_read / 1e6, 1)}</td>
      <td>${num(r.read_seconds, 2)}</td><td>${num(r.wait_seconds, 2)}</td></tr>`).join('');
    $('pipeline-note').textContent = f.pipeline_error ? `broken: ${f.pipeline_error}`
      : (f.pipeline_restarts ? `restarted ${f.pipeline_restarts} times; last after: ${f.last_pipeline_error}` : '');
  }

  // -- for tests and the curious: what the page shows ------------------------------------------
  window.mlxsDashboard = {
    frames: () => state.frames,
    // the colour drawn at the centre of each cell of heatmap row `i`, read back from the canvas
    rowColours(i) {
      const row = state.heat.rows[i];
      if (!row || !geometry) return [];
      const g = $('heatmap').getContext('2d');
      const out = [];
      for (let e = 0; e < row.n; e += 1) {
        const x = Math.floor((LEFT + e * geometry.cw + geometry.cw / 2) * geometry.ratio);
        const y = Math.floor((TOP + i * geometry.ch + geometry.ch / 2) * geometry.ratio);
        out.push(Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3)).join(','));
      }
      return out;
    },
  };

  connect();
})();
