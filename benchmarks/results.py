"""Reads benchmark result files and builds the comparison tables.

A result file is Google Benchmark's JSON output (`--benchmark_format=json`,
see benchmarks/README.md "Result files"): a `context` object (Google
Benchmark's own keys plus ours: suite, machine, kernel, filesystem(s),
imgtool_commit) and a `benchmarks` list. Benchmark names are
`<suite>/<key>:<value>/...`; Google Benchmark's own name parts
(`iterations:3`, `repeats:5`, `real_time`, ...) are dropped. Every user
counter (IOPS, MiB_per_s, extents, ...) is a metric. With repetitions the
file holds aggregates (mean, stddev, cv) and those are used; without them
mean and sample standard deviation are computed from the runs themselves.

Used by report.py (text tables) and dashboard.py (HTML page); stdlib only.
"""

import json
import math
import os
import statistics

# Fields of a Google Benchmark run that are not user counters.
_RUN_FIELDS = frozenset([
    "name", "family_index", "per_family_instance_index", "run_name",
    "run_type", "repetitions", "repetition_index", "threads", "iterations",
    "real_time", "cpu_time", "time_unit", "aggregate_name", "aggregate_unit",
    "label", "error_occurred", "error_message", "skipped", "big_o",
    "rms", "complexity_n",
])

# Name parts that Google Benchmark appends and that are not a configuration.
_GB_NAME_KEYS = frozenset([
    "iterations", "repeats", "min_time", "min_warmup_time", "threads",
])
_GB_NAME_WORDS = frozenset(["real_time", "manual_time", "process_time"])

# What each metric means: (unit shown, scale divisor, higher_is_better);
# higher_is_better None: a fact, not a score (e.g. the bytes preallocation
# is meant to allocate).
_METRICS = {
    "IOPS": ("IOPS", 1, True),
    "MiB_per_s": ("MiB/s", 1, True),
    "bytes_per_second": ("MiB/s", 1 << 20, True),
    "items_per_second": ("items/s", 1, True),
    "extents": ("extents", 1, False),
    "syscalls": ("syscalls", 1, False),
    "seconds": ("s", 1, False),
    "answers": ("block status calls", 1, False),
    "allocated_bytes": ("MiB", 1 << 20, None),
    "bytes_from_backing": ("MiB", 1 << 20, False),
    "writes": ("writes", 1, None),
    "max_rss_bytes": ("MiB", 1 << 20, False),
    "bytes_read": ("MiB", 1 << 20, False),
    "bytes_written": ("MiB", 1 << 20, False),
    "create_seconds": ("s", 1, False),
}


# The order of metrics in reports: the user's figures first.
_METRIC_ORDER = ["IOPS", "MiB_per_s", "seconds", "max_rss_bytes",
                 "bytes_read", "bytes_written", "extents", "answers", "bytes_from_backing",
                 "syscalls", "allocated_bytes"]


def order_metrics(metrics):
    """Known metrics in _METRIC_ORDER, then the others as found."""
    known = [m for m in _METRIC_ORDER if m in metrics]
    return known + [m for m in metrics if m not in known]


class ResultError(Exception):
    """A result file that cannot be read; the message names the file."""


def metric_info(metric):
    """Returns (unit, divisor, higher_is_better) for a metric name;
    higher_is_better is True, False or None (neither).

    Byte counts (any metric whose name ends in `bytes`) are shown in MiB;
    time metrics (`real_time (ms)`, `*_seconds`, `seconds`) are lower-better;
    unknown counters are neither.
    """
    if metric in _METRICS:
        return _METRICS[metric]
    if metric.endswith("bytes"):
        return ("MiB", 1 << 20, False)
    if metric.startswith("real_time") or metric.endswith("seconds"):
        return ("", 1, False)
    if metric.endswith("_per_s") or metric.endswith("per_second"):
        return ("", 1, True)
    return ("", 1, None)


def metric_title(metric):
    """`IOPS (higher is better)`, `bytes_from_backing (MiB, lower is
    better)`, `allocated_bytes (MiB)`."""
    unit, _, higher = metric_info(metric)
    notes = []
    if unit and unit != metric:
        notes.append(unit)
    if higher is not None:
        notes.append("higher is better" if higher else "lower is better")
    return "%s (%s)" % (metric, ", ".join(notes)) if notes else metric


class Stat(object):
    """Mean and standard deviation of one metric over n repetitions."""

    def __init__(self, mean, stddev, n):
        self.mean = mean
        self.stddev = stddev
        self.n = n

    def rsd_percent(self):
        """Relative standard deviation in percent; None if undefined (one
        repetition, zero mean, or a NaN in the file)."""
        if (self.n < 2 or self.mean == 0 or not math.isfinite(self.mean) or
                not math.isfinite(self.stddev)):
            return None
        rsd = abs(self.stddev / self.mean) * 100.0
        return rsd if math.isfinite(rsd) else None


class Case(object):
    """One configuration of a suite in one run: its keys and metrics."""

    def __init__(self, config):
        self.config = config  # list of (key, value) in name order
        self.metrics = {}  # metric name -> Stat
        self.medians = {}  # metric name -> median over the repetitions
        # metric name -> the value of every repetition (iteration entries
        # only; a file with aggregates alone has none): the U test's input
        self.samples = {}
        self.error = None  # error message if the benchmark failed

    def key(self):
        return "/".join("%s:%s" % kv for kv in self.config)

    def value(self, key):
        for k, v in self.config:
            if k == key:
                return v
        return None


class Run(object):
    """One result file: one suite on one machine at one commit."""

    def __init__(self, path, suite, context):
        self.path = path
        self.suite = suite
        self.context = context
        self.cases = []  # in file order
        self.metrics = []  # metric names in first-seen order
        self.letter = ""  # column name in a report, set by assign_letters

    def label(self):
        """Short description: machine, commit and date from the context,
        and `--quick` or `fastbuild` when the run was one (its figures do
        not compare with a full run's: smaller sizes, or no -c opt)."""
        ctx = self.context
        parts = [str(ctx.get("machine") or ctx.get("host_name") or "?")]
        commit = ctx.get("imgtool_commit")
        if commit:
            # a full hash shortened; `abc1234-dirty` kept whole
            head, sep, tail = str(commit).partition("-")
            parts.append("commit " + head[:12] + sep + tail)
        if ctx.get("date"):
            parts.append(str(ctx["date"]))
        if ctx.get("quick") == "true":
            parts.append("--quick")
        if ctx.get("build") == "fastbuild":
            parts.append("fastbuild")
        return ", ".join(parts)

    def case(self, key):
        for c in self.cases:
            if c.key() == key:
                return c
        return None


def parse_name(name):
    """Splits `suite/k:v/k:v/...` into (suite, [(k, v), ...])."""
    parts = name.split("/")
    config = []
    for i, part in enumerate(parts[1:]):
        if part in _GB_NAME_WORDS:
            continue
        key, sep, value = part.partition(":")
        if not sep:
            key, value = "arg%d" % (i + 1), part
        if key in _GB_NAME_KEYS:
            continue
        config.append((key, value))
    return parts[0], config


def _counters(entry):
    out = {}
    for k, v in entry.items():
        if k in _RUN_FIELDS or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
    if not out and isinstance(entry.get("real_time"), (int, float)):
        out["real_time (%s)" % entry.get("time_unit", "ns")] = float(
            entry["real_time"])
    return out


def load(path, display_name=None):
    """Reads one result file. Returns a list of Run, one per suite in it.

    Raises ResultError naming the file if it is not Google Benchmark JSON.
    """
    name = display_name or path
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ResultError("%s: cannot read: %s" % (name, e.strerror or e))
    except ValueError as e:
        raise ResultError("%s: not JSON: %s" % (name, e))
    except RecursionError:
        raise ResultError("%s: not JSON: nested too deeply" % name)
    if (not isinstance(data, dict) or
            not isinstance(data.get("benchmarks"), list) or
            not isinstance(data.get("context", {}), dict)):
        raise ResultError(
            "%s: not Google Benchmark JSON (no \"benchmarks\" list)" % name)
    context = data.get("context", {})
    runs = {}  # suite -> Run
    # run_name -> {"iter": [counters of each repetition],
    #              "agg": {aggregate_name: (counters, repetitions)},
    #              "error": error_message or None}
    groups = {}
    order = []
    for index, entry in enumerate(data["benchmarks"]):
        _check_entry(name, index, entry)
        run_name = entry.get("run_name") or entry["name"]
        if run_name not in groups:
            groups[run_name] = {"iter": [], "agg": {}, "error": None}
            order.append(run_name)
        g = groups[run_name]
        if entry.get("error_occurred"):
            g["error"] = str(entry.get("error_message") or "error")
            continue
        if entry.get("run_type") == "aggregate":
            g["agg"][entry.get("aggregate_name")] = (_counters(entry),
                                                     entry.get("repetitions"))
        else:
            g["iter"].append(_counters(entry))
    for run_name in order:
        g = groups[run_name]
        suite, config = parse_name(run_name)
        if suite not in runs:
            runs[suite] = Run(name, suite, context)
        run = runs[suite]
        case = Case(config)
        case.error = g["error"]
        for it in g["iter"]:
            for m, v in it.items():
                case.samples.setdefault(m, []).append(v)
        if "median" in g["agg"]:
            case.medians = dict(g["agg"]["median"][0])
        elif g["iter"]:
            for m in set(k for it in g["iter"] for k in it):
                vals = [it[m] for it in g["iter"] if m in it]
                if all(math.isfinite(v) for v in vals):
                    case.medians[m] = statistics.median(vals)
        if "mean" in g["agg"]:
            means, reps = g["agg"]["mean"]
            stddevs = g["agg"].get("stddev", ({}, reps))[0]
            n = reps if isinstance(reps, int) else len(g["iter"]) or 1
            for m, v in means.items():
                case.metrics[m] = Stat(v, stddevs.get(m, 0.0), n)
        elif g["iter"]:
            metrics = []
            for it in g["iter"]:
                for m in it:
                    if m not in metrics:
                        metrics.append(m)
            for m in metrics:
                vals = [it[m] for it in g["iter"] if m in it]
                if not all(math.isfinite(v) for v in vals):
                    # NaN or infinity in a run: no value, like a NaN mean
                    case.metrics[m] = Stat(math.nan, math.nan, len(vals))
                    continue
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                case.metrics[m] = Stat(statistics.fmean(vals), sd, len(vals))
        for m in case.metrics:
            if m not in run.metrics:
                run.metrics.append(m)
        run.cases.append(case)
    if not runs:
        raise ResultError("%s: no benchmarks in the file" % name)
    ctx_suite = context.get("suite")
    others = [s for s in runs if s != ctx_suite]
    if ctx_suite and others:
        # one file per suite (README "Result files"): a file whose
        # benchmarks belong to another suite was mixed up or merged
        raise ResultError(
            "%s: context suite \"%s\" but benchmarks of suite%s %s" % (
                name, ctx_suite, "s" if len(others) > 1 else "",
                ", ".join("\"%s\"" % s for s in others)))
    return list(runs.values())


def _check_entry(name, index, entry):
    """ResultError naming the file and the entry if a benchmark entry lacks
    what Google Benchmark always writes (a name; strings for run_name and
    aggregate_name)."""
    if not isinstance(entry, dict):
        raise ResultError("%s: benchmark entry %d is not an object" %
                          (name, index + 1))
    if not isinstance(entry.get("name"), str) or not entry["name"].split(
            "/")[0]:
        raise ResultError("%s: a benchmark entry has no name" % name)
    for field in ("run_name", "aggregate_name", "error_message"):
        if field in entry and not isinstance(entry[field], (str, type(None))):
            raise ResultError("%s: benchmark \"%s\": %s is not a string" %
                              (name, entry["name"], field))


def expand(paths, base_dir):
    """Files as given; directories become their *.json files, sorted.
    Paths stay as the user wrote them (relative to base_dir)."""
    out = []
    for p in paths:
        full = os.path.join(base_dir, p)
        if os.path.isdir(full):
            names = sorted(n for n in os.listdir(full) if n.endswith(".json"))
            if not names:
                raise ResultError("%s: no .json files in the directory" % p)
            out.extend(os.path.join(p, n) for n in names)
        else:
            out.append(p)
    return out


# Suites in the order of benchmarks/README.md; others follow, as found.
SUITE_ORDER = ["hint", "create_prealloc", "prealloc_filter", "subcluster",
               "engine", "chain", "snapshot", "nbd", "side_by_side",
               "subcluster_side_by_side", "prealloc_side_by_side",
               "chain_side_by_side", "startup_side_by_side",
               "reqcost_side_by_side"]

# The side-by-side scripts' result files (sbs_results.py): imgtool against
# qemu-img per configuration, compared as ratios to qemu-img.
SIDE_BY_SIDE_SUITES = ["side_by_side", "subcluster_side_by_side",
                       "prealloc_side_by_side", "chain_side_by_side",
                       "startup_side_by_side", "reqcost_side_by_side"]


def load_all(paths, base_dir=None):
    """Loads every file (relative paths against base_dir) into Runs,
    grouped by suite: [(suite, [Run, ...]), ...], suites in SUITE_ORDER
    and runs in the order of paths."""
    suites = []
    by_suite = {}
    for p in paths:
        full = p if base_dir is None else os.path.join(base_dir, p)
        for run in load(full, display_name=p):
            if run.suite not in by_suite:
                by_suite[run.suite] = []
                suites.append((run.suite, by_suite[run.suite]))
            by_suite[run.suite].append(run)
    for _, runs in suites:
        for i, run in enumerate(runs):
            run.letter = _letter(i)
    known = [s for s in suites if s[0] in SUITE_ORDER]
    known.sort(key=lambda s: SUITE_ORDER.index(s[0]))
    return known + [s for s in suites if s[0] not in SUITE_ORDER]


def _letter(i):
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(ord("A") + r) + s
    return s


def sort_values(values):
    """Sorts configuration values numerically when all are numbers, with
    on/off and yes/no as 0/1; otherwise keeps first-seen order."""
    def num(v):
        low = v.lower()
        if low in ("off", "no", "false"):
            return 0.0
        if low in ("on", "yes", "true"):
            return 1.0
        return _parse_size(v)
    nums = [num(v) for v in values]
    if all(n is not None for n in nums):
        return [v for _, v in sorted(zip(nums, values), key=lambda p: p[0])]
    return list(values)


def _parse_size(v):
    mult = 1
    s = v
    suffixes = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if s and s[-1].lower() in suffixes:
        mult = suffixes[s[-1].lower()]
        s = s[:-1]
    try:
        return float(s) * mult
    except ValueError:
        return None


def human_value(key, value):
    """Cluster sizes and hints in bytes as `64k`, `1M`; others unchanged."""
    if key in ("cluster", "cluster_size", "hint", "extent_size_hint",
               "size", "request", "block_size", "bs"):
        try:
            n = int(value)
        except ValueError:
            return value
        for unit, shift in (("G", 30), ("M", 20), ("k", 10)):
            if n >= (1 << shift) and n % (1 << shift) == 0:
                return "%d%s" % (n >> shift, unit)
        return value
    return value


def format_number(x):
    """1234567 -> `1,234,567`; 12.345 -> `12.3`; 0.01234 -> `0.0123`."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    a = abs(x)
    if a >= 1000:
        return "{:,.0f}".format(x)
    if a >= 100:
        return "%.0f" % x
    if a >= 10:
        return "%.1f" % x
    if a == 0:
        return "0"
    return "%.3g" % x


def format_seconds(x):
    """0.337 -> `337 ms`, 3.4e-06 -> `3.40 µs`, 12.5 -> `12.5 s`."""
    a = abs(x)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale:
            return "%s %s" % (format_number(x / scale), unit)
    if a == 0:
        return "0 s"
    return "%s ns" % format_number(x / 1e-9)


def format_value(value, metric):
    """A metric's value in its display unit (seconds auto-scaled)."""
    if metric == "seconds" or metric.endswith("_seconds"):
        return format_seconds(value)
    _, div, _ = metric_info(metric)
    return format_number(value / div)


def format_cell(stat, metric):
    """`21,505 ± 3%` (mean ± relative standard deviation)."""
    text = format_value(stat.mean, metric)
    rsd = stat.rsd_percent()
    if rsd is not None:
        text += " ± %d%%" % int(round(rsd))
    return text


def percent_change(value, first):
    """Signed percentage change against the first column: `+12%`, `-3%`."""
    if first == 0:
        return "--" if value != 0 else "+0%"
    pct = (value - first) / abs(first) * 100.0
    if round(pct) == -100 and value != 0:
        # keep a shrink to a small fraction visible: -99.8%, not -100%
        text = "%+.1f%%" % pct
        return text if text != "-100.0%" else "%+.2f%%" % pct
    return "%+d%%" % int(round(pct))


# Mann-Whitney U test (Google Benchmark's tools/compare.py runs scipy's
# mannwhitneyu, two-sided, over the repetitions of the two runs compared).
# compare.py runs it from 2 repetitions (UTEST_MIN_REPETITIONS) and calls
# fewer than 9 unreliable (UTEST_OPTIMAL_REPETITIONS). We require
# UTEST_MIN_REPETITIONS on each side: with 3 against 3 no ordering of the
# runs reaches p < 0.05 (the smallest two-sided exact p is 2/20 = 0.1), with
# 4 against 4 it is 2/70 = 0.029, with 5 against 5 2/252 = 0.0079.
UTEST_MIN_REPETITIONS = 4
UTEST_ALPHA = 0.05


def _ranks(values):
    """Ranks 1..n of values, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def _exact_u_counts(n1, n2):
    """counts[u]: how many of the C(n1+n2, n1) orderings of two samples
    without ties give the first sample the statistic U = u."""
    # f[j][u] for (i, j): orderings of i values of x and j of y with U = u;
    # the largest value is x's (adds j to U) or y's.
    prev = [[1] for _ in range(n2 + 1)]  # i = 0: U = 0 only
    for i in range(1, n1 + 1):
        cur = [[1]]  # j = 0: U = 0 only
        for j in range(1, n2 + 1):
            a = prev[j]  # x's largest: U of the rest + j
            b = cur[j - 1]  # y's largest: U of the rest
            row = [0] * (i * j + 1)
            for u, c in enumerate(a):
                row[u + j] += c
            for u, c in enumerate(b):
                row[u] += c
            cur.append(row)
        prev = cur
    return prev[n2]


def mann_whitney_u(x, y, method="auto"):
    """Two-sided Mann-Whitney U test of samples x and y (lists of numbers),
    as scipy.stats.mannwhitneyu(x, y) with its defaults (scipy 1.7 to
    1.13: method 'auto', use_continuity True): returns (U1, p), U1 the
    statistic of x (the number of pairs with x > y, ties counting 1/2).

    method "auto": p is exact (the null distribution counted) when there
    are no ties and one sample has at most 8 values, else asymptotic: the
    normal approximation with the tie correction of the variance and a
    continuity correction of 1/2. "exact" / "asymptotic" force one (exact
    counts ties as if broken, as scipy). Both samples need at least one
    value (ValueError otherwise)."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney_u needs two non-empty samples")
    ranks = _ranks(list(x) + list(y))
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2.0
    u2 = n1 * n2 - u1
    big = max(u1, u2)
    n = n1 + n2
    counts = {}
    for v in list(x) + list(y):
        counts[v] = counts.get(v, 0) + 1
    ties = any(c > 1 for c in counts.values())
    if method == "auto":
        method = "exact" if min(n1, n2) <= 8 and not ties else "asymptotic"
    if method == "exact":
        dist = _exact_u_counts(n1, n2)
        # P(U >= big); with ties big may be a half: round up
        tail = sum(dist[int(math.ceil(big)):])
        p = 2.0 * tail / math.comb(n, n1)
    else:
        tie_term = sum(c ** 3 - c for c in counts.values()) / (n * (n - 1))
        var = n1 * n2 / 12.0 * ((n + 1) - tie_term)
        if var <= 0:
            return u1, 1.0  # every value equal: nothing differs
        z = (big - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
        p = math.erfc(z / math.sqrt(2.0))  # 2 * the normal survival at z
    return u1, min(p, 1.0)


class UTest(object):
    """The U test of one difference: n1, n2 repetitions; p the two-sided p
    value, or None when there are too few repetitions to decide (fewer than
    UTEST_MIN_REPETITIONS on a side, or a non-finite value)."""

    def __init__(self, n1, n2, p):
        self.n1 = n1
        self.n2 = n2
        self.p = p

    def significant(self):
        return self.p is not None and self.p < UTEST_ALPHA

    def text(self):
        """`p=0.0079 significant`, `p=0.69 not significant`, `too few
        reps (2 vs 2)`."""
        if self.p is None:
            return "too few reps (%d vs %d)" % (self.n1, self.n2)
        return "p=%s %s" % (format_p(self.p), "significant" if
                            self.significant() else "not significant")


def format_p(p):
    """0.007936 -> `0.0079`, 0.6905 -> `0.69`, 1.0 -> `1`."""
    text = "%.2g" % p
    return text if "e" not in text else "%.1e" % p


def utest_values(a, b):
    """UTest between two lists of repetitions' values (p None when a side
    has fewer than UTEST_MIN_REPETITIONS or a value is not finite)."""
    a, b = list(a), list(b)
    if (min(len(a), len(b)) < UTEST_MIN_REPETITIONS or
            not all(math.isfinite(v) for v in a + b)):
        return UTest(len(a), len(b), None)
    return UTest(len(a), len(b), mann_whitney_u(a, b)[1])


def utest(first, other, metric):
    """UTest of one metric between two cases' repetitions (Case.samples)."""
    a = first.samples.get(metric, []) if first is not None else []
    b = other.samples.get(metric, []) if other is not None else []
    return utest_values(a, b)


def mean_rsd(values, number="{:,.0f}"):
    """`MEAN ± RSD%` of repetitions' values (the side-by-side scripts'
    table cells), MEAN formatted with `number`; RSD 0 for one value."""
    m = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return "%s ± %.0f%%" % (number.format(m), sd / m * 100 if m else 0.0)


class Table(object):
    """One comparison table: rows of cells and a difference line per row.

    columns: header strings; rows: [(row_label, [cell or None], [diff or
    None], [UTest or None])]; legend: lines that explain the columns.
    """

    def __init__(self, suite, metric, title, columns, legend):
        self.suite = suite
        self.metric = metric
        self.title = title
        self.columns = columns
        self.legend = legend
        self.rows = []


# The configuration key compared side by side when a suite has one run.
SUITE_COLUMN_KEY = {
    "subcluster": "extended_l2",
    "hint": "hint",
    "create_prealloc": "prealloc",
    "prealloc_filter": "filter",
    "engine": "tool",
    "chain": "tool",
    "snapshot": "tool",
    "nbd": "tool",
    # advise: one column per filesystem (a file per run), rows the
    # workload's configurations
    "advise": "fs",
}
SUITE_COLUMN_KEY.update((s, "tool") for s in SIDE_BY_SIDE_SUITES)

# Suites whose variant columns are compared as ratios against the first
# column (the reference: the name's first-seen value, e.g. chain's
# tool:qemu-img) rather than as percent changes: `0.80x` is 0.8 times the
# reference's value (issue 16's targets are such ratios).
SUITE_RATIO = frozenset(["chain", "snapshot", "nbd"] + SIDE_BY_SIDE_SUITES)

# Column order of a suite's variant key where first-seen order is not the
# one wanted: `nbd` compares servers (qemu-nbd, imgtool) and copy clients
# (nbdcopy, qemu-img, imgtool) in one table, each row against its first
# value (qemu-nbd for the server rows, nbdcopy for the copies).
SUITE_COLUMN_ORDER = {"nbd": ["qemu-nbd", "nbdcopy", "qemu-img", "imgtool"]}
# the side-by-side scripts record imgtool's first run first: qemu-img is
# the reference all the same
SUITE_COLUMN_ORDER.update((s, ["qemu-img", "imgtool"])
                          for s in SIDE_BY_SIDE_SUITES)


def ratio(value, first):
    """`0.80x`: value / first; `--` when first is 0."""
    if first == 0:
        return "--" if value != 0 else "1.00x"
    return "%.2fx" % (value / first)


def config_keys(runs):
    """Every key of the benchmark names of these runs, first-seen order."""
    keys = []
    for run in runs:
        for case in run.cases:
            for k, _ in case.config:
                if k not in keys:
                    keys.append(k)
    return keys


def run_metrics(runs):
    """Every metric of these runs, in order_metrics order."""
    metrics = []
    for run in runs:
        for m in run.metrics:
            if m not in metrics:
                metrics.append(m)
    return order_metrics(metrics)


def add_arguments(parser):
    """The command-line arguments report and dashboard share."""
    parser.add_argument("results", nargs="+", metavar="RESULTS",
                        help="Google Benchmark JSON files or directories")
    parser.add_argument("--by", default=None,
                        help="table columns: 'run' (one per file) or a key "
                        "of the benchmark names, e.g. extended_l2")


def check_choices(suites, by=None, metrics=None):
    """A one-line problem if no suite has the --by key or a --metric (a
    typo would otherwise print nothing), else None."""
    runs = [r for _, rs in suites for r in rs]
    if by and by != "run":
        keys = config_keys(runs)
        if by not in keys:
            return "no result has the key \"%s\" in its benchmark names " \
                "(keys: %s)" % (by, ", ".join(keys))
    known = run_metrics(runs)
    for m in metrics or []:
        if m not in known:
            return "no result has the metric \"%s\" (metrics: %s)" % (
                m, ", ".join(known))
    return None


def column_key(suite, runs, by=None):
    """`run` to compare runs (files); else the key whose values are the
    columns. Default: `run` with more than one run of the suite, else the
    suite's variant key, else the last key of the names."""
    keys = config_keys(runs)
    if by and by != "run":
        return by if by in keys else None
    if by == "run" or len(runs) > 1 or not keys:
        return "run"
    preferred = SUITE_COLUMN_KEY.get(suite)
    if preferred in keys:
        return preferred
    return keys[-1]


def build_tables(suite, runs, by=None, metrics=None):
    """The comparison tables of one suite, one per metric."""
    col_key = column_key(suite, runs, by)
    if col_key is None:
        return []
    all_metrics = run_metrics(runs)
    if metrics:
        all_metrics = [m for m in all_metrics if m in metrics]
    tables = []
    for metric in all_metrics:
        if col_key == "run":
            tables.append(_table_by_run(suite, runs, metric))
        else:
            tables.extend(_tables_by_key(suite, runs, metric, col_key))
    return [t for t in tables if t.rows]


def constant_keys(runs):
    """Keys with one value in every case of these runs, in name order:
    [(key, value)]. They are left out of row and series labels."""
    seen = {}
    order = []
    count = 0
    for run in runs:
        for case in run.cases:
            count += 1
            for k, v in case.config:
                if k not in seen:
                    seen[k] = set()
                    order.append(k)
                seen[k].add(v)
    out = []
    for k in order:
        present = sum(1 for r in runs for c in r.cases if c.value(k) is not None)
        if len(seen[k]) == 1 and present == count and count > 1:
            out.append((k, next(iter(seen[k]))))
    return out


def config_label(config, skip=()):
    """`cluster:64k/extended_l2:on` without the keys in skip."""
    parts = ["%s:%s" % (k, human_value(k, v)) for k, v in config
             if k not in skip]
    return "/".join(parts) if parts else "(all)"


def _stats(case, metric):
    """(Stat or None, error or None) of one cell; a NaN mean is no value."""
    if case is None:
        return (None, None)
    stat = case.metrics.get(metric)
    if stat is not None and (math.isnan(stat.mean) or math.isinf(stat.mean)):
        stat = None
    return (stat, case.error)


def _row(cases, metric, as_ratio=False):
    """Cells and the line under them: percent changes against the first
    column, or with as_ratio ratios against the row's first value (the
    first column in every suite but nbd, whose rows fill different
    columns), and for each change the U test (UTest) of its repetitions
    against those of the value it is compared with. cases: a Case or
    None per column."""
    cells_stats = [_stats(c, metric) for c in cases]
    cells, diffs, tests = [], [], []
    first = cells_stats[0][0]
    first_i = 0
    if as_ratio:
        for i, (stat, error) in enumerate(cells_stats):
            if stat is not None or error is not None:
                first, first_i = stat, i
                break
    for i, (stat, error) in enumerate(cells_stats):
        if error is not None:
            cells.append("ERROR")
        elif stat is None:
            cells.append(None)
        else:
            cells.append(format_cell(stat, metric))
        if i <= first_i or stat is None or first is None:
            diffs.append(None)
            tests.append(None)
            continue
        if as_ratio:
            diffs.append(ratio(stat.mean, first.mean))
        else:
            diffs.append(percent_change(stat.mean, first.mean))
        tests.append(utest(cases[first_i], cases[i], metric))
    return cells, diffs, tests


def utest_decided(t):
    """Whether any difference of table t has enough repetitions for the U
    test: if none has, the legend says so once and the cells say nothing."""
    return any(u is not None and u.p is not None
               for _, _, _, tests in t.rows for u in tests)


def _utest_legend(t):
    """The legend line on the U test of table t's differences."""
    tests = [u for _, _, _, ts in t.rows for u in ts if u is not None]
    if not tests:
        return
    if utest_decided(t):
        t.legend.append(
            "each change: Mann-Whitney U test (two-sided) of the "
            "repetitions against the compared value's, significant if "
            "p < %g; at least %d repetitions on each side" % (
                UTEST_ALPHA, UTEST_MIN_REPETITIONS))
        return
    pairs = sorted(set((u.n1, u.n2) for u in tests))
    t.legend.append(
        "U test: too few repetitions to decide (%s; at least %d on each "
        "side needed)" % (", ".join("%d vs %d" % p for p in pairs),
                          UTEST_MIN_REPETITIONS))


def diff_text(diff, test, decided):
    """The text under a cell: the change, and with `decided` (the table
    has U tests) its test, `+12%, p=0.0079 significant`."""
    if diff is None:
        return None
    if not decided or test is None:
        return diff
    return "%s, %s" % (diff, test.text())


def _legend_constant(const):
    if not const:
        return []
    return ["every row: " + config_label(const)]


def _table_by_run(suite, runs, metric):
    const = constant_keys(runs)
    skip = set(k for k, _ in const)
    legend = ["%s: %s (%s)" % (r.letter, r.path, r.label()) for r in runs]
    t = Table(suite, metric, "%s: %s" % (suite, metric_title(metric)),
              [r.letter for r in runs], legend + _legend_constant(const))
    keys = []
    configs = {}
    for run in runs:
        for case in run.cases:
            if case.key() not in configs:
                keys.append(case.key())
                configs[case.key()] = case.config
    for key in keys:
        cases = [run.case(key) for run in runs]
        stats = [_stats(c, metric) for c in cases]
        if all(s is None and e is None for s, e in stats):
            continue
        cells, diffs, tests = _row(cases, metric)
        t.rows.append((config_label(configs[key], skip), cells, diffs,
                       tests))
    _utest_legend(t)
    return t


def _tables_by_key(suite, runs, metric, col_key):
    tables = []
    for run in runs:
        const = constant_keys([run])
        skip = set(k for k, _ in const) | {col_key}
        values = []
        rows = []  # row labels, first-seen order
        cells = {}
        for case in run.cases:
            v = case.value(col_key)
            if v is None:
                continue
            if v not in values:
                values.append(v)
            rest = config_label(case.config, skip)
            if rest not in rows:
                rows.append(rest)
            cells[(rest, v)] = case
        values = sort_values(values)
        order = SUITE_COLUMN_ORDER.get(suite)
        if order and col_key == "tool":
            values = ([v for v in order if v in values] +
                      [v for v in values if v not in order])
        as_ratio = suite in SUITE_RATIO
        legend = ["%s (%s)" % (run.path, run.label())]
        if as_ratio and len(values) > 1 and suite == "nbd" and \
                col_key == "tool":  # two references: see SUITE_COLUMN_ORDER
            legend.append("under each cell: its ratio to the row's first "
                          "value (%s)" % ", ".join(
                              "%s:%s" % (col_key, v) for v in order[:2]))
        elif as_ratio and len(values) > 1:
            legend.append("under each cell: its ratio to %s:%s" % (
                col_key, human_value(col_key, values[0])))
        t = Table(suite, metric, "%s: %s" % (suite, metric_title(metric)),
                  ["%s:%s" % (col_key, human_value(col_key, v))
                   for v in values],
                  legend + _legend_constant(
                      [kv for kv in const if kv[0] != col_key]))
        for rest in rows:
            row_cases = [cells.get((rest, v)) for v in values]
            stats = [_stats(c, metric) for c in row_cases]
            if all(s is None and e is None for s, e in stats):
                continue
            row_cells, diffs, tests = _row(row_cases, metric, as_ratio)
            t.rows.append((rest, row_cells, diffs, tests))
        _utest_legend(t)
        tables.append(t)
    return tables


def table_to_text(t):
    """A fixed-width text table, like QEMU's simplebench tables: each case
    has a line of `mean ± rsd` cells and under it the change of each column
    against the first."""
    lines = ["== " + t.title]
    lines.extend("   " + l for l in t.legend)
    grid = [[""] + list(t.columns)]
    decided = utest_decided(t)
    for label, cells, diffs, tests in t.rows:
        grid.append([label] + [c if c is not None else "-" for c in cells])
        if any(d is not None for d in diffs):
            grid.append([""] + [diff_text(d, u, decided) or ""
                                for d, u in zip(diffs, tests)])
    widths = [max(len(r[i]) for r in grid) for i in range(len(grid[0]))]
    out = []
    for n, r in enumerate(grid):
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(r))
        out.append(line.rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.extend(out)
    return "\n".join(lines) + "\n"


# The targets of a suite, checked on the medians over the repetitions
# (issue 18's for `snapshot`, issue 19's for `nbd`): (label, kind, case,
# metric, op, bound[, ours, theirs, their_case]).
#   kind "ratio": imgtool's median / qemu-img's median of `case` (or the
#   median of tool `ours` in `case` / tool `theirs` in `their_case`);
#   kind "cost": 1 - median of `case` / median of `metric`'s base case
#   (BASE_CASE), per tool: what an enabled bitmap costs in write IOPS.
SUITE_TARGETS = {
    "snapshot": [
        ("snapshot -c time", "ratio", "create", "seconds", "<=", 0.8),
        ("snapshot -d time", "ratio", "delete", "seconds", "<=", 0.8),
        ("4k writes after a snapshot, IOPS", "ratio", "cow", "IOPS", ">=",
         1.0),
        ("the same with extended L2, IOPS", "ratio", "cow_extl2", "IOPS",
         ">=", 1.0),
        ("bitmap cost in write IOPS", "cost", "write_bitmap", "IOPS", "<",
         0.03),
    ],
}


def _nbd_targets():
    out = []
    for transport in ("unix", "tcp"):
        cells = ["%s_d%d_%s" % (op, d, transport)
                 for op in ("randread", "randwrite") for d in (1, 16, 64)]
        cells.append("seqread_" + transport)
        for c in cells:
            out.append(("server %s, IOPS" % c, "ratio", c, "IOPS", ">=", 1.0,
                        "imgtool", "qemu-nbd", c))
    for op in ("randread", "randwrite"):
        for transport in ("unix", "tcp"):
            c = "%s_d64_%s" % (op, transport)
            out.append(("server %s against local %s_d64, IOPS" % (c, op),
                        "ratio", c, "IOPS", ">=", 0.8, "imgtool", "imgtool",
                        op + "_d64"))
    for server in ("qemu-nbd", "imgtool"):
        c = "copy_from_" + server
        out.append(("%s time, imgtool convert against nbdcopy" % c, "ratio",
                    c, "seconds", "<=", 1.0, "imgtool", "nbdcopy", c))
    return out


SUITE_TARGETS["nbd"] = _nbd_targets()
BASE_CASE = {"write_bitmap": "write"}
_OP_TEXT = {"<=": "\u2264", ">=": "\u2265", "<": "<"}


def _median(run, case_name, tool, metric):
    for case in run.cases:
        if case.value("case") == case_name and case.value("tool") == tool:
            if case.error is not None:
                return None
            return case.medians.get(metric)
    return None


def _met(value, op, bound):
    return {"<=": value <= bound, ">=": value >= bound,
            "<": value < bound}[op]


# The side-by-side scripts' target (issue 20): imgtool's median at least
# qemu-img's in every cell, one line per configuration (all labels but
# `tool`) with the U test of the runs saying whether the difference is
# beyond their noise: (metric, op, bound).
SBS_TARGETS = {
    "subcluster_side_by_side": ("IOPS", ">=", 1.0),
    "prealloc_side_by_side": ("IOPS", ">=", 1.0),
    # issue 20 part 2: start to exit at most qemu-img's
    "startup_side_by_side": ("seconds", "<=", 1.0),
}


def _sbs_target_lines(suite, run, metrics):
    """`cluster:64k/extended_l2:on, IOPS: imgtool 8,300 / qemu-img 5,700,
    ratio 1.46, p=0.029 significant (target \u2265 1): met` per
    configuration of a side-by-side suite (SBS_TARGETS)."""
    metric, op, bound = SBS_TARGETS[suite]
    if metrics and metric not in metrics:
        return []
    skip = set(k for k, _ in constant_keys([run])) | {"tool"}
    cells, order = {}, []
    for case in run.cases:
        rest = config_label(case.config, skip)
        if rest not in cells:
            cells[rest] = {}
            order.append(rest)
        cells[rest][case.value("tool")] = case
    lines = []
    for rest in order:
        ours, theirs = cells[rest].get("imgtool"), cells[rest].get("qemu-img")
        a, b = [None if c is None or c.error is not None else
                c.medians.get(metric) for c in (ours, theirs)]
        value = a / b if a is not None and b else None
        text = _verdict("ratio", value, "%.2f", op, "%g" % bound)
        if value is not None:
            text = text.replace(" (target", ", %s (target" % utest(
                theirs, ours, metric).text(), 1)
        lines.append("%s, %s: imgtool %s / qemu-img %s, %s" % (
            rest, metric, _fmt(a, metric), _fmt(b, metric), text))
    return lines


def target_lines(suite, run, metrics=None):
    """One line per target of the suite (SUITE_TARGETS, SBS_TARGETS) on one
    run, e.g. `snapshot -c time: imgtool 52.0 ms / qemu-img 81.0 ms, ratio
    0.64 (target \u2264 0.8): met`; `-` and `not measured` where a median
    is missing (an error entry or a case left out). [] for other suites;
    with `metrics`, only the targets on those metrics."""
    if suite in SBS_TARGETS:
        return _sbs_target_lines(suite, run, metrics)
    if suite == "engine":
        return _engine_target_lines(run, metrics)
    if suite == "reqcost_side_by_side":
        return _reqcost_target_lines(run, metrics)
    lines = []
    for target in SUITE_TARGETS.get(suite, []):
        label, kind, case_name, metric, op, bound = target[:6]
        ours_tool, theirs_tool, their_case = (
            target[6:] if len(target) > 6 else ("imgtool", "qemu-img",
                                                case_name))
        if metrics and metric not in metrics:
            continue
        if kind == "ratio":
            ours = _median(run, case_name, ours_tool, metric)
            theirs = _median(run, their_case, theirs_tool, metric)
            if their_case != case_name:
                theirs_tool += " " + their_case
            head = "%s: %s %s / %s %s, " % (
                label, ours_tool, _fmt(ours, metric), theirs_tool,
                _fmt(theirs, metric))
            value = ours / theirs if ours is not None and theirs else None
            lines.append(head + _verdict("ratio", value, "%.2f", op,
                                         "%g" % bound))
        else:
            base = BASE_CASE[case_name]
            for tool in ("imgtool", "qemu-img"):
                with_ = _median(run, case_name, tool, metric)
                without = _median(run, base, tool, metric)
                head = "%s, %s: %s with / %s without, " % (
                    label, tool, _fmt(with_, metric), _fmt(without, metric))
                value = (1.0 - with_ / without
                         if with_ is not None and without else None)
                text = _verdict("cost", None if value is None else
                                value * 100.0, "%.1f%%", op,
                                "%g%%" % (bound * 100.0))
                if tool != "imgtool":  # the target is imgtool's
                    text = text.split(" (target")[0] + " (for comparison)"
                lines.append(head + text)
    return lines


# The engine suite's target (issue 20 part 1): imgtool's default engine
# for the suite's O_DIRECT files at least ENGINE_TARGET of the ceiling at
# each filesystem, op and depth. The ceiling is derived here, not written by
# the suite: the highest median IOPS of the run's fio entries (engine labels
# io_uring, io_uring_fixedbufs, io_uring_registerfiles,
# io_uring_sqthread_poll, libaio) for that filesystem, op and depth; entries
# with an error are left out of it.
ENGINE_TARGET = 0.95


def _default_engine(run):
    """imgtool's default engine for O_DIRECT files, as the run's entries
    know it: native (the default since session 28, imgtool/image.cc), or
    io_uring for files with no imgtool native entry (before the native
    engine was measured, io_uring was the default)."""
    for case in run.cases:
        if case.value("tool") == "imgtool" and case.value("engine") == "native":
            return "native"
    return "io_uring"


def _engine_target_lines(run, metrics):
    """`randread depth 64 on xfs, IOPS: imgtool native 88,709 / ceiling
    95,000 (fio libaio), ratio 0.93 (target \u2265 0.95): MISSED` per
    filesystem, op and depth of an engine run, in the run's order (a name
    without an fs label: no ` on FS`)."""
    if metrics and "IOPS" not in metrics:
        return []
    default = _default_engine(run)
    cells, order = {}, []
    for case in run.cases:
        key = (case.value("fs"), case.value("op"), case.value("depth"))
        if key not in cells:
            cells[key] = {"ours": None, "ceiling": None, "by": None}
            order.append(key)
        value = (None if case.error is not None else
                 case.medians.get("IOPS"))
        cell = cells[key]
        if case.value("tool") == "fio":
            if value is not None and (cell["ceiling"] is None or
                                      value > cell["ceiling"]):
                cell["ceiling"], cell["by"] = value, case.value("engine")
        elif (case.value("tool") == "imgtool" and
              case.value("engine") == default):
            cell["ours"] = value
    lines = []
    for key in order:
        fs, op, depth = key
        c = cells[key]
        value = (c["ours"] / c["ceiling"]
                 if c["ours"] is not None and c["ceiling"] else None)
        by = " (fio %s)" % c["by"] if c["by"] else ""
        lines.append("%s depth %s%s, IOPS: imgtool %s %s / ceiling %s%s, %s" % (
            op, depth, " on %s" % fs if fs else "", default,
            _fmt(c["ours"], "IOPS"), _fmt(c["ceiling"], "IOPS"), by,
            _verdict("ratio", value, "%.2f", ">=", "%g" % ENGINE_TARGET)))
    return lines


# reqcost_side_by_side's targets (issue 20 part 1, per-request cost where
# nothing merges): per case and depth, imgtool's median IOPS at least
# qemu-img's with the same engine (REQCOST_QEMU_TARGET, with the U test),
# and imgtool's default engine at least ENGINE_TARGET of the ceiling, the
# highest median of the cell's fio entries (derived here, as for engine).
REQCOST_QEMU_TARGET = 1.0


def _reqcost_target_lines(run, metrics):
    """Per case and depth, in the run's order: `case:write_step12k/depth:64,
    engine native, IOPS: imgtool 300,000 / qemu-img 280,000, ratio 1.07,
    p=0.0079 significant (target \u2265 1): met` for each imgtool engine
    qemu-img also ran, then `case:randread/depth:64, IOPS: imgtool native
    90,000 / ceiling 95,000 (fio libaio), ratio 0.95 (target \u2265 0.95):
    met`."""
    if metrics and "IOPS" not in metrics:
        return []
    default = _default_engine(run)
    cells, order = {}, []
    for case in run.cases:
        key = "case:%s/depth:%s" % (case.value("case"), case.value("depth"))
        if key not in cells:
            cells[key] = {}
            order.append(key)
        cells[key][(case.value("tool"), case.value("engine"))] = case
    lines = []
    for key in order:
        by = cells[key]

        def median(case):
            return (None if case is None or case.error is not None else
                    case.medians.get("IOPS"))
        engines = [e for t, e in by if t == "imgtool"]
        for engine in engines:
            ours, theirs = by[("imgtool", engine)], by.get(("qemu-img",
                                                            engine))
            if theirs is None:
                continue
            a, b = median(ours), median(theirs)
            value = a / b if a is not None and b else None
            text = _verdict("ratio", value, "%.2f", ">=",
                            "%g" % REQCOST_QEMU_TARGET)
            if value is not None:
                text = text.replace(" (target", ", %s (target" % utest(
                    theirs, ours, "IOPS").text(), 1)
            lines.append("%s, engine %s, IOPS: imgtool %s / qemu-img %s, %s" %
                         (key, engine, _fmt(a, "IOPS"), _fmt(b, "IOPS"),
                          text))
        ceiling, by_engine = None, None
        for (tool, engine), case in by.items():
            v = median(case)
            if tool == "fio" and v is not None and (ceiling is None or
                                                   v > ceiling):
                ceiling, by_engine = v, engine
        ours = median(by.get(("imgtool", default)))
        value = ours / ceiling if ours is not None and ceiling else None
        lines.append("%s, IOPS: imgtool %s %s / ceiling %s%s, %s" % (
            key, default, _fmt(ours, "IOPS"), _fmt(ceiling, "IOPS"),
            " (fio %s)" % by_engine if by_engine else "",
            _verdict("ratio", value, "%.2f", ">=", "%g" % ENGINE_TARGET)))
    return lines


def _fmt(value, metric):
    return "-" if value is None else format_value(value, metric)


def _verdict(name, value, fmt, op, bound_text):
    if value is None:
        return "%s - (target %s %s): not measured" % (name, _OP_TEXT[op],
                                                     bound_text)
    bound = float(bound_text.rstrip("%"))
    return "%s %s (target %s %s): %s" % (
        name, fmt % value, _OP_TEXT[op], bound_text,
        "met" if _met(value, op, bound) else "MISSED")
