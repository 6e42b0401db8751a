"""Writes a self-contained static HTML dashboard of benchmark results.

  bazel run //benchmarks:dashboard -- RESULTS... --out DIR [--by run|KEY]

RESULTS are Google Benchmark JSON files written by //benchmarks:run (or
directories holding them); see benchmarks/README.md, "Result files".
DIR/index.html opens from disk with no server and no network: Chart.js
(installed by tools/setup.sh with `npm ci` in benchmarks/web) and the page
script are inlined. The page has one section per suite: its chart(s) (lines
of IOPS over cluster size with and without subclusters, bars for the hint
and preallocation variants, queue depth curves for the io engines with fio
as the ceiling), the comparison tables of //benchmarks:report, and the
machine context of every result file.

For the browser test the page records what it drew: each chart's <figure>
gets data-rendered-series / data-rendered-points next to the
data-expected-series / data-expected-points computed here, every script
error lands in <ul id="errors">, and <body data-status> becomes
"rendered" when all charts are drawn.

Chart.js is found at (first that exists): --chartjs FILE, $IMGTOOL_CHARTJS,
$BUILD_WORKSPACE_DIRECTORY/benchmarks/web/node_modules/..., and
node_modules beside the real path of benchmarks/web/package-lock.json (a
data dependency, so this works under `bazel test` and from a checkout).
"""

import argparse
import datetime
import html
import json
import math
import os
import sys

from benchmarks import results

_HERE = os.path.dirname(os.path.abspath(__file__))
_WEB = os.path.join(_HERE, "web")
_CHARTJS = os.path.join("node_modules", "chart.js", "dist", "chart.umd.js")

# How each suite is drawn (keys from benchmarks/README.md "Result files"):
# x: the key on the x axis; facet: one chart per value of this key, or per
# combination of values of a list of keys (keys with one value in the runs
# are dropped from it); metric: the metric shown first; ceiling: (key,
# value) of the series drawn as a dashed ceiling line.
SUITE_CHARTS = {
    "subcluster": {"kind": "line", "x": "cluster", "metric": "IOPS",
                   "x_title": "cluster size"},
    # one chart per filesystem and op (issue 20 part 1: XFS and ext4)
    "engine": {"kind": "line", "x": "depth", "facet": ["fs", "op"],
               "metric": "IOPS", "ceiling": ("tool", "fio"),
               "x_title": "queue depth"},
    "hint": {"kind": "bar", "x": "hint", "facet": "op", "metric": "seconds",
             "x_title": "extent size hint"},
    "create_prealloc": {"kind": "bar", "x": "prealloc", "facet": "fmt",
                        "metric": "seconds", "x_title": "preallocation"},
    "prealloc_filter": {"kind": "bar", "x": "write", "metric": "MiB_per_s",
                        "x_title": "write pattern"},
    # ratio: (key, value) of the reference series; the caption gives every
    # other series' ratio to it per bar (issue 16's targets: imgtool's
    # time and peak RSS against qemu-img's)
    "chain": {"kind": "bar", "x": "case", "metric": "seconds",
              "x_title": "command", "ratio": ("tool", "qemu-img")},
    # issue 18: snapshot -c/-d, writes after a snapshot, bitmap cost; its
    # targets (results.SUITE_TARGETS) are listed under the chart
    "snapshot": {"kind": "bar", "x": "case", "metric": "seconds",
                 "x_title": "case", "ratio": ("tool", "qemu-img")},
    # issue 19: one chart per part (server: fio against qemu-nbd and imgtool
    # nbd; local: imgtool bench; copy: nbdcopy, qemu-img and imgtool
    # convert out of either server); ratios to qemu-nbd, or to nbdcopy
    "nbd": {"kind": "bar", "x": "case", "facet": "part", "metric": "IOPS",
            "x_title": "case",
            "ratio": [("tool", "qemu-nbd"), ("tool", "nbdcopy")]},
    # the side-by-side scripts (sbs_results.py): bars per tool, the caption
    # giving each bar's ratio to qemu-img's (and to fio's, the ceiling,
    # where a script measures it) with the U test of the repetitions
    "side_by_side": {"kind": "bar", "x": "case", "metric": "IOPS",
                     "x_title": "case",
                     "ratio": [("tool", "qemu-img"), ("tool", "fio")]},
    "subcluster_side_by_side": {"kind": "bar", "x": "cluster",
                                "facet": "extended_l2", "metric": "IOPS",
                                "x_title": "cluster size",
                                "ratio": [("tool", "qemu-img"),
                                          ("tool", "fio")]},
    "prealloc_side_by_side": {"kind": "bar", "x": "write", "facet": "fs",
                              "metric": "IOPS", "x_title": "write pattern",
                              "ratio": ("tool", "qemu-img")},
    "chain_side_by_side": {"kind": "bar", "x": "case", "metric": "seconds",
                           "x_title": "command",
                           "ratio": ("tool", "qemu-img")},
    # issue 20 part 2: one run's time from process start to exit
    "startup_side_by_side": {"kind": "bar", "x": "cmd", "metric": "seconds",
                             "x_title": "command",
                             "ratio": ("tool", "qemu-img")},
    # issue 20 part 4: `imgtool advise --output=json`, one chart per
    # workload (the create table's charts show seconds and space)
    "advise": {"kind": "bar", "x": "config", "facet": "workload",
               "metric": "IOPS", "x_title": "configuration"},
    # issue 20 part 1: IOPS over queue depth per case, one line per tool
    # and engine, fio's engines dashed (the ceiling is the best of them);
    # the caption gives imgtool's ratio to qemu-img's same engine
    "reqcost_side_by_side": {"kind": "line", "x": "depth", "facet": "case",
                             "metric": "IOPS", "x_title": "queue depth",
                             "ceiling": ("tool", "fio"),
                             "ratio": ("tool", "qemu-img")},
}

# Shown first in the context table, then the others in file order.
_CONTEXT_FIRST = ["suite", "machine", "host_name", "imgtool_commit", "date",
                  "kernel", "filesystems", "filesystem", "build",
                  "library_build_type", "quick", "num_cpus", "mhz_per_cpu",
                  "load_avg_start", "load_avg"]


class DashboardError(Exception):
    """A problem that stops the page from being written."""


def find_chartjs(explicit=None):
    """Path of chart.umd.js, or DashboardError naming where it looked."""
    given = explicit or os.environ.get("IMGTOOL_CHARTJS")
    if given:
        if not os.path.isfile(given):
            raise DashboardError("%s: Chart.js file not found" % given)
        return given
    candidates = []
    ws = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if ws:
        candidates.append(os.path.join(ws, "benchmarks", "web", _CHARTJS))
    lock = os.path.join(_WEB, "package-lock.json")
    if os.path.exists(lock):
        beside = os.path.join(os.path.dirname(os.path.realpath(lock)),
                              _CHARTJS)
        if beside not in candidates:
            candidates.append(beside)
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise DashboardError(
        "Chart.js not found (looked at %s): run tools/setup.sh, or `npm ci` "
        "in benchmarks/web" % ", ".join(candidates or ["nothing"]))


def _finite(x):
    return x is not None and not (isinstance(x, float) and
                                  (math.isnan(x) or math.isinf(x)))


def _chart_spec(suite, runs):
    spec = dict(SUITE_CHARTS.get(suite, {"kind": "bar"}))
    keys = results.config_keys(runs)
    const = set(k for k, _ in results.constant_keys(runs))
    if spec.get("x") not in keys:
        varying = [k for k in keys if k not in const]
        spec["x"] = varying[-1] if varying else (keys[-1] if keys else None)
        spec["x_title"] = spec["x"] or ""
    facet = spec.get("facet")
    facet = [facet] if isinstance(facet, str) else list(facet or [])
    # keys with one value (or none) split nothing: one chart for them
    spec["facet"] = [k for k in facet
                     if k in keys and k != spec["x"] and k not in const]
    return spec


def _facet_value(case, keys):
    """The case's values of the facet keys, a tuple (one chart each)."""
    return tuple(case.value(k) for k in keys)


def _series_for(cases_by_run, spec, labels, metric, skip, multi_run):
    """Series of one chart: one per (run, other keys) combination."""
    series = []
    x_key = spec["x"]
    ceiling = spec.get("ceiling")
    for run, cases in cases_by_run:
        groups = []
        by_group = {}
        for case in cases:
            rest = [kv for kv in case.config if kv[0] not in skip and
                    kv[0] != x_key]
            label = results.config_label(rest) if rest else spec.get(
                "suite", "")
            if label not in by_group:
                by_group[label] = {"rest": rest, "cases": {}}
                groups.append(label)
            by_group[label]["cases"][case.value(x_key)] = case
        for label in groups:
            g = by_group[label]
            data, rsd, errors, cases = [], [], [], []
            for raw_x in labels:
                case = g["cases"].get(raw_x)
                cases.append(case)
                stat = case.metrics.get(metric) if case else None
                if case is not None and case.error is not None:
                    errors.append("%s%s: %s" % (
                        run.letter + ": " if multi_run else "",
                        results.config_label(case.config), case.error))
                if stat is None or not _finite(stat.mean):
                    data.append(None)
                    rsd.append(None)
                else:
                    data.append(stat.mean)
                    r = stat.rsd_percent()
                    rsd.append(round(r, 1) if r is not None and _finite(r)
                               else None)
            if all(d is None for d in data) and not errors:
                continue
            is_ceiling = bool(ceiling) and dict(g["rest"]).get(
                ceiling[0]) == ceiling[1]
            name = label if label != "(all)" else metric
            if is_ceiling:
                name += " (ceiling)"
            if multi_run:
                name = "%s: %s" % (run.letter, name)
            series.append({"label": name, "data": data, "rsd": rsd,
                           "ceiling": is_ceiling, "run": run.letter,
                           "group": label, "errors": errors,
                           # for _ratio_text's U tests; not in the page
                           "_cases": cases})
    return series


def _ratio_text(series, labels, reference, metric):
    """`imgtool / qemu-img: rebase 0.76 (p=0.0079 significant), commit
    0.78 (p=0.42 not significant)` for each series that is not the
    reference (a series whose group has key=value), per run; each ratio
    with the U test of the bar's repetitions against the reference bar's
    (results.utest), or once at the end `(U test: too few repetitions, 2
    vs 2)` when no bar has enough. Empty without a reference series.
    `reference` may be a list of such (key, value) pairs: each one present
    is a reference."""
    if isinstance(reference, list):
        return "; ".join(t for t in (_ratio_text(series, labels, r, metric)
                                     for r in reference) if t)
    key, value = reference
    ref_part = "%s:%s" % (key, value)

    def others(group):
        # the series' other labels: a bar is compared with the reference
        # of the same other labels (prealloc_side_by_side: filter:on's
        # imgtool with filter:on's qemu-img)
        return [p for p in group.split("/") if p.partition(":")[0] != key]
    parts = []
    for ref in series:
        if ref_part not in ref["group"].split("/"):
            continue
        for s in series:
            if (s is ref or s["run"] != ref["run"] or
                    others(s["group"]) != others(ref["group"])):
                continue
            cells, tests = [], []
            for label, a, b, ca, cb in zip(labels, s["data"], ref["data"],
                                           s["_cases"], ref["_cases"]):
                if a is not None and b:
                    cells.append("%s %.2f" % (label, a / b))
                    tests.append(results.utest(cb, ca, metric))
            if not cells:
                continue
            if any(u.p is not None for u in tests):
                cells = ["%s (%s)" % (c, u.text())
                         for c, u in zip(cells, tests)]
                text = ", ".join(cells)
            else:
                pairs = sorted(set((u.n1, u.n2) for u in tests))
                text = "%s (U test: too few repetitions, %s)" % (
                    ", ".join(cells), ", ".join("%d vs %d" % p
                                                for p in pairs))
            parts.append("%s / %s: %s" % (s["label"], ref["label"], text))
    return "; ".join(parts)


def _has_value(runs, metric):
    return any(_finite(c.metrics[metric].mean) for r in runs
               for c in r.cases if metric in c.metrics)


def _log_scale(series, kind):
    vals = [v for s in series for v in s["data"] if v is not None]
    if not vals or min(vals) <= 0:
        return False
    return max(vals) / min(vals) >= 50


def _log_min(series):
    """Bottom of a logarithmic axis: the power of ten below the smallest
    value, strictly (a bar starts at the axis' bottom, so a bar whose value
    is the bottom would have no height and look missing)."""
    low = min(v for s in series for v in s["data"] if v is not None)
    bottom = 10.0 ** math.floor(math.log10(low))
    if bottom >= low * 0.999:
        bottom /= 10.0
    return bottom


def build_model(suites):
    """The page's data: per suite its charts (per metric) and metadata."""
    model = {"suites": []}
    for suite, runs in suites:
        spec = _chart_spec(suite, runs)
        spec["suite"] = suite
        const = results.constant_keys(runs)
        skip = set(k for k, _ in const)
        skip.update(spec["facet"])
        metrics = results.run_metrics(runs)
        # the suite's metric, unless no chart can draw it (no finite
        # value, e.g. every IOPS NaN): then the first one a chart can draw,
        # so that the selector names what the charts show
        drawable = [m for m in metrics if _has_value(runs, m)]
        default = spec.get("metric") if spec.get("metric") in drawable else (
            drawable[0] if drawable else (metrics[0] if metrics else None))
        facets = [None]
        if spec["facet"]:
            facets = []
            for run in runs:
                for case in run.cases:
                    v = _facet_value(case, spec["facet"])
                    if v not in facets:
                        facets.append(v)
        charts = []
        for facet in facets:
            cases_by_run = []
            x_values = []
            for run in runs:
                cases = [c for c in run.cases
                         if facet is None or
                         _facet_value(c, spec["facet"]) == facet]
                cases_by_run.append((run, cases))
                for c in cases:
                    v = c.value(spec["x"])
                    if v is not None and v not in x_values:
                        x_values.append(v)
            x_values = results.sort_values(x_values)
            by_metric = {}
            for m in metrics:
                series = _series_for(cases_by_run, spec, x_values, m, skip,
                                     len(runs) > 1)
                if series:
                    log = _log_scale(series, spec["kind"])
                    by_metric[m] = {"series": series, "log": log}
                    if log:
                        by_metric[m]["y_min"] = _log_min(series)
                    if spec.get("ratio"):
                        by_metric[m]["ratios"] = _ratio_text(
                            series, [results.human_value(spec["x"], v)
                                     for v in x_values], spec["ratio"], m)
                    for s in series:
                        del s["_cases"]
            title = suite if facet is None else "%s: %s" % (
                suite, "/".join("%s:%s" % kv
                                for kv in zip(spec["facet"], facet)))
            chart_default = default if default in by_metric else (
                next(iter(by_metric)) if by_metric else None)
            cid = "chart-" + suite + ("" if facet is None else "".join(
                "-%s" % v for v in facet))
            charts.append({
                "id": cid, "title": title, "kind": spec["kind"],
                "x_key": spec["x"], "x_title": spec.get("x_title", spec["x"]),
                "labels": [results.human_value(spec["x"], v)
                           for v in x_values],
                "default_metric": chart_default,
                "by_metric": by_metric,
            })
        model["suites"].append({
            "suite": suite,
            "metrics": metrics,
            "metric_titles": {m: results.metric_title(m) for m in metrics},
            # [unit, divisor]: the page shows values as report does
            "metric_units": {m: list(results.metric_info(m)[:2])
                             for m in metrics},
            "default_metric": default,
            "charts": charts,
        })
    return model


def expected_counts(chart):
    """(series, points) the default metric of a chart should draw."""
    m = chart["by_metric"].get(chart["default_metric"])
    if not m:
        return 0, 0
    series = m["series"]
    return len(series), sum(1 for s in series for v in s["data"]
                            if v is not None)


def _esc(s):
    return html.escape(str(s), quote=True)


def _table_html(t, shown):
    """A comparison table; hidden unless `shown` (the page shows the tables
    of the metric the suite's selector has chosen)."""
    _, _, higher = results.metric_info(t.metric)
    out = ['<table class="cmp" data-metric="%s"%s><caption>%s' % (
        _esc(t.metric), "" if shown else " hidden", _esc(t.title))]
    for line in t.legend:
        out.append('<div class="legend">%s</div>' % _esc(line))
    out.append('</caption><thead><tr><th></th>')
    out.extend("<th>%s</th>" % _esc(c) for c in t.columns)
    out.append("</tr></thead><tbody>")
    decided = results.utest_decided(t)
    for label, cells, diffs, tests in t.rows:
        out.append('<tr><th class="case">%s</th>' % _esc(label))
        for c in cells:
            cls = ' class="error"' if c == "ERROR" else ""
            out.append("<td%s>%s</td>" % (cls, _esc(c if c is not None
                                                     else "-")))
        out.append("</tr>")
        if any(d is not None for d in diffs):
            out.append('<tr class="diff"><th></th>')
            for d, u in zip(diffs, tests):
                cls = []
                up = bool(d) and d.startswith("+") and d != "+0%"
                down = bool(d) and d.startswith("-") and d not in ("-0%",
                                                                   "--")
                if d and d.endswith("x") and d != "1.00x":
                    # a ratio (results.SUITE_RATIO): above or below 1
                    up, down = float(d[:-1]) > 1, float(d[:-1]) < 1
                if (up or down) and higher is not None:
                    cls.append("better" if up == higher else "worse")
                test = ""
                if decided and d is not None and u is not None:
                    # the U test: a significant change is drawn strong, a
                    # change within the noise faint (dashboard.css)
                    cls.append("significant" if u.significant() else
                               "undecided" if u.p is None else "noise")
                    test = '<span class="utest">%s</span>' % _esc(u.text())
                out.append('<td%s>%s%s</td>' % (
                    ' class="%s"' % " ".join(cls) if cls else "",
                    _esc(d or ""), test))
            out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _targets_html(suite, runs):
    """The suite's targets (results.target_lines) per run as a list, each
    line marked met or missed; empty for suites without targets."""
    items = []
    for run in runs:
        for line in results.target_lines(suite, run):
            cls = ("missed" if line.endswith("MISSED") else
                   "met" if line.endswith(": met") else "info")
            prefix = run.letter + ": " if len(runs) > 1 else ""
            items.append('<li class="%s">%s%s</li>' % (cls, _esc(prefix),
                                                       _esc(line)))
    if not items:
        return ""
    return ('<div class="targets"><h3>targets (medians over the '
            'repetitions)</h3><ul class="targets" data-suite="%s">%s</ul>'
            '</div>' % (_esc(suite), "".join(items)))


def _context_value(key, value):
    if key == "caches" and isinstance(value, list):
        parts = []
        for c in value:
            if not isinstance(c, dict):
                continue
            kind = {"Data": "d", "Instruction": "i"}.get(c.get("type"), "")
            size = c.get("size", 0)
            parts.append("L%s%s %s" % (c.get("level", "?"), kind,
                                       results.human_value("size", str(size))))
        return ", ".join(parts)
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _context_html(runs):
    keys = []
    for k in _CONTEXT_FIRST:
        if any(k in r.context for r in runs):
            keys.append(k)
    for r in runs:
        for k in r.context:
            if k not in keys:
                keys.append(k)
    out = ['<table class="context"><thead><tr><th>file</th>']
    out.extend("<th>%s%s</th>" % (_esc(r.letter + ": ") if len(runs) > 1
                                  else "", _esc(r.path)) for r in runs)
    out.append("</tr></thead><tbody>")
    for k in keys:
        out.append("<tr><th>%s</th>" % _esc(k))
        for r in runs:
            v = r.context.get(k)
            out.append("<td>%s</td>" % _esc(
                _context_value(k, v) if v is not None else ""))
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _script_json(obj):
    text = json.dumps(obj, allow_nan=False, sort_keys=True)
    return text.replace("</", "<\\/")


def _inline_script(text):
    return text.replace("</script", "<\\/script")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def render_page(suites, chartjs_path, paths, by=None, now=None):
    """The whole page as a string."""
    model = build_model(suites)
    generated = (now or datetime.datetime.now(datetime.timezone.utc)
                 ).strftime("%Y-%m-%d %H:%M UTC")
    body = []
    body.append("<header><h1>imgtool benchmarks</h1>"
                "<p>Generated %s from %d result file(s): %s.</p>"
                '<div id="status-line">Each cell: mean ± relative standard '
                "deviation over the repetitions; the line under it: change "
                "against the first column and, with at least %d repetitions "
                "on each side, its Mann-Whitney U test (significant: "
                "p &lt; %g).</div>"
                '<ul id="errors"></ul></header>' %
                (_esc(generated), len(paths), _esc(", ".join(paths)),
                 results.UTEST_MIN_REPETITIONS, results.UTEST_ALPHA))
    body.append('<nav><ul>%s</ul></nav>' % "".join(
        '<li><a href="#suite-%s">%s</a></li>' % (_esc(s), _esc(s))
        for s, _ in suites))
    for (suite, runs), sm in zip(suites, model["suites"]):
        body.append('<section id="suite-%s" class="suite">' % _esc(suite))
        body.append("<h2>%s</h2>" % _esc(suite))
        if len(sm["metrics"]) > 1:
            body.append('<label>metric <select class="metric" data-suite='
                        '"%s">%s</select></label>' % (_esc(suite), "".join(
                            '<option value="%s"%s>%s</option>' % (
                                _esc(m), " selected" if m == sm[
                                    "default_metric"] else "",
                                _esc(sm["metric_titles"][m]))
                            for m in sm["metrics"])))
        body.append('<div class="charts">')
        for chart in sm["charts"]:
            n_series, n_points = expected_counts(chart)
            body.append(
                '<figure class="chart" id="%s" data-suite="%s" '
                'data-expected-series="%d" data-expected-points="%d">'
                '<div class="canvas-box"><canvas></canvas></div>'
                '<figcaption></figcaption></figure>' %
                (_esc(chart["id"]), _esc(suite), n_series, n_points))
        body.append("</div>")
        body.append(_targets_html(suite, runs))
        body.append('<details class="tables"><summary>comparison table '
                    "(the chosen metric; runs or variants side by side)"
                    "</summary>")
        tables = results.build_tables(suite, runs, by=by)
        body.extend(_table_html(t, t.metric == sm["default_metric"])
                    for t in tables)
        body.append("</details>")
        body.append("<details><summary>machine and context</summary>%s"
                    "</details>" % _context_html(runs))
        body.append("</section>")
    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>imgtool benchmarks</title>",
        "<style>%s</style>" % _read(os.path.join(_WEB, "dashboard.css")),
        # Installed first so that errors in the scripts below are recorded.
        "<script>%s</script>" % _inline_script(
            _read(os.path.join(_WEB, "errors.js"))),
        '</head><body data-status="loading">',
        "".join(body),
        '<script type="application/json" id="dashboard-data">%s</script>' %
        _script_json(model),
        "<script>%s</script>" % _inline_script(_read(chartjs_path)),
        "<script>%s</script>" % _inline_script(
            _read(os.path.join(_WEB, "dashboard.js"))),
        "</body></html>",
    ]
    return "\n".join(page) + "\n"


def main(argv):
    parser = argparse.ArgumentParser(
        prog="dashboard",
        description="Static HTML dashboard of benchmark result files.")
    results.add_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory for index.html (created)")
    parser.add_argument("--chartjs", default=None, metavar="FILE",
                        help="chart.umd.js to inline (default: found in "
                        "benchmarks/web/node_modules)")
    args = parser.parse_args(argv)
    base_dir = os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())
    try:
        paths = results.expand(args.results, base_dir)
        suites = results.load_all(paths, base_dir)
        problem = results.check_choices(suites, by=args.by)
        if problem:
            raise results.ResultError(problem)
        chartjs = find_chartjs(args.chartjs)
        page = render_page(suites, chartjs, paths, by=args.by)
        out_dir = os.path.join(base_dir, args.out)
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "index.html")
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except (results.ResultError, DashboardError) as e:
        sys.stderr.write("dashboard: %s\n" % e)
        return 1
    except OSError as e:
        sys.stderr.write("dashboard: %s: %s\n" % (
            getattr(e, "filename", None) or args.out, e.strerror or e))
        return 1
    n = sum(len(s["charts"]) for s in build_model(suites)["suites"])
    sys.stdout.write("dashboard: wrote %s (%d suites, %d charts)\n" %
                     (out, len(suites), n))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
