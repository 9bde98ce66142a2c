// msmemscope report page: canvas charts of downsampled memory series, zoom,
// hover, sortable tables. No libraries; the data is inlined by report/html.py.
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('report-data').textContent);
  var PAD = { l: 72, r: 14, t: 18, b: 26 };
  var PALETTE = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#edc948', '#b07aa1', '#ff9da7', '#9c755f', '#bab0ac'];
  var full = { x0: 0, x1: Math.max(D.summary.duration_ms, 1e-6) };
  var view = { x0: full.x0, x1: full.x1 };
  var charts = [];
  var tip = document.getElementById('tip');

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) { Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); }); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) { return 'n/a'; }
    var u = ['B', 'KB', 'MB', 'GB', 'TB'], i = 0, v = Math.abs(n);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (n < 0 ? '-' : '') + (i === 0 ? v.toFixed(0) : v.toFixed(2)) + ' ' + u[i];
  }
  function fmtTime(ms) {
    var a = Math.abs(ms);
    if (a >= 1000) { return (ms / 1000).toFixed(a >= 1e4 ? 1 : 3) + ' s'; }
    if (a >= 1) { return ms.toFixed(a >= 100 ? 1 : 3) + ' ms'; }
    return (ms * 1000).toFixed(1) + ' µs';
  }
  function niceStep(range, n) {
    var raw = range / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  function niceBytesStep(max, n) {
    var unit = 1;
    while (max / unit >= 1024 && unit < Math.pow(1024, 4)) { unit *= 1024; }
    return niceStep(max / unit, n) * unit;
  }
  // last index i with arr[i] <= v (or -1)
  function floorIndex(arr, v) {
    var lo = 0, hi = arr.length - 1, ans = -1;
    while (lo <= hi) { var m = (lo + hi) >> 1; if (arr[m] <= v) { ans = m; lo = m + 1; } else { hi = m - 1; } }
    return ans;
  }
  function stepAt(t) {
    // a STEP row ends its step: the step of time t is the first boundary at or after it
    for (var i = 0; i < D.steps.length; i++) { if (t <= D.steps[i].t) { return D.steps[i].step; } }
    return D.steps.length ? D.steps[D.steps.length - 1].step + 1 : 1;
  }

  // ------------------------------------------------------------ overview
  function overview() {
    var s = D.summary, box = document.getElementById('overview');
    document.getElementById('meta').textContent = 'source: ' + D.source.join(', ') + ' · generated ' + D.generated;
    var cards = el('div', { 'class': 'cards' });
    var peak = 0; D.series.forEach(function (x) { peak = Math.max(peak, x.peak); });
    [[fmtBytes(peak), 'peak allocated'], [s.events.toLocaleString(), 'events'], [s.steps, 'step boundaries'],
      [s.ops.toLocaleString(), 'ops'], [s.mallocs.toLocaleString() + ' / ' + s.frees.toLocaleString(), 'allocs / frees'],
      [s.live_at_end + ' (' + fmtBytes(s.live_bytes_at_end) + ')', 'live at end'], [fmtTime(s.duration_ms), 'traced time']
    ].forEach(function (c) { var d = el('div', { 'class': 'card' }); d.appendChild(el('b', null, c[0])); d.appendChild(el('span', null, c[1])); cards.appendChild(d); });
    box.appendChild(cards);
  }

  // ------------------------------------------------------------ charts
  function Chart(series, index) {
    this.s = series; this.index = index; this.hover = -1; this.drag = null;
    var box = el('div', { 'class': 'chart', id: 'chart-' + index });
    var title = 'device ' + series.device + ' · pool ' + series.pool + ' — peak allocated ' + fmtBytes(series.peak) +
      (series.peak_reserved !== null ? ', peak reserved ' + fmtBytes(series.peak_reserved) : '') +
      ' · ' + series.events.toLocaleString() + ' alloc/free events';
    box.appendChild(el('h3', null, title));
    this.canvas = el('canvas', { 'aria-label': title });
    box.appendChild(this.canvas);
    var legend = el('div', { 'class': 'legend' });
    function item(color, text) { var s = el('span'); var i = el('i'); i.style.background = color; s.appendChild(i); s.appendChild(document.createTextNode(text)); legend.appendChild(s); }
    if (series.owners) {
      series.owners.names.forEach(function (n, k) { item(PALETTE[k % PALETTE.length], n); });
    } else {
      item('#9fbff0', 'allocated (bucket max)'); item('#2f6fde', 'allocated (end of bucket)');
    }
    if (series.total) { item('#e8590c', 'reserved'); }
    if (D.steps.length) { item('#98a2b3', 'step boundary'); }
    if (D.marks.length) { item('#7b2cbf', 'mark'); }
    box.appendChild(legend);
    document.getElementById('charts').appendChild(box);
    this.attach();
  }
  Chart.prototype.size = function () {
    var r = this.canvas.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
    var w = Math.max(200, Math.round(r.width)), h = Math.max(120, Math.round(r.height));
    if (this.canvas.width !== w * dpr || this.canvas.height !== h * dpr) { this.canvas.width = w * dpr; this.canvas.height = h * dpr; }
    this.w = w; this.h = h; this.dpr = dpr;
  };
  Chart.prototype.xOf = function (t) { return PAD.l + (t - view.x0) / (view.x1 - view.x0) * (this.w - PAD.l - PAD.r); };
  Chart.prototype.tOf = function (x) { return view.x0 + (x - PAD.l) / (this.w - PAD.l - PAD.r) * (view.x1 - view.x0); };
  Chart.prototype.yOf = function (v) { return this.h - PAD.b - v / this.ymax * (this.h - PAD.t - PAD.b); };
  Chart.prototype.stackTop = function (i) {
    var o = this.s.owners, sum = 0;
    for (var k = 0; k < o.values.length; k++) { sum += Math.max(0, o.values[k][i] || 0); }
    return sum;
  };
  Chart.prototype.visible = function () {
    var s = this.s, a = Math.max(0, floorIndex(s.t, view.x0)), b = floorIndex(s.t, view.x1);
    return [a, Math.max(a, b)];
  };
  Chart.prototype.draw = function () {
    this.size();
    var s = this.s, c = this.canvas.getContext('2d'), self = this;
    c.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    c.fillStyle = '#ffffff'; c.fillRect(0, 0, this.w, this.h);
    var range = this.visible(), a = range[0], b = range[1], i, k, ymax = 1;
    for (i = a; i <= b && i < s.t.length; i++) {
      ymax = Math.max(ymax, s.hi[i], s.total ? s.total[i] : 0, s.owners ? this.stackTop(i) : 0);
    }
    var ystep = niceBytesStep(ymax * 1.05, 5);
    this.ymax = Math.ceil(ymax * 1.05 / ystep) * ystep;
    // grid and axes
    c.font = '11px system-ui, sans-serif'; c.strokeStyle = '#eaecf0'; c.fillStyle = '#667085'; c.lineWidth = 1;
    c.textAlign = 'right'; c.textBaseline = 'middle';
    for (var v = 0; v <= this.ymax + 1e-9; v += ystep) {
      var y = Math.round(this.yOf(v)) + 0.5;
      c.beginPath(); c.moveTo(PAD.l, y); c.lineTo(this.w - PAD.r, y); c.stroke();
      c.fillText(fmtBytes(v), PAD.l - 6, y);
    }
    var tstep = niceStep(view.x1 - view.x0, Math.max(2, Math.floor((this.w - PAD.l - PAD.r) / 110)));
    c.textAlign = 'center'; c.textBaseline = 'top';
    for (var t = Math.ceil(view.x0 / tstep) * tstep; t <= view.x1 + 1e-12; t += tstep) {
      var x = Math.round(this.xOf(t)) + 0.5;
      c.beginPath(); c.moveTo(x, PAD.t); c.lineTo(x, this.h - PAD.b); c.stroke();
      c.fillText(fmtTime(t), x, this.h - PAD.b + 5);
    }
    c.save();
    c.beginPath(); c.rect(PAD.l, PAD.t, this.w - PAD.l - PAD.r, this.h - PAD.t - PAD.b); c.clip();
    var base = this.yOf(0);
    function xr(j) { // pixel span of bucket j: from its first event to the next bucket's
      var x0 = self.xOf(s.t[j]), x1 = j + 1 < s.t.length ? self.xOf(s.t[j + 1]) : self.xOf(s.t2[j]);
      return [x0, Math.max(x1 - x0, 1)];
    }
    var hiEnd = Math.min(b + 1, s.t.length - 1);
    if (s.owners) {
      for (i = a; i <= hiEnd; i++) {
        var r = xr(i), acc = 0;
        for (k = 0; k < s.owners.values.length; k++) {
          var val = Math.max(0, s.owners.values[k][i] || 0);
          if (!val) { continue; }
          c.fillStyle = PALETTE[k % PALETTE.length];
          var y0 = this.yOf(acc), y1 = this.yOf(acc + val);
          c.fillRect(r[0], y1, r[1], y0 - y1);
          acc += val;
        }
      }
    } else {
      c.fillStyle = '#9fbff0';
      for (i = a; i <= hiEnd; i++) { var q = xr(i), yh = this.yOf(s.hi[i]); c.fillRect(q[0], yh, q[1], base - yh); }
    }
    // allocated at the end of each bucket: a step line
    c.strokeStyle = s.owners ? '#101828' : '#2f6fde'; c.lineWidth = 1.2; c.beginPath();
    for (i = a; i <= hiEnd; i++) {
      var p = xr(i), yl = this.yOf(s.last[i]);
      if (i === a) { c.moveTo(p[0], yl); } else { c.lineTo(p[0], yl); }
      c.lineTo(p[0] + p[1], yl);
    }
    c.stroke();
    if (s.total) {
      c.strokeStyle = '#e8590c'; c.lineWidth = 1.4; c.beginPath();
      for (i = a; i <= hiEnd; i++) {
        var pt = xr(i), yt = this.yOf(s.total[i]);
        if (i === a) { c.moveTo(pt[0], yt); } else { c.lineTo(pt[0], yt); }
        c.lineTo(pt[0] + pt[1], yt);
      }
      c.stroke();
    }
    // step boundaries
    c.setLineDash([4, 3]); c.strokeStyle = '#98a2b3'; c.lineWidth = 1; c.fillStyle = '#667085';
    c.textAlign = 'left'; c.textBaseline = 'top';
    var lastLabel = -1e9;
    D.steps.forEach(function (st) {
      if (st.t < view.x0 || st.t > view.x1) { return; }
      var sx = Math.round(self.xOf(st.t)) + 0.5;
      c.beginPath(); c.moveTo(sx, PAD.t); c.lineTo(sx, self.h - PAD.b); c.stroke();
      if (sx - lastLabel > 50) { c.fillText('step ' + st.step, sx + 3, PAD.t + 1); lastLabel = sx; }
    });
    c.setLineDash([]);
    c.restore();
    // marks: small triangles under the top edge
    c.fillStyle = '#7b2cbf';
    D.marks.forEach(function (m) {
      if (m.t < view.x0 || m.t > view.x1) { return; }
      var mx = self.xOf(m.t);
      c.beginPath(); c.moveTo(mx - 4, PAD.t - 8); c.lineTo(mx + 4, PAD.t - 8); c.lineTo(mx, PAD.t - 1); c.closePath(); c.fill();
    });
    // hover crosshair and selection
    if (this.hoverT !== undefined && this.hoverT !== null) {
      var hx = Math.round(this.xOf(this.hoverT)) + 0.5;
      c.strokeStyle = 'rgba(16,24,40,.55)'; c.lineWidth = 1; c.beginPath(); c.moveTo(hx, PAD.t); c.lineTo(hx, this.h - PAD.b); c.stroke();
    }
    if (this.drag && Math.abs(this.drag.x1 - this.drag.x0) > 2) {
      c.fillStyle = 'rgba(47,111,222,.15)';
      c.fillRect(Math.min(this.drag.x0, this.drag.x1), PAD.t, Math.abs(this.drag.x1 - this.drag.x0), this.h - PAD.t - PAD.b);
    }
    c.strokeStyle = '#98a2b3'; c.beginPath(); c.moveTo(PAD.l + 0.5, PAD.t); c.lineTo(PAD.l + 0.5, this.h - PAD.b + 0.5);
    c.lineTo(this.w - PAD.r, this.h - PAD.b + 0.5); c.stroke();
  };
  // the bucket under pixel x: of the buckets sharing that pixel the one with the
  // highest peak (several thousand buckets over a narrower chart), else the
  // nearest one within a few pixels, else -1
  Chart.prototype.bucketAt = function (x) {
    var s = this.s, n = s.t.length, best = -1, bestd = 6, j;
    var a = Math.max(0, floorIndex(s.t, this.tOf(x - 0.5)) - 1), b = Math.min(n - 1, floorIndex(s.t, this.tOf(x + 0.5)) + 1);
    for (j = a; j <= b; j++) {
      var x0 = this.xOf(s.t[j]), x1 = j + 1 < n ? this.xOf(s.t[j + 1]) : this.xOf(s.t2[j]) + 1;
      var d = x < x0 - 0.5 ? x0 - 0.5 - x : x > x1 + 0.5 ? x - x1 - 0.5 : 0;
      if (d < bestd || (d === 0 && bestd === 0 && s.hi[j] > s.hi[best])) { bestd = d; best = j; }
    }
    return best;
  };
  Chart.prototype.markNear = function (x) {
    var best = null, bd = 5, self = this;
    D.marks.forEach(function (m) { var d = Math.abs(self.xOf(m.t) - x); if (d < bd) { bd = d; best = m; } });
    return best;
  };
  Chart.prototype.tipText = function (i, x) {
    var s = this.s, lines = [];
    var frag = document.createDocumentFragment();
    function line(text, cls) { var d = el('div', cls ? { 'class': cls } : null, text); frag.appendChild(d); }
    line('t = ' + fmtTime(s.t[i]) + (s.t2[i] > s.t[i] ? ' … ' + fmtTime(s.t2[i]) : '') + ' · step ' + stepAt(s.t[i]));
    var opname = s.ops[s.op[i]];
    line('op: ' + (opname || '(outside any op)'), 'op');
    line('block: ' + s.blk[i]);
    line('allocated: ' + fmtBytes(s.hi[i]) + (s.lo[i] !== s.hi[i] ? ' (min ' + fmtBytes(s.lo[i]) + ')' : '') +
      (s.total ? ' · reserved ' + fmtBytes(s.total[i]) : ''));
    if (s.owners) {
      s.owners.names.forEach(function (n, k) { var v = s.owners.values[k][i]; if (v) { line('  ' + n + ': ' + fmtBytes(v)); } });
    }
    line(s.n[i] + ' alloc/free event' + (s.n[i] === 1 ? '' : 's') + ' in this bucket');
    var m = this.markNear(x);
    if (m) { line('mark (' + m.kind + '): ' + m.name); }
    lines.push(frag);
    return frag;
  };
  Chart.prototype.local = function (ev) {
    var r = this.canvas.getBoundingClientRect();
    return { x: ev.clientX - r.left, y: ev.clientY - r.top };
  };
  Chart.prototype.attach = function () {
    var self = this, cv = this.canvas;
    cv.addEventListener('mousemove', function (ev) {
      var p = self.local(ev);
      if (self.drag) { self.drag.x1 = p.x; self.draw(); return; }
      var i = self.bucketAt(p.x);
      self.hover = i;
      var t = self.tOf(p.x);
      charts.forEach(function (ch) { ch.hoverT = t; ch.draw(); });
      if (i < 0 || p.x < PAD.l || p.x > self.w - PAD.r) { tip.hidden = true; return; }
      tip.textContent = '';
      tip.appendChild(self.tipText(i, p.x));
      tip.hidden = false;
      var tx = ev.clientX + 14, ty = ev.clientY + 14, tw = tip.offsetWidth, th = tip.offsetHeight;
      if (tx + tw > window.innerWidth - 4) { tx = Math.max(4, ev.clientX - tw - 14); }
      if (ty + th > window.innerHeight - 4) { ty = Math.max(4, ev.clientY - th - 14); }
      tip.style.left = tx + 'px'; tip.style.top = ty + 'px';
    });
    cv.addEventListener('mouseleave', function () {
      tip.hidden = true; self.hover = -1;
      charts.forEach(function (ch) { ch.hoverT = null; ch.draw(); });
    });
    cv.addEventListener('mousedown', function (ev) {
      if (ev.button !== 0) { return; }
      var p = self.local(ev); self.drag = { x0: p.x, x1: p.x };
    });
    window.addEventListener('mouseup', function () {
      if (!self.drag) { return; }
      var d = self.drag; self.drag = null;
      if (Math.abs(d.x1 - d.x0) > 5) { zoomTo(self.tOf(Math.min(d.x0, d.x1)), self.tOf(Math.max(d.x0, d.x1))); } else { self.draw(); }
    });
    cv.addEventListener('dblclick', function () { zoomTo(full.x0, full.x1); });
    cv.addEventListener('wheel', function (ev) {
      ev.preventDefault();
      var p = self.local(ev);
      zoomAround(self.tOf(p.x), ev.deltaY < 0 ? 1 / 1.25 : 1.25);
    }, { passive: false });
  };

  function zoomTo(a, b) {
    var minSpan = (full.x1 - full.x0) / 1e6;
    if (b - a < minSpan) { var m = (a + b) / 2; a = m - minSpan / 2; b = m + minSpan / 2; }
    view.x0 = Math.max(full.x0, a); view.x1 = Math.min(full.x1, b);
    if (view.x1 <= view.x0) { view.x0 = full.x0; view.x1 = full.x1; }
    redraw();
  }
  function zoomAround(t, f) { zoomTo(t - (t - view.x0) * f, t + (view.x1 - t) * f); }
  function redraw() { charts.forEach(function (ch) { ch.draw(); }); }

  // ------------------------------------------------------------ tables
  function isNum(v) { return typeof v === 'number'; }
  function renderTable(tb) {
    var box = document.getElementById('tables');
    box.appendChild(el('h2', null, tb.title));
    if (tb.note) { box.appendChild(el('div', { 'class': 'note' }, tb.note)); }
    if (!tb.rows.length) { box.appendChild(el('p', { 'class': 'note' }, 'nothing to show')); return; }
    var wrap = el('div', { 'class': 'tablewrap' }), table = el('table'), thead = el('thead'), tr = el('tr'), tbody = el('tbody');
    var rows = tb.rows.slice(), dir = {};
    tb.columns.forEach(function (name, ci) {
      var th = el('th', { title: 'sort' }, name);
      th.addEventListener('click', function () {
        dir[ci] = -(dir[ci] || -1);
        rows.sort(function (x, y) {
          var a = x[ci], b = y[ci];
          if (a === b) { return 0; }
          if (a === null || a === undefined) { return 1; }
          if (b === null || b === undefined) { return -1; }
          return (isNum(a) && isNum(b) ? a - b : String(a).localeCompare(String(b))) * dir[ci];
        });
        fill();
      });
      tr.appendChild(th);
    });
    thead.appendChild(tr); table.appendChild(thead); table.appendChild(tbody);
    function fill() {
      tbody.textContent = '';
      rows.forEach(function (r) {
        var row = el('tr');
        r.forEach(function (v, ci) {
          var text = v === null || v === undefined ? '' : (tb.fmt[String(ci)] === 'bytes' && isNum(v) ? fmtBytes(v) : (isNum(v) ? v.toLocaleString() : String(v)));
          var td = el('td', isNum(v) ? { 'class': 'num', title: String(v) } : null, text);
          row.appendChild(td);
        });
        tbody.appendChild(row);
      });
    }
    fill();
    wrap.appendChild(table); box.appendChild(wrap);
    if (tb.more) { box.appendChild(el('div', { 'class': 'note' }, tb.more + ' more rows not shown')); }
  }

  // ------------------------------------------------------------ start
  overview();
  if (!D.series.length) {
    document.getElementById('charts').appendChild(el('p', { 'class': 'note' }, 'The dump holds no MALLOC/FREE rows: no memory to draw.'));
  }
  D.series.forEach(function (s, i) { charts.push(new Chart(s, i)); });
  D.tables.forEach(renderTable);
  document.getElementById('zoom-in').addEventListener('click', function () { zoomAround((view.x0 + view.x1) / 2, 1 / 1.5); });
  document.getElementById('zoom-out').addEventListener('click', function () { zoomAround((view.x0 + view.x1) / 2, 1.5); });
  document.getElementById('zoom-reset').addEventListener('click', function () { zoomTo(full.x0, full.x1); });
  var pending = false;
  window.addEventListener('resize', function () {
    if (pending) { return; }
    pending = true;
    window.requestAnimationFrame(function () { pending = false; redraw(); });
  });
  redraw();
  document.body.setAttribute('data-ready', '1');
  // for tests and the curious: where a bucket sits on the page
  window.msmemscope = {
    data: D, view: view, zoomTo: zoomTo,
    pointOf: function (chart, bucket) {
      var ch = charts[chart], r = ch.canvas.getBoundingClientRect(), s = ch.s;
      var x0 = ch.xOf(s.t[bucket]), x1 = bucket + 1 < s.t.length ? ch.xOf(s.t[bucket + 1]) : ch.xOf(s.t2[bucket]) + 1;
      return { x: Math.round(r.left + (x0 + Math.min(x1, x0 + 4)) / 2), y: Math.round(r.top + ch.yOf(s.hi[bucket] / 2)) };
    },
    chartRect: function (chart) {
      var r = charts[chart].canvas.getBoundingClientRect();
      return { left: r.left + PAD.l, top: r.top + PAD.t, right: r.right - PAD.r, bottom: r.bottom - PAD.b };
    }
  };
}());
