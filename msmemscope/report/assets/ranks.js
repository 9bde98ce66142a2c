// msmemscope rank root page: the ranks of one job side by side (#ranks), each rank's
// memory over time (#timeline), links to each rank's own report. Charts: Apache ECharts.
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('report-data').textContent);
  var E = window.echarts;
  var PALETTE = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#edc948', '#b07aa1', '#ff9da7', '#9c755f', '#bab0ac'];
  var M = window.msmemscope = { data: D };

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) { Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); }); }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function add(p) { for (var i = 1; i < arguments.length; i++) { if (arguments[i]) { p.appendChild(arguments[i]); } } return p; }
  function fmtBytes(n) {
    if (n === null || n === undefined) { return 'n/a'; }
    var u = ['B', 'KB', 'MB', 'GB', 'TB'], i = 0, v = Math.abs(n);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (n < 0 ? '-' : '') + (i === 0 ? v.toFixed(0) : v.toFixed(2)) + ' ' + u[i];
  }
  function fmtUs(us) { var ms = us / 1000; return Math.abs(ms) >= 1000 ? (ms / 1000).toFixed(2) + ' s' : ms.toFixed(1) + ' ms'; }
  function undelta(a) { var out = [], s = 0; for (var i = 0; i < a.length; i++) { s += a[i]; out.push(s); } return out; }
  function section(id, title, note) {
    var s = el('section', { id: id });
    add(s, el('h2', null, title));
    if (note) { add(s, el('div', { 'class': 'note' }, note)); }
    document.getElementById('app').appendChild(s);
    add(document.getElementById('nav'), el('a', { href: '#' + id }, title));
    return s;
  }

  document.getElementById('meta').textContent = 'root: ' + D.root + ' · generated ' + D.generated;
  var out = D.outlier;
  var sec = section('ranks', 'Ranks', 'each rank\'s peak allocated memory; the rank furthest from the median is the outlier');
  var ul = el('ul', { 'class': 'findings' });
  if (out) {
    var pct = (out.pct >= 0 ? '+' : '') + out.pct.toFixed(1) + '%';
    add(ul, add(el('li', { 'class': out.flagged ? 'k-leak' : 'k-ok', id: 'outlier' }),
      el('span', null, (out.flagged ? 'Outlier: ' : 'Balanced: furthest from the median is ') + out.label + ', peak ' + fmtBytes(out.peak) +
        ', ' + pct + ' from the median peak ' + fmtBytes(out.median) + '.')));
  }
  (D.verdict || []).forEach(function (line) { add(ul, add(el('li', { 'class': /^leaking: (?!no rank)/.test(line) ? 'k-leak' : 'k-peak' }), el('span', null, line))); });
  add(sec, ul);
  var bars = el('div', { 'class': 'echart', id: 'ranks-chart' });
  add(sec, bars);
  var t = el('table', { id: 'ranks-table' }), head = el('tr');
  ['rank', 'host', 'device · pool', 'peak allocated', 'peak step', 'vs median', 'events', 'steps', 'findings', 'report'].forEach(function (c) { head.appendChild(el('th', null, c)); });
  add(t, add(el('thead'), head));
  var body = el('tbody');
  D.ranks.forEach(function (r) {
    var tr = el('tr', out && out.flagged && r.label === out.label ? { 'class': 'outlier' } : null);
    var vs = out ? r.peak - out.median : null;
    [r.label, r.host || '', (r.device || '') + ' · ' + (r.pool || ''), r.error ? '' : fmtBytes(r.peak), r.peak_step, vs === null || r.error ? '' : (vs >= 0 ? '+' : '') + fmtBytes(vs),
      r.events.toLocaleString(), r.steps, r.findings.join(' ')].forEach(function (v) { tr.appendChild(el('td', null, v)); });
    var td = el('td');
    if (r.href) { add(td, el('a', { href: r.href, 'class': 'rank-link' }, 'open')); } else { td.textContent = 'not readable'; }
    tr.appendChild(td);
    body.appendChild(tr);
  });
  t.appendChild(body);
  add(sec, add(el('div', { 'class': 'tablewrap' }), t));

  var chart = E.init(bars);
  chart.setOption({ animation: false, tooltip: { trigger: 'axis', valueFormatter: fmtBytes },
    grid: { left: 80, right: 20, top: 20, bottom: 40 },
    xAxis: { type: 'category', data: D.ranks.map(function (r) { return r.label; }) },
    yAxis: { type: 'value', axisLabel: { formatter: fmtBytes } },
    series: [{ type: 'bar', name: 'peak allocated', data: D.ranks.map(function (r) {
      return { value: r.peak, itemStyle: { color: out && out.flagged && r.label === out.label ? '#d92d20' : '#4e79a7' } };
    }), markLine: out ? { symbol: 'none', data: [{ yAxis: out.median, name: 'median' }], label: { formatter: 'median' } } : undefined }] });
  chart.on('click', function (p) { var r = D.ranks[p.dataIndex]; if (r && r.href) { location.href = r.href; } });

  var tsec = section('timeline', 'Memory over time, every rank', 'allocated memory of each rank\'s main pool (the peak of each time bucket); ' +
    'x in steps lines the ranks up step for step, x in time shows each from its first event');
  var bar = el('div', { 'class': 'toolbar' }), axisSel = el('select', { id: 'ranks-axis' });
  var bySteps = D.ranks.some(function (r) { return r.progress && r.progress.length; });
  if (bySteps) { axisSel.appendChild(el('option', { value: 'step' }, 'x: steps')); }
  axisSel.appendChild(el('option', { value: 'time' }, 'x: time'));
  add(bar, axisSel); add(tsec, bar);
  var tdiv = el('div', { 'class': 'echart', id: 'ranks-timeline' });
  add(tsec, tdiv);
  var tchart = E.init(tdiv);
  function drawRanks() {
    var steps = axisSel.value === 'step';
    tchart.setOption({ animation: false, legend: { top: 0, type: 'scroll' }, tooltip: { trigger: 'axis', valueFormatter: fmtBytes },
      grid: { left: 80, right: 20, top: 30, bottom: 60 },
      xAxis: { type: 'value', name: steps ? 'step' : '', axisLabel: { formatter: function (v) { return steps ? String(v) : fmtUs(v * 1000); } } },
      yAxis: { type: 'value', axisLabel: { formatter: fmtBytes } },
      dataZoom: [{ type: 'inside', filterMode: 'none' }, { type: 'slider', filterMode: 'none', height: 20, bottom: 8 }],
      series: D.ranks.map(function (r, i) {
        var T = undelta(r.t), H = undelta(r.hi), X = steps ? r.progress : T.map(function (x) { return x / 1000; });
        return { name: r.label, type: 'line', step: 'end', symbol: 'none', lineStyle: { width: 1.5, color: PALETTE[i % PALETTE.length] },
          itemStyle: { color: PALETTE[i % PALETTE.length] }, data: H.map(function (h, k) { return [X[k], h]; }) };
      }) }, true);
  }
  axisSel.addEventListener('change', drawRanks);
  drawRanks();
  window.addEventListener('resize', function () { chart.resize(); tchart.resize(); });
  if (location.hash) { var h = document.getElementById(location.hash.slice(1)); if (h) { h.scrollIntoView(); } }
  M.chart = chart; M.timeline = tchart;
  document.body.setAttribute('data-ready', '1');
})();
