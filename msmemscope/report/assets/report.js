// msmemscope report page. Charts are Apache ECharts (inlined); the data is the JSON
// element #report-data written by report/html.py. Views: #findings, #timeline, #live,
// #compare (and the raw tables in #details).
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('report-data').textContent);
  var E = window.echarts;
  var MAX_POINTS = 2500;       // points drawn per series at any zoom
  var COLORS = { 'weights': '#4e79a7', 'gradients': '#f28e2b', 'optimizer state': '#59a14f', 'activations': '#e15759',
    'temporaries': '#bab0ac', '(before the trace)': '#d0d5dd', '(other ops)': '#bab0ac', '(other owners)': '#9c9c9c' };
  // the other layers (labels, components, ops): none of the category colours above
  var PALETTE = ['#76b7b2', '#edc948', '#b07aa1', '#ff9da7', '#9c755f', '#8cd17d', '#86bcb6', '#d37295', '#fabfd2', '#79706e'];
  var M = window.msmemscope = { data: D, timelines: [], moment: null, ready: false };

  // ------------------------------------------------------------ helpers
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) { Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); }); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function add(parent) { for (var i = 1; i < arguments.length; i++) { if (arguments[i]) { parent.appendChild(arguments[i]); } } return parent; }
  function fmtBytes(n) {
    if (n === null || n === undefined) { return 'n/a'; }
    var u = ['B', 'KB', 'MB', 'GB', 'TB'], i = 0, v = Math.abs(n);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (n < 0 ? '-' : '') + (i === 0 ? v.toFixed(0) : v.toFixed(2)) + ' ' + u[i];
  }
  function fmtUs(us) {
    if (typeof us !== 'number' || !isFinite(us)) { return 'n/a'; }
    var ms = us / 1000, a = Math.abs(ms);
    if (a >= 1000) { return (ms / 1000).toFixed(a >= 1e4 ? 1 : 3) + ' s'; }
    if (a >= 1) { return ms.toFixed(a >= 100 ? 1 : 3) + ' ms'; }
    return us.toFixed(0) + ' µs';
  }
  function undelta(a) {
    if (!a) { return null; }
    var out = new Array(a.length), s = 0;
    for (var i = 0; i < a.length; i++) { s += a[i]; out[i] = s; }
    return out;
  }
  function lowerBound(arr, v) { var lo = 0, hi = arr.length; while (lo < hi) { var m = (lo + hi) >> 1; if (arr[m] < v) { lo = m + 1; } else { hi = m; } } return lo; }
  function color(name, i) { return COLORS[name] || PALETTE[i % PALETTE.length]; }
  function stepAt(t) {
    for (var i = 0; i < D.steps.length; i++) { if (t <= D.steps[i].t) { return D.steps[i].step; } }
    return D.steps.length ? D.steps[D.steps.length - 1].step + 1 : 1;
  }
  function section(id, title, note) {
    var s = el('section', { id: id });
    add(s, el('h2', null, title));
    if (note) { add(s, el('div', { 'class': 'note' }, note)); }
    document.getElementById('app').appendChild(s);
    var nav = document.getElementById('nav');
    add(nav, el('a', { href: '#' + id }, title));
    return s;
  }
  function chartDiv(parent, cls) { var d = el('div', { 'class': 'echart' + (cls ? ' ' + cls : '') }); parent.appendChild(d); return d; }
  function table(cols, rows, numeric) {
    var wrap = el('div', { 'class': 'tablewrap' }), t = el('table'), head = el('tr');
    cols.forEach(function (c) { head.appendChild(el('th', null, c)); });
    add(t, add(el('thead'), head));
    var body = el('tbody');
    rows.forEach(function (r) {
      var tr = el('tr');
      r.forEach(function (v, i) { tr.appendChild(el('td', numeric && numeric[i] ? { 'class': 'num' } : null, v)); });
      body.appendChild(tr);
    });
    t.appendChild(body);
    wrap.appendChild(t);
    return wrap;
  }
  function shortLine(line) {
    if (!line) { return ''; }
    var m = /^(.*):(\d+)\((.*)\)$/.exec(line);
    if (!m) { return line; }
    var f = m[1].split('/'); return f[f.length - 1] + ':' + m[2] + ' (' + m[3] + ')';
  }

  // ------------------------------------------------------------ overview
  function overview() {
    var s = D.summary;
    document.getElementById('meta').textContent = 'source: ' + D.source.join(', ') + ' · generated ' + D.generated;
    var box = el('section', { id: 'overview' }), cards = el('div', { 'class': 'cards' });
    var peak = 0; D.series.forEach(function (x) { peak = Math.max(peak, x.peak); });
    [[fmtBytes(peak), 'peak allocated'], [s.events.toLocaleString(), 'events'], [s.steps, 'step boundaries'],
      [s.ops.toLocaleString(), 'ops'], [s.mallocs.toLocaleString() + ' / ' + s.frees.toLocaleString(), 'allocs / frees'],
      [s.live_at_end + ' (' + fmtBytes(s.live_bytes_at_end) + ')', 'blocks live at the end'],
      [fmtUs(s.duration_us), 'duration']].forEach(function (c) {
      add(cards, add(el('div', { 'class': 'card' }), el('b', null, c[0]), el('span', null, c[1])));
    });
    add(box, cards);
    document.getElementById('app').appendChild(box);
  }

  // ------------------------------------------------------------ findings
  function findings() {
    if (!D.findings || !D.findings.length) { return; }
    var s = section('findings', 'Findings', 'each sentence links to its moment on the timeline; the raw fields are in its detail');
    var ul = el('ul', { 'class': 'findings' });
    D.findings.forEach(function (f, i) {
      var li = el('li', { 'class': 'k-' + f.kind, 'data-kind': f.kind });
      add(li, el('span', { 'class': 'text' }, f.text));
      if (f.window || f.at !== undefined && f.at !== null) {
        var a = el('a', { href: '#timeline', 'class': 'go', 'data-finding': String(i) }, 'show on timeline');
        a.addEventListener('click', function (ev) { ev.preventDefault(); focusFinding(f); });
        add(li, a);
      }
      if (f.raw !== undefined && f.raw !== null) {
        add(li, add(el('details'), el('summary', null, 'detail'), el('pre', null, JSON.stringify(f.raw, null, 1))));
      }
      ul.appendChild(li);
    });
    add(s, ul);
  }
  function focusFinding(f) {
    var tl = M.timelines[D.main || 0];
    if (!tl) { return; }
    var t0, t1, at = null;
    if (f.window) { t0 = f.window[0]; t1 = f.window[1]; at = t1; } else { at = f.at; t0 = at; t1 = at; }
    var pad = Math.max((t1 - t0) * 0.15, (tl.full[1] - tl.full[0]) * 0.02, 1);
    M.timelines.forEach(function (x) { zoomTo(x, t0 - pad, t1 + pad); });
    if (f.focus_step !== undefined && f.focus_step !== null && tl.s.live.step_end[String(f.focus_step)] !== undefined) {
      setMoment(D.main || 0, tl.s.live.step_end[String(f.focus_step)]);
    } else if (at !== null) { setMoment(D.main || 0, nearestSample(tl.s.live, at)); }
    document.getElementById('timeline').scrollIntoView();
  }

  // ------------------------------------------------------------ timeline
  function decodeLevels(s) {
    s.levels.forEach(function (lv) {
      lv.T = undelta(lv.t); lv.HI = undelta(lv.hi); lv.LO = undelta(lv.lo); lv.TOT = undelta(lv.total);
      lv.L = lv.layers.map(undelta);
    });
  }
  function pickLevel(s, a, b) {
    // the finest level whose points in [a, b] stay under MAX_POINTS
    for (var k = s.levels.length - 1; k >= 0; k--) {
      var T = s.levels[k].T, i0 = lowerBound(T, a), i1 = lowerBound(T, b);
      if (i1 - i0 <= MAX_POINTS || k === 0) { return { k: k, i0: Math.max(0, i0 - 1), i1: Math.min(T.length, i1 + 1) }; }
    }
  }
  function timelineData(tl, a, b) {
    var s = tl.s, p = pickLevel(s, a, b), lv = s.levels[p.k], n = s.layers.length, out = [], acc = [];
    var T = lv.T.slice(p.i0, p.i1);
    for (var i = 0; i < T.length; i++) { acc.push(0); }
    for (var j = 0; j < n; j++) {
      var Lj = lv.L[j], col = new Array(T.length);
      for (i = 0; i < T.length; i++) { acc[i] += Lj[p.i0 + i]; col[i] = [T[i] / 1000, acc[i]]; }
      out.push(col);
    }
    tl.level = p.k; tl.slice = p;
    tl.shown = T.length;
    var lo = [], tot = [];
    for (i = 0; i < T.length; i++) {
      lo.push([T[i] / 1000, lv.LO[p.i0 + i]]);
      if (lv.TOT) { tot.push([T[i] / 1000, lv.TOT[p.i0 + i]]); }
    }
    return { layers: out, lo: lo, tot: lv.TOT ? tot : null };
  }
  function seriesOptions(tl, d) {
    var s = tl.s, n = s.layers.length, ser = [];
    // cumulative layers drawn from the top one down, opaque: a stacked area without
    // the library's per-point stack lookup
    for (var j = n - 1; j >= 0; j--) {
      ser.push({ name: s.layers[j], type: 'line', step: 'end', data: d.layers[j], symbol: 'none', showSymbol: false, lineStyle: { width: 0 },
        areaStyle: { color: color(s.layers[j], j), opacity: 1 }, itemStyle: { color: color(s.layers[j], j) }, animation: false, z: 2 });
    }
    var marks = [];
    D.steps.slice(0, 300).forEach(function (st) {
      marks.push({ xAxis: st.t / 1000, name: 'step ' + st.step, lineStyle: { color: '#98a2b3', type: 'dashed', width: 1 },
        label: { show: D.steps.length <= 40, formatter: 'end of step ' + st.step, position: 'insideEndTop', fontSize: 10, color: '#667085' } });
    });
    D.marks.slice(0, 200).forEach(function (mk) {
      marks.push({ xAxis: mk.t / 1000, name: mk.name, lineStyle: { color: '#7a5af8', type: 'dotted', width: 1 },
        label: { show: D.marks.length <= 12, formatter: String(mk.name).slice(0, 30), position: 'insideStartTop', fontSize: 10, color: '#7a5af8' } });
    });
    if (M.moment && M.moment.series === tl.index) {
      marks.push({ xAxis: M.moment.t / 1000, name: 'selected', lineStyle: { color: '#d92d20', width: 2, type: 'solid' },
        label: { show: true, formatter: 'live view', color: '#d92d20', position: 'insideEndBottom' } });
    }
    ser.push({ name: 'bucket min', type: 'line', step: 'end', data: d.lo, symbol: 'none', lineStyle: { width: 1, color: '#344054', type: 'dotted' },
      animation: false, z: 4, markLine: { symbol: 'none', silent: true, animation: false, data: marks },
      markPoint: { animation: false, symbolSize: 44, data: [{ name: 'peak', coord: [s.peak_t / 1000, s.peak], value: fmtBytes(s.peak),
        itemStyle: { color: '#d92d20' }, label: { fontSize: 9 } }] },
      markArea: { silent: true, itemStyle: { color: 'rgba(122,90,248,0.06)' },
        data: D.ranges.slice(0, 100).map(function (r) { return [{ xAxis: r.t0 / 1000, name: r.name }, { xAxis: r.t1 / 1000 }]; }) } });
    if (d.tot) {
      ser.push({ name: 'reserved', type: 'line', step: 'end', data: d.tot, symbol: 'none', lineStyle: { width: 1.5, color: '#101828' }, animation: false, z: 5 });
    }
    return ser;
  }
  function tooltip(tl) {
    return function (params) {
      if (!params.length) { return ''; }
      var s = tl.s, lv = s.levels[tl.level], i = tl.slice.i0 + params[0].dataIndex;
      // a tooltip for a point of the slice drawn before the last zoom: nothing to say
      if (!lv || params[0].dataIndex === undefined || i < 0 || i >= lv.T.length) { return ''; }
      var lines = ['<b>' + fmtUs(lv.T[i]) + '</b> · step ' + stepAt(lv.T[i]) + ' · bucket of ' + lv.n[i] + ' event(s)',
        'allocated ' + fmtBytes(lv.HI[i]) + ' (min in bucket ' + fmtBytes(lv.LO[i]) + ')'];
      if (lv.TOT) { lines.push('reserved ' + fmtBytes(lv.TOT[i])); }
      var op = s.ops[lv.op[i]];
      if (op) { lines.push('op at the bucket peak: ' + op.replace(/</g, '&lt;')); }
      for (var j = s.layers.length - 1; j >= 0; j--) {
        if (lv.L[j][i]) { lines.push('<span style="color:' + color(s.layers[j], j) + '">■</span> ' + s.layers[j].replace(/</g, '&lt;') + ': ' + fmtBytes(lv.L[j][i])); }
      }
      lines.push('<i>click: what is live here</i>');
      return lines.join('<br>');
    };
  }
  function zoomTo(tl, a, b) {
    tl.chart.dispatchAction({ type: 'dataZoom', dataZoomIndex: 0, startValue: a / 1000, endValue: b / 1000 });
  }
  function redraw(tl, range) {
    // the window from the zoom event when there is one (getOption() copies the whole option)
    if (range) { tl.view = range; } else if (!tl.view) { tl.view = tl.full.slice(); }
    var a = tl.view[0], b = tl.view[1];
    tl.chart.setOption({ series: seriesOptions(tl, timelineData(tl, a, b)) }, { replaceMerge: ['series'] });
    tl.info.textContent = 'level ' + tl.level + ' of ' + (tl.s.levels.length - 1) + ': ' + tl.shown + ' points, each the min/max of a ' +
      fmtUs(tl.s.levels[tl.level].span_us) + ' bucket · ' + tl.s.events.toLocaleString() + ' events in this series';
  }
  function zoomRange(tl, ev) {
    var z = ev.batch ? ev.batch[0] : ev, f0 = tl.full[0], f1 = tl.full[1];
    if (z.startValue !== undefined && z.endValue !== undefined) { return [z.startValue * 1000, z.endValue * 1000]; }
    if (z.start !== undefined && z.end !== undefined) { return [f0 + (f1 - f0) * z.start / 100, f0 + (f1 - f0) * z.end / 100]; }
    var o = tl.chart.getOption().dataZoom[0];
    return [o.startValue * 1000, o.endValue * 1000];
  }
  function timeline() {
    if (!D.series.length) { return; }
    var sec = section('timeline', 'Memory over time', 'stacked by ' + (D.series[0].by === 'owner' ? 'what the memory is (owner)' : 'the op that allocated it') +
      '; wheel or drag to zoom and pan, click a moment to see what is live there');
    D.series.forEach(function (s, idx) {
      decodeLevels(s);
      add(sec, el('h3', null, 'device ' + s.device + ' · pool ' + s.pool + ' · peak ' + fmtBytes(s.peak) +
        (s.peak_reserved && s.peak_reserved !== s.peak ? ' · reserved peak ' + fmtBytes(s.peak_reserved) : '')));
      var info = el('div', { 'class': 'note level-info' });
      add(sec, info);
      var div = chartDiv(sec, 'timeline-chart');
      div.setAttribute('data-series', String(idx));
      var chart = E.init(div, null, { renderer: 'canvas' });
      var last = s.levels[0].T[s.levels[0].T.length - 1] || 1;
      var tl = { s: s, index: idx, chart: chart, info: info, full: [0, Math.max(last, D.summary.duration_us || 1)], level: 0 };
      M.timelines.push(tl);
      chart.setOption({
        animation: false,
        grid: { left: 78, right: 24, top: 30, bottom: 66 },
        legend: { top: 2, selectedMode: false, data: s.layers.slice(), type: 'scroll' },
        tooltip: { trigger: 'axis', formatter: tooltip(tl), axisPointer: { type: 'line' }, confine: true },
        xAxis: { type: 'value', min: 0, max: tl.full[1] / 1000, axisLabel: { formatter: function (v) { return fmtUs(v * 1000); } } },
        yAxis: { type: 'value', axisLabel: { formatter: function (v) { return fmtBytes(v); } } },
        dataZoom: [{ type: 'inside', xAxisIndex: 0, filterMode: 'none' }, { type: 'slider', xAxisIndex: 0, filterMode: 'none', height: 22, bottom: 8 }],
        series: []
      });
      redraw(tl);
      chart.on('datazoom', function (ev) { redraw(tl, zoomRange(tl, ev)); });
      chart.getZr().on('click', function (e) {
        var p = [e.offsetX, e.offsetY];
        if (!chart.containPixel({ gridIndex: 0 }, p)) { return; }
        var v = chart.convertFromPixel({ gridIndex: 0 }, p);
        setMoment(idx, nearestSample(s.live, v[0] * 1000));
      });
    });
  }

  // ------------------------------------------------------------ live view
  function nearestSample(lv, t) {
    var i = lowerBound(lv.t, t);
    if (i >= lv.t.length) { return lv.t.length - 1; }
    if (i > 0 && Math.abs(lv.t[i - 1] - t) <= Math.abs(lv.t[i] - t)) { return i - 1; }
    return i;
  }
  function leafValue(v, j) {
    // change points [moment, bytes, ...]: the last one at or before j
    var lo = 0, hi = v.length / 2 - 1, ans = -1;
    while (lo <= hi) { var m = (lo + hi) >> 1; if (v[2 * m] <= j) { ans = m; lo = m + 1; } else { hi = m - 1; } }
    return ans < 0 ? 0 : v[2 * ans + 1];
  }
  function liveAt(lv, j) { return lv.leaves.map(function (lf) { return leafValue(lf.v, j); }); }
  // grouped by module: the module's path from its root (GPT, GPT.blocks, GPT.blocks.0, ...), then the op
  function modulePath(lv, lf) {
    if (lf.mpath) { return lf.mpath; }
    if (!lv.moduleFrames) { lv.moduleFrames = {}; }
    var ids = [], parts = lf.module ? String(lf.module).split('.') : ['(outside modules)'];
    for (var i = 0; i < parts.length; i++) {
      var full = parts.slice(0, i + 1).join('.'), id = lv.moduleFrames[full];
      if (id === undefined) { id = lv.moduleFrames[full] = lv.frames.length; lv.frames.push([i ? parts[i] : full, full]); }
      ids.push(id);
    }
    ids.push(lf.path[lf.path.length - 1]);
    lf.mpath = ids;
    return ids;
  }
  function buildTree(lv, names, values) {
    var root = { name: 'all', full: '', value: 0, children: {}, layer: {}, depth: 0 };
    var maxDepth = 0;
    lv.leaves.forEach(function (lf, i) {
      var v = values[i];
      if (v <= 0) { return; }
      var node = root; root.value += v;
      root.layer[lf.layer] = (root.layer[lf.layer] || 0) + v;
      (LV.group === 'module' && lv.has_modules ? modulePath(lv, lf) : lf.path).forEach(function (fid, d, path) {
        var key = String(fid), c = node.children[key];
        if (!c) { c = node.children[key] = { name: lv.frames[fid][0], full: lv.frames[fid][1], value: 0, children: {}, layer: {}, depth: d + 1 }; }
        c.value += v; c.layer[lf.layer] = (c.layer[lf.layer] || 0) + v;
        if (d === path.length - 1 && lf.line) { c.line = lf.line; }
        node = c;
        maxDepth = Math.max(maxDepth, d + 1);
      });
    });
    var nodes = [];
    (function walk(n, x0) {
      var best = null, bv = -1;
      Object.keys(n.layer).forEach(function (k) { if (n.layer[k] > bv) { bv = n.layer[k]; best = +k; } });
      nodes.push({ value: [n.depth, x0, x0 + n.value], name: n.name, full: n.full, bytes: n.value, layer: best, line: n.line });
      var kids = Object.keys(n.children).map(function (k) { return n.children[k]; }).sort(function (a, b) { return b.value - a.value; });
      var x = x0;
      kids.forEach(function (c) { walk(c, x); x += c.value; });
    })(root, 0);
    return { nodes: nodes, total: root.value, depth: maxDepth + 1 };
  }
  function flameOption(tree, names, title) {
    return {
      animation: false,
      title: { text: title, left: 6, top: 2, textStyle: { fontSize: 12, fontWeight: 'normal' } },
      grid: { left: 6, right: 6, top: 26, bottom: 6 },
      tooltip: { formatter: function (p) {
        var n = tree.nodes[p.dataIndex];
        return '<b>' + String(n.name).replace(/</g, '&lt;') + '</b><br>' + fmtBytes(n.bytes) + ' (' + (100 * n.bytes / Math.max(1, tree.total)).toFixed(1) + '%)' +
          (n.layer !== null && n.layer !== undefined ? '<br>mostly ' + String(names[n.layer]).replace(/</g, '&lt;') : '') +
          (n.full ? '<br>' + n.full.replace(/</g, '&lt;') : '') + (n.line ? '<br>user line: ' + n.line.replace(/</g, '&lt;') : '');
      } },
      xAxis: { type: 'value', show: false, min: 0, max: Math.max(1, tree.total) },
      yAxis: { type: 'value', show: false, min: 0, max: Math.max(tree.depth, 6), inverse: true },
      series: [{ type: 'custom', data: tree.nodes, encode: { x: [1, 2], y: 0 },
        renderItem: function (params, api) {
          var n = tree.nodes[params.dataIndex], d = api.value(0);
          var a = api.coord([api.value(1), d]), b = api.coord([api.value(2), d + 1]);
          var w = b[0] - a[0], h = b[1] - a[1];
          if (w < 0.3) { return null; }
          var txt = w > 28 ? String(n.name + ' ' + fmtBytes(n.bytes)) : '';
          var maxc = Math.floor((w - 6) / 6.3);
          if (txt.length > maxc) { txt = maxc > 3 ? txt.slice(0, maxc - 1) + '…' : ''; }
          var fill = n.depth === 0 || n.layer === null ? '#98a2b3' : color(names[n.layer], n.layer);
          return { type: 'group', children: [
            { type: 'rect', shape: { x: a[0], y: a[1], width: Math.max(w - 0.5, 0.3), height: h - 1 }, style: { fill: fill, stroke: '#fff', lineWidth: 0.5 } },
            { type: 'text', style: { x: a[0] + 3, y: a[1] + h / 2, text: txt, fill: '#101828', verticalAlign: 'middle', font: '11px sans-serif' }, silent: true }] };
        } }]
    };
  }
  function siteRows(lv, names, values, limit) {
    var by = {};
    lv.leaves.forEach(function (lf, i) {
      var v = values[i];
      if (!v) { return; }
      var op = lv.frames[lf.path[lf.path.length - 1]][0];
      var k = (lf.line || '') + '|' + op + '|' + lf.layer;
      if (!by[k]) { by[k] = { line: lf.line, op: op, layer: names[lf.layer], v: 0 }; }
      by[k].v += v;
    });
    var rows = Object.keys(by).map(function (k) { return by[k]; });
    rows.sort(function (a, b) { return Math.abs(b.v) - Math.abs(a.v); });
    return rows.slice(0, limit);
  }
  var LV = {};
  function liveView() {
    if (!D.series.length) { return; }
    var sec = section('live', 'What is live', 'the blocks live at a moment (the peak unless you click the timeline), by ' +
      (D.series[D.main || 0].live.has_stacks ? 'Python stack, then op' : 'what they are, then op') + '; click a box to zoom into it, double-click to zoom out');
    var bar = el('div', { 'class': 'toolbar' });
    var sel = el('select', { id: 'live-series' });
    D.series.forEach(function (s, i) { sel.appendChild(el('option', { value: String(i) }, 'device ' + s.device + ' · ' + s.pool)); });
    sel.value = String(D.main || 0);
    var peakBtn = el('button', { type: 'button', id: 'live-peak' }, 'the peak');
    var title = el('span', { 'class': 'moment', id: 'live-title' });
    add(bar, el('span', null, 'series'), sel, peakBtn);
    LV.group = 'stack';
    if (D.series.some(function (s) { return s.live.has_modules; })) {
      // the dump says which nn.Module made each block: the flame graph can be grouped by module
      var gsel0 = el('select', { id: 'live-group' });
      gsel0.appendChild(el('option', { value: 'stack' }, D.series[D.main || 0].live.has_stacks ? 'Python stack' : 'what it is'));
      gsel0.appendChild(el('option', { value: 'module' }, 'module'));
      gsel0.addEventListener('change', function () {
        LV.group = gsel0.value;
        if (M.moment) { setMoment(M.moment.series, M.moment.index); }
      });
      add(bar, el('span', null, 'group by'), gsel0);
    }
    add(bar, title);
    add(sec, bar);
    LV.div = chartDiv(sec, 'flame');
    LV.div.id = 'live-flame';
    LV.chart = E.init(LV.div);
    LV.table = el('div', { id: 'live-table' });
    add(sec, LV.table);
    sel.addEventListener('change', function () { var i = +sel.value; setMoment(i, D.series[i].live.peak); });
    peakBtn.addEventListener('click', function () { var i = +sel.value; setMoment(i, D.series[i].live.peak); });
    LV.sel = sel; LV.title = title;
    function zoomNode(chart, getTree) {
      chart.on('click', function (p) { var n = getTree().nodes[p.dataIndex]; chart.setOption({ xAxis: { min: n.value[1], max: n.value[2] } }); });
      chart.getZr().on('dblclick', function () { chart.setOption({ xAxis: { min: 0, max: Math.max(1, getTree().total) } }); });
    }
    zoomNode(LV.chart, function () { return LV.tree; });
    // what grew between step N and N+1
    var s0 = D.series[D.main || 0];
    var stepKeys = Object.keys(s0.live.step_end).map(Number).sort(function (a, b) { return a - b; });
    var pairs = stepKeys.filter(function (n) { return s0.live.step_end[String(n + 1)] !== undefined; });
    if (pairs.length) {
      add(sec, el('h3', { id: 'grew' }, 'What grew between two step ends'));
      var gbar = el('div', { 'class': 'toolbar' }), gsel = el('select', { id: 'grew-step' });
      pairs.forEach(function (n) { gsel.appendChild(el('option', { value: String(n) }, 'step ' + n + ' → step ' + (n + 1))); });
      // open on the step pair that grew most (the last pair when none grew)
      var best = pairs[pairs.length - 1], bestUp = 0;
      pairs.forEach(function (n) {
        var a = liveAt(s0.live, s0.live.step_end[String(n)]), b = liveAt(s0.live, s0.live.step_end[String(n + 1)]), up = 0;
        for (var i = 0; i < a.length; i++) { if (b[i] > a[i]) { up += b[i] - a[i]; } }
        if (up > bestUp) { bestUp = up; best = n; }
      });
      gsel.value = String(best);
      var gsum = el('span', { id: 'grew-summary' });
      add(gbar, el('span', null, 'from the end of'), gsel, gsum);
      add(sec, gbar);
      LV.gdiv = chartDiv(sec, 'flame');
      LV.gdiv.id = 'grew-flame';
      LV.gchart = E.init(LV.gdiv);
      LV.gtable = el('div', { id: 'grew-table' });
      add(sec, LV.gtable);
      zoomNode(LV.gchart, function () { return LV.gtree; });
      var upd = function () { grew(+gsel.value); };
      gsel.addEventListener('change', upd);
      LV.grewStep = +gsel.value;
      upd();
    }
  }
  function setMoment(si, j) {
    var s = D.series[si], lv = s.live, names = s.layers;
    if (j === undefined || j === null || j < 0) { return; }
    var values = liveAt(lv, j);
    var tree = buildTree(lv, names, values);
    LV.tree = tree;
    LV.sel.value = String(si);
    M.moment = { series: si, index: j, t: lv.t[j], total: tree.total, nodes: tree.nodes.length };
    var what = j === lv.peak ? 'at the peak' : 'at the selected moment';
    LV.title.textContent = 'live ' + what + ': ' + fmtBytes(tree.total) + ' at ' + fmtUs(lv.t[j]) + ' (step ' + lv.step[j] + ')';
    LV.chart.setOption(flameOption(tree, names, 'live ' + what + ' · ' + fmtBytes(tree.total)), true);
    var rows = siteRows(lv, names, values, 15);
    LV.table.innerHTML = '';
    add(LV.table, table(['line of code', 'op', 'what', 'live bytes'], rows.map(function (r) {
      return [r.line ? shortLine(r.line) : '(no Python line)', r.op, r.layer, fmtBytes(r.v)];
    }), [false, false, false, true]));
    M.timelines.forEach(function (tl) { redraw(tl); });
  }
  function grew(n) {
    var s = D.series[D.main || 0], lv = s.live, names = s.layers;
    var a = liveAt(lv, lv.step_end[String(n)]), b = liveAt(lv, lv.step_end[String(n + 1)]);
    var diff = b.map(function (v, i) { return v - a[i]; });
    var up = diff.map(function (v) { return v > 0 ? v : 0; });
    var plus = 0, minus = 0;
    diff.forEach(function (v) { if (v > 0) { plus += v; } else { minus -= v; } });
    LV.gtree = buildTree(lv, names, up);
    LV.grewStep = n;
    document.getElementById('grew-summary').textContent = ' · grew ' + fmtBytes(plus) + ', freed ' + fmtBytes(minus) + ', net ' + fmtBytes(plus - minus);
    LV.gchart.setOption(flameOption(LV.gtree, names, 'grew from the end of step ' + n + ' to the end of step ' + (n + 1) + ' · ' + fmtBytes(plus)), true);
    LV.gtable.innerHTML = '';
    add(LV.gtable, table(['line of code', 'op', 'what', 'change'], siteRows(lv, names, diff, 15).map(function (r) {
      return [r.line ? shortLine(r.line) : '(no Python line)', r.op, r.layer, (r.v > 0 ? '+' : '') + fmtBytes(r.v)];
    }), [false, false, false, true]));
  }

  // ------------------------------------------------------------ compare two steps
  function compare() {
    var C = D.compare;
    if (!C && !(D.compare_tables || []).length) { return; }
    var sec = section('compare', 'Compare two steps', 'per op, what each step allocated; the largest differences first');
    if (C) {
      var bar = el('div', { 'class': 'toolbar' }), sa = el('select', { id: 'compare-a' }), sb = el('select', { id: 'compare-b' });
      C.steps.forEach(function (st) { sa.appendChild(el('option', { value: String(st) }, 'step ' + st)); sb.appendChild(el('option', { value: String(st) }, 'step ' + st)); });
      // open on the two consecutive steps that differ most (the last two when none differ)
      var n = C.steps.length, per = {};
      C.cells.forEach(function (c) { (per[c[0]] = per[c[0]] || {})[c[1]] = c[2]; });
      var bestA = C.steps[n >= 3 ? n - 3 : 0], bestD = 0;
      for (var k = 0; k + 1 < n; k++) {
        var x = per[C.steps[k]] || {}, y = per[C.steps[k + 1]] || {}, d = 0;
        C.ops.forEach(function (op, i) { d += Math.abs((y[i] || 0) - (x[i] || 0)); });
        if (d > bestD) { bestD = d; bestA = C.steps[k]; }
      }
      var ia = C.steps.indexOf(bestA);
      sa.value = String(bestA); sb.value = String(C.steps[Math.min(ia + 1, n - 1)]);
      add(bar, el('span', null, 'step'), sa, el('span', null, 'against'), sb);
      add(sec, bar);
      var div = chartDiv(sec, 'bars'); div.id = 'compare-chart';
      var chart = E.init(div), tbox = el('div', { id: 'compare-table' });
      add(sec, tbox);
      var upd = function () {
        var A = +sa.value, B = +sb.value, a = {}, b = {};
        C.cells.forEach(function (c) { if (c[0] === A) { a[c[1]] = c; } if (c[0] === B) { b[c[1]] = c; } });
        var rows = C.ops.map(function (op, i) {
          var x = a[i] ? a[i][2] : 0, y = b[i] ? b[i][2] : 0;
          return { op: op, a: x, b: y, na: a[i] ? a[i][3] : 0, nb: b[i] ? b[i][3] : 0, d: y - x };
        }).filter(function (r) { return r.a || r.b; });
        rows.sort(function (p, q) { return Math.abs(q.d) - Math.abs(p.d) || q.b - p.b; });
        var top = rows.slice(0, 20).reverse();
        chart.setOption({ animation: false, legend: { top: 0 }, tooltip: { trigger: 'axis', axisPointer: { type: 'shadow' },
          valueFormatter: function (v) { return fmtBytes(v); } },
          grid: { left: 220, right: 30, top: 30, bottom: 30 },
          xAxis: { type: 'value', axisLabel: { formatter: function (v) { return fmtBytes(v); } } },
          yAxis: { type: 'category', data: top.map(function (r) { return r.op; }), axisLabel: { width: 200, overflow: 'truncate' } },
          series: [{ name: 'step ' + A, type: 'bar', data: top.map(function (r) { return r.a; }), itemStyle: { color: '#98a2b3' } },
            { name: 'step ' + B, type: 'bar', data: top.map(function (r) { return r.b; }), itemStyle: { color: '#2f6fde' } }] }, true);
        tbox.innerHTML = '';
        add(tbox, table(['op', 'step ' + A, 'blocks', 'step ' + B, 'blocks', 'difference'], rows.map(function (r) {
          return [r.op, fmtBytes(r.a), r.na, fmtBytes(r.b), r.nb, (r.d > 0 ? '+' : '') + fmtBytes(r.d)];
        }), [false, true, true, true, true, true]));
      };
      sa.addEventListener('change', upd); sb.addEventListener('change', upd);
      upd();
    }
    (D.compare_tables || []).forEach(function (t) { add(sec, el('h3', null, t.title)); rawTable(sec, t); });
  }

  // ------------------------------------------------------------ raw tables
  function rawTable(parent, t) {
    if (t.note) { add(parent, el('div', { 'class': 'note' }, t.note)); }
    var fmt = t.fmt || {};
    add(parent, table(t.columns, t.rows.map(function (r) {
      return r.map(function (v, i) { return fmt[String(i)] === 'bytes' && typeof v === 'number' ? fmtBytes(v) : (v === null ? '' : v); });
    }), t.columns.map(function (c, i) { return t.rows.length && typeof t.rows[0][i] === 'number'; })));
    if (t.more) { add(parent, el('div', { 'class': 'note' }, t.more + ' more rows not shown')); }
  }
  function details() {
    if (!D.tables.length) { return; }
    var sec = section('details', 'Tables', 'the raw numbers behind the views');
    D.tables.forEach(function (t) {
      var d = el('details');
      add(d, el('summary', null, t.title + ' (' + t.rows.length + (t.more ? '+' + t.more : '') + ' rows)'));
      rawTable(d, t);
      add(sec, d);
    });
  }

  // ------------------------------------------------------------ start
  function start() {
    overview();
    findings();
    timeline();
    liveView();
    if (D.series.length) { var s = D.series[D.main || 0]; setMoment(D.main || 0, s.live.peak); }
    compare();
    details();
    window.addEventListener('resize', function () {
      M.timelines.forEach(function (tl) { tl.chart.resize(); });
      [LV.chart, LV.gchart].forEach(function (c) { if (c) { c.resize(); } });
    });
    if (location.hash) { var t = document.getElementById(location.hash.slice(1)); if (t) { t.scrollIntoView(); } }
    M.ready = true;
    M.setMoment = setMoment; M.zoomTo = function (i, a, b) { zoomTo(M.timelines[i], a, b); }; M.grew = grew;
    M.live = LV;
    document.body.setAttribute('data-ready', '1');
  }
  start();
})();
