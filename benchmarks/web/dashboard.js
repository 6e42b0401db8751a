// Draws the dashboard's charts with Chart.js (inlined before this script)
// from the JSON model that dashboard.py embeds in #dashboard-data, and
// records on each <figure> what it drew (data-rendered-series,
// data-rendered-points, data-painted-pixels) for the browser test.
(function () {
  'use strict';
  var model = JSON.parse(document.getElementById('dashboard-data').textContent);
  var PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd',
                 '#8c564b', '#e377c2', '#17becf', '#7f7f7f', '#bcbd22'];
  var RUN_DASH = [[], [7, 4], [2, 3], [10, 3, 2, 3]];
  var charts = {};  // figure id -> Chart

  function formatNumber(v) {
    var a = Math.abs(v);
    if (a >= 1000) return Math.round(v).toLocaleString('en-US');
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a === 0) return '0';
    return String(Number(v.toPrecision(3)));
  }

  // unit: [unit, divisor] from the model (results.metric_info), e.g.
  // ['MiB', 1048576] for byte counts.
  function formatValue(metric, v, unit) {
    if (v === null || v === undefined || !isFinite(v)) return '-';
    if (metric === 'seconds' || /_seconds$/.test(metric)) {
      var a = Math.abs(v);
      if (a >= 1 || a === 0) return formatNumber(v) + ' s';
      if (a >= 1e-3) return formatNumber(v * 1e3) + ' ms';
      if (a >= 1e-6) return formatNumber(v * 1e6) + ' µs';
      return formatNumber(v * 1e9) + ' ns';
    }
    if (unit && unit[0] === 'MiB') return formatNumber(v / unit[1]) + ' MiB';
    return formatNumber(unit ? v / unit[1] : v);
  }

  function withAlpha(hex, alpha) {
    var n = parseInt(hex.slice(1), 16);
    return 'rgba(' + ((n >> 16) & 255) + ',' + ((n >> 8) & 255) + ',' +
        (n & 255) + ',' + alpha + ')';
  }

  function datasets(chart, metric) {
    var m = chart.by_metric[metric];
    if (!m) return [];
    var groups = [];
    var runs = [];
    return m.series.map(function (s) {
      if (groups.indexOf(s.group) < 0) groups.push(s.group);
      if (runs.indexOf(s.run) < 0) runs.push(s.run);
      var run = runs.indexOf(s.run);
      var color = s.ceiling ? (run === 0 ? '#222222' : '#999999') :
          PALETTE[groups.indexOf(s.group) % PALETTE.length];
      var ds = {
        label: s.label,
        data: s.data,
        rsd: s.rsd,
        borderColor: color,
        backgroundColor: chart.kind === 'bar' ?
            withAlpha(color, run === 0 ? 0.75 : 0.35) : color,
        borderWidth: chart.kind === 'bar' ? 1 : 2,
      };
      if (chart.kind === 'line') {
        ds.borderDash = s.ceiling ? [8, 4] : RUN_DASH[run % RUN_DASH.length];
        ds.pointRadius = 3;
        ds.spanGaps = false;
        ds.fill = false;
      }
      return ds;
    });
  }

  function record(figure, chart, metric) {
    var series = 0;
    var points = 0;
    var area = chart.chartArea;
    chart.data.datasets.forEach(function (ds, i) {
      if (!chart.isDatasetVisible(i)) return;
      series++;
      chart.getDatasetMeta(i).data.forEach(function (el, j) {
        if (el.skip || ds.data[j] === null) return;
        var x = el.x;
        var y = el.y;
        // a bar must have a visible height (not sit on the axis' bottom)
        var tall = chart.config.type !== 'bar' ||
            Math.abs(el.base - y) >= 1;
        if (isFinite(x) && isFinite(y) && x >= area.left - 1 &&
            x <= area.right + 1 && y >= area.top - 1 &&
            y <= area.bottom + 1 && tall) {
          points++;
        }
      });
    });
    var painted = 0;
    var canvas = chart.canvas;
    var pixels = chart.ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    for (var k = 3; k < pixels.length; k += 4) {
      if (pixels[k] !== 0) painted++;
    }
    figure.setAttribute('data-metric', metric);
    figure.setAttribute('data-rendered-series', String(series));
    figure.setAttribute('data-rendered-points', String(points));
    figure.setAttribute('data-painted-pixels', String(painted));
    // the labelled ticks of the value axis, bottom to top
    var ticks = chart.scales.y.ticks.map(function (t) {
      return t.label;
    }).filter(function (l) { return l !== ''; });
    figure.setAttribute('data-y-ticks', ticks.join('|'));
  }

  function draw(suite, chart, metric) {
    var figure = document.getElementById(chart.id);
    var caption = figure.querySelector('figcaption');
    if (charts[chart.id]) {
      charts[chart.id].destroy();
      delete charts[chart.id];
    }
    var m = chart.by_metric[metric];
    if (!m) {
      caption.textContent = chart.title + ': no ' + metric + ' here';
      figure.setAttribute('data-metric', metric);
      figure.setAttribute('data-rendered-series', '0');
      figure.setAttribute('data-rendered-points', '0');
      return;
    }
    var errors = [];
    m.series.forEach(function (s) {
      s.errors.forEach(function (e) { errors.push(e); });
    });
    // the ratios to the reference series (chain: imgtool / qemu-img) in
    // the caption's colour, failed configurations after them in red
    caption.textContent = m.ratios || '';
    if (errors.length) {
      var failed = document.createElement('span');
      failed.className = 'failed';
      failed.textContent = (m.ratios ? '. ' : '') + 'Failed configurations: ' +
          errors.join('; ');
      caption.appendChild(failed);
    }
    var title = suite.metric_titles[metric];
    var unit = suite.metric_units[metric];
    var canvas = figure.querySelector('canvas');
    charts[chart.id] = new Chart(canvas, {
      type: chart.kind,
      data: {labels: chart.labels, datasets: datasets(chart, metric)},
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        interaction: {mode: 'nearest', intersect: false},
        plugins: {
          title: {display: true, text: chart.title + ' — ' + title},
          // lines: the legend shows each line's colour and dash pattern
          legend: {
            position: 'bottom',
            labels: chart.kind === 'line' ?
                {usePointStyle: true, pointStyle: 'line', pointStyleWidth: 36} :
                {},
          },
          tooltip: {
            callbacks: {
              label: function (ctx) {
                var rsd = ctx.dataset.rsd[ctx.dataIndex];
                return ctx.dataset.label + ': ' +
                    formatValue(metric, ctx.parsed.y, unit) +
                    (rsd === null ? '' : ' ± ' + rsd + '%');
              },
            },
          },
        },
        scales: {
          x: {title: {display: true, text: chart.x_title}},
          y: {
            type: m.log ? 'logarithmic' : 'linear',
            beginAtZero: !m.log,
            min: m.log ? m.y_min : undefined,
            title: {display: true, text: title},
            ticks: {
              callback: function (v) {
                if (m.log) {
                  // label only 1, 2 and 5 times a power of ten
                  var mant = v / Math.pow(10, Math.floor(Math.log10(v)));
                  if ([1, 2, 5].indexOf(Math.round(mant * 1000) / 1000) < 0) {
                    return '';
                  }
                }
                // axis labels: `10 ms`, not `10.0 ms`
                return formatValue(metric, v, unit).replace(/\.0(?= |$)/, '');
              },
            },
          },
        },
      },
    });
    record(figure, charts[chart.id], metric);
  }

  function drawSuite(suite, metric) {
    suite.charts.forEach(function (chart) {
      var chosen = metric || chart.default_metric;
      draw(suite, chart, chosen);
    });
    if (metric) {
      // the comparison tables of the chosen metric only
      var section = document.getElementById('suite-' + suite.suite);
      section.querySelectorAll('table.cmp').forEach(function (table) {
        table.hidden = table.getAttribute('data-metric') !== metric;
      });
    }
  }

  model.suites.forEach(function (suite) {
    try {
      drawSuite(suite, null);
    } catch (e) {
      window.dashboardRecordError('drawing ' + suite.suite + ': ' + e);
    }
  });
  document.querySelectorAll('select.metric').forEach(function (select) {
    select.addEventListener('change', function () {
      model.suites.forEach(function (suite) {
        if (suite.suite === select.getAttribute('data-suite')) {
          drawSuite(suite, select.value);
        }
      });
    });
  });
  document.body.setAttribute('data-status', 'rendered');
})();
