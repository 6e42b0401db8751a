"""Browser test of //benchmarks:dashboard: builds the page from the real
result files in testdata/benchmarks (run1 and run2), opens it from disk in
headless Debian Chromium and reads back the DOM (--dump-dom): every chart
must have drawn the expected number of series and points, and no script
error may have occurred. Saves a screenshot (dashboard.png) in
TEST_UNDECLARED_OUTPUTS_DIR (bazel-testlogs/benchmarks/dashboard_test/
test.outputs/outputs.zip).

Needs /usr/bin/chromium and benchmarks/web/node_modules (tools/setup.sh).
"""

import contextlib
import html.parser
import io
import json
import math
import os
import shutil
import subprocess
import tempfile
import unittest

from benchmarks import dashboard
from benchmarks import results

_WS = os.path.join(os.environ.get("TEST_SRCDIR", ""),
                   os.environ.get("TEST_WORKSPACE", ""))
_CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
_RESULTS = ["testdata/benchmarks/run1", "testdata/benchmarks/run2"]

# What each chart must show for the default metric of its suite, from the
# files in testdata/benchmarks/run1 and run2 (2 runs: every series twice,
# but prealloc_filter, chain and snapshot are in run2 only):
# chart id -> (series, points).
EXPECTED = {
    # bars: (xfs, ext4) x 2 runs over hints 0/1M/8M
    "chart-hint-write": (4, 12),
    "chart-hint-map": (4, 12),
    # bars: (xfs, ext4, ext4_noextents) x 2 runs over prealloc off/falloc/full
    "chart-create_prealloc-raw": (6, 18),
    "chart-create_prealloc-qcow2": (6, 18),
    # bars (run2 only): (xfs, ext4) x filter off/on over the 2 write patterns
    "chart-prealloc_filter": (4, 8),
    # lines: extended_l2 off (4k, 16k..2M: 9 sizes) and on (8 sizes) x 2 runs
    "chart-subcluster": (4, 34),
    # lines: io_uring, threads, fio (ceiling) x 2 runs over depths 1..256 (9)
    "chart-engine-randread": (6, 54),
    "chart-engine-randwrite": (6, 54),
    # bars (run2 only): qemu-img and imgtool over the 5 commands
    "chart-chain": (2, 10),
    # bars (run2 only): qemu-img and imgtool over the 6 snapshot cases
    "chart-snapshot": (2, 12),
}


# The side-by-side scripts' smoke runs (testdata/benchmarks/sbs): chart id
# -> (metric shown, series, points). side_by_side: imgtool and qemu-img over
# the 4 bench cases (its 2 map cases have seconds, not IOPS);
# subcluster_side_by_side: one chart per extended_l2 value, 2 tools over
# 64k and 2M; prealloc_side_by_side (xfs only): filter off/on x 2 tools
# over the 2 write patterns; chain_side_by_side: 2 tools over 5 commands;
# startup_side_by_side: 2 tools over 5 commands.
SBS_EXPECTED = {
    "chart-side_by_side": ("IOPS", "2", "8"),
    "chart-subcluster_side_by_side-off": ("IOPS", "2", "4"),
    "chart-subcluster_side_by_side-on": ("IOPS", "2", "4"),
    "chart-prealloc_side_by_side": ("IOPS", "4", "8"),
    "chart-chain_side_by_side": ("seconds", "2", "10"),
    "chart-startup_side_by_side": ("seconds", "2", "10"),
    # reqcost_side_by_side (depths 1 and 64): one chart per case; the 12 KiB
    # step cases have 3 engines x (imgtool, qemu-img) + fio's 2 engines,
    # the random ones no qemu-img (its bench has no random mode)
    "chart-reqcost_side_by_side-write_step12k": ("IOPS", "8", "16"),
    "chart-reqcost_side_by_side-read_step12k": ("IOPS", "8", "16"),
    "chart-reqcost_side_by_side-randwrite": ("IOPS", "5", "10"),
    "chart-reqcost_side_by_side-randread": ("IOPS", "5", "10"),
}

# Their captions: each bar's ratio to qemu-img's (means) and the U test of
# the 4 runs against 4 (e.g. subcluster 2M on: imgtool 465 428 559 410
# against qemu-img 363 273 298 315 IOPS, every imgtool run faster: U = 16
# of 16, p = 2/70; 64k off: imgtool 1367 860 1452 2633 against qemu-img
# 1117 1511 814 937, U = 11: 17 of the 70 orderings are as extreme on
# each side, p = 34/70 = 0.49).
SBS_CAPTIONS = {
    "chart-side_by_side":
        "tool:imgtool / tool:qemu-img: write 2.63 (p=0.11 not significant), "
        "read 2.71 (p=0.029 significant), write_uring 3.12 (p=0.029 "
        "significant), read_uring 5.08 (p=0.34 not significant)",
    "chart-subcluster_side_by_side-off":
        "tool:imgtool / tool:qemu-img: 64k 1.44 (p=0.49 not significant), "
        "2M 1.25 (p=0.11 not significant)",
    "chart-subcluster_side_by_side-on":
        "tool:imgtool / tool:qemu-img: 64k 1.46 (p=0.11 not significant), "
        "2M 1.49 (p=0.029 significant)",
    "chart-prealloc_side_by_side":
        "filter:off/tool:imgtool / filter:off/tool:qemu-img: aligned16k "
        "1.85 (p=0.69 not significant), unaligned64k 2.19 (p=0.11 not "
        "significant); filter:on/tool:imgtool / filter:on/tool:qemu-img: "
        "aligned16k 2.95 (p=0.11 not significant), unaligned64k 2.03 "
        "(p=0.11 not significant)",
    "chart-chain_side_by_side":
        "tool:imgtool / tool:qemu-img: rebase 0.67 (p=0.69 not significant), "
        "flatten 0.63 (p=0.11 not significant), commit 0.94 (p=0.77 not "
        "significant), measure 0.86 (p=0.69 not significant), dd 0.48 "
        "(p=0.029 significant)",
    "chart-startup_side_by_side":
        "tool:imgtool / tool:qemu-img: info 0.52 (p=0.029 significant), "
        "info_json 0.40 (p=0.029 significant), map 0.48 (p=0.029 "
        "significant), check 0.60 (p=0.029 significant), create 0.63 "
        "(p=0.029 significant)",
}


class _DomReader(html.parser.HTMLParser):
    """Collects the attributes of figures, the body and the error list."""

    def __init__(self):
        super().__init__()
        self.figures = {}
        self.body = {}
        self.errors = []
        self.scripts_with_src = []
        self.links = []
        self.tables = []  # (section id, metric, hidden)
        self.captions = {}  # figure id -> figcaption text
        # figure id -> text of the caption's red part (span.failed)
        self.caption_failures = {}
        self._in_failed = False
        self._section = None
        self._figure = None
        self._in_caption = False
        self._in_errors = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "chart" in (a.get("class") or ""):
            self.figures[a.get("id")] = a
            self._figure = a.get("id")
        elif tag == "figcaption" and self._figure:
            self._in_caption = True
            self.captions[self._figure] = ""
        elif (tag == "span" and self._in_caption
              and a.get("class") == "failed"):
            self._in_failed = True
            self.caption_failures[self._figure] = ""
        elif tag == "body":
            self.body = a
        elif tag == "section":
            self._section = a.get("id")
        elif tag == "table" and a.get("class") == "cmp":
            self.tables.append((self._section, a.get("data-metric"),
                                "hidden" in a))
        elif tag == "ul" and a.get("id") == "errors":
            self._in_errors = True
        elif tag == "li" and self._in_errors:
            self.errors.append("")
        elif tag == "script" and a.get("src"):
            self.scripts_with_src.append(a["src"])
        elif tag in ("link", "img", "iframe") or (
                tag == "a" and (a.get("href") or "").startswith("http")):
            self.links.append((tag, a))

    def handle_endtag(self, tag):
        if tag == "ul":
            self._in_errors = False
        elif tag == "figcaption":
            self._in_caption = False
        elif tag == "span":
            self._in_failed = False

    def handle_data(self, data):
        if self._in_caption:
            self.captions[self._figure] += data
        if self._in_failed:
            self.caption_failures[self._figure] += data
        if self._in_errors and self.errors:
            self.errors[-1] += data


def chromium(url, *extra, window="1280,1024"):
    """Runs headless Chromium on url with the project's flags; stdout."""
    profile = tempfile.mkdtemp(prefix="chromium-",
                               dir=os.environ.get("TEST_TMPDIR"))
    try:
        proc = subprocess.run(
            [_CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--user-data-dir=" + profile,
             "--window-size=" + window, "--hide-scrollbars",
             "--virtual-time-budget=5000"] + list(extra) + [url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
            check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0:
        raise AssertionError("chromium exited %d: %s" % (
            proc.returncode, proc.stderr.decode(errors="replace")[-2000:]))
    return proc.stdout.decode("utf-8")


def read_dom(path):
    reader = _DomReader()
    reader.feed(chromium("file://" + path, "--dump-dom"))
    return reader


def assert_charts(test, dom, expected):
    """Every chart of the page is in expected (chart id -> (metric shown,
    series, points)) and drew exactly that."""
    test.assertEqual(sorted(dom.figures), sorted(expected))
    for cid, (metric, series, points) in expected.items():
        fig = dom.figures[cid]
        test.assertEqual((fig.get("data-metric"),
                          fig.get("data-rendered-series"),
                          fig.get("data-rendered-points")),
                         (metric, series, points), cid)


def render_and_read(cls, paths):
    """Builds the page of the result files `paths` (relative to the
    workspace) into a temporary directory and opens it in Chromium: sets
    cls.dir, suites, page, path and dom."""
    cls.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    cls.suites = results.load_all(paths, _WS)
    cls.page = dashboard.render_page(cls.suites, dashboard.find_chartjs(),
                                     paths)
    cls.path = os.path.join(cls.dir, "index.html")
    with open(cls.path, "w", encoding="utf-8") as f:
        f.write(cls.page)
    cls.dom = read_dom(cls.path)


class DashboardTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(_CHROMIUM):
            raise AssertionError(_CHROMIUM + " missing: run tools/setup.sh")
        render_and_read(cls, results.expand(_RESULTS, _WS))

    def test_every_chart_drew_its_series_and_points(self):
        self.assertEqual(sorted(self.dom.figures), sorted(EXPECTED))
        for cid, (series, points) in EXPECTED.items():
            fig = self.dom.figures[cid]
            self.assertEqual(
                (fig.get("data-expected-series"),
                 fig.get("data-expected-points")),
                (str(series), str(points)), cid)
            self.assertEqual(
                (fig.get("data-rendered-series"),
                 fig.get("data-rendered-points")),
                (str(series), str(points)), cid)
            # axes, lines/bars and legend: far more than a blank canvas
            self.assertGreater(int(fig.get("data-painted-pixels", "0")),
                               10000, cid)

    def test_no_script_error(self):
        self.assertEqual(self.dom.errors, [])
        self.assertEqual(self.dom.body.get("data-status"), "rendered")
        self.assertNotIn("data-errors", self.dom.body)

    def test_page_is_self_contained(self):
        # Read from the generated file, not the DOM: nothing is loaded from
        # elsewhere, so the page works from disk without network.
        reader = _DomReader()
        reader.feed(self.page)
        self.assertEqual(reader.scripts_with_src, [])
        self.assertEqual(reader.links, [])
        self.assertIn("Chart.js v4", self.page)

    def test_each_suite_shows_the_table_of_its_chosen_metric(self):
        shown = [(sec, m) for sec, m, hidden in self.dom.tables if not hidden]
        self.assertEqual(shown, [("suite-hint", "seconds"),
                                 ("suite-create_prealloc", "seconds"),
                                 ("suite-prealloc_filter", "MiB_per_s"),
                                 ("suite-subcluster", "IOPS"),
                                 ("suite-engine", "IOPS"),
                                 ("suite-chain", "seconds"),
                                 ("suite-snapshot", "seconds")])
        self.assertEqual(len(self.dom.tables), 4 + 3 + 4 + 4 + 3 + 3 + 5)

    def test_tables_and_context_are_on_the_page(self):
        for text in ["<caption>hint: seconds (s, lower is better)",
                     "<caption>subcluster: IOPS (higher is better)",
                     "<caption>engine: IOPS (higher is better)",
                     "<caption>create_prealloc: allocated_bytes (MiB)",
                     "<th>imgtool_commit</th><td>bad69fb</td><td>c18ac46</td>"]:
            self.assertTrue(text in self.page, text)

    def switch_metric(self, suite, metric, then=""):
        """The DOM of the page plus a script that picks `metric` in the
        suite's selector and then runs the script `then`."""
        probe = os.path.join(self.dir, "probe-%s-%s.html" % (suite, metric))
        script = (
            "<script>"
            "var s = document.querySelector('select[data-suite=%s]');"
            "s.value = '%s';"
            "s.dispatchEvent(new Event('change'));%s"
            "</script></body>" % (suite, metric, then))
        with open(probe, "w", encoding="utf-8") as f:
            f.write(self.page.replace("</body>", script))
        return read_dom(probe)

    def test_metric_switch_redraws_and_errors_are_caught(self):
        # The same page plus a script that switches the hint charts to
        # extents and then throws: the page must redraw and record the
        # error (so test_no_script_error would see one).
        dom = self.switch_metric("hint", "extents",
                                 "throw new Error('probe error');")
        fig = dom.figures["chart-hint-write"]
        self.assertEqual((fig.get("data-metric"),
                          fig.get("data-rendered-series"),
                          fig.get("data-rendered-points")),
                         ("extents", "4", "12"))
        shown = [m for sec, m, hidden in dom.tables
                 if sec == "suite-hint" and not hidden]
        self.assertEqual(shown, ["extents"])
        self.assertEqual(len(dom.errors), 1)
        self.assertIn("probe error", dom.errors[0])

    def test_chain_shows_ratios_to_qemu_img(self):
        # the caption: imgtool's time per command as a ratio of qemu-img's
        # (from the file's means), and the table's line under each cell
        caption = self.dom.captions["chart-chain"]
        self.assertRegex(
            caption, r"^tool:imgtool / tool:qemu-img: rebase [0-9]+\.[0-9]{2}, "
            r"flatten [0-9.]+, commit [0-9.]+, measure [0-9.]+, dd [0-9.]+ "
            r"\(U test: too few repetitions, 2 vs 2\)$")
        chain = dict(self.suites)["chain"][0]
        ours = chain.case("fs:xfs/case:commit/tool:imgtool").metrics[
            "seconds"].mean
        theirs = chain.case("fs:xfs/case:commit/tool:qemu-img").metrics[
            "seconds"].mean
        self.assertIn("commit %.2f" % (ours / theirs), caption)
        # ratios in the caption's colour, not the red of a failure
        self.assertNotIn("chart-chain", self.dom.caption_failures)
        self.assertIn("<caption>chain: max_rss_bytes (MiB, lower is better)",
                      self.page)
        self.assertIn("under each cell: its ratio to tool:qemu-img",
                      self.page)
        dom = self.switch_metric("chain", "max_rss_bytes")
        self.assertEqual(dom.errors, [])
        fig = dom.figures["chart-chain"]
        self.assertEqual((fig.get("data-metric"),
                          fig.get("data-rendered-points")),
                         ("max_rss_bytes", "10"))
        self.assertRegex(dom.captions["chart-chain"],
                         r"^tool:imgtool / tool:qemu-img: rebase [0-9.]+, ")

    def test_engine_lists_imgtool_against_the_ceiling(self):
        # issue 20: per op and depth, imgtool io_uring / the best fio entry,
        # under the engine chart, once per run (run1 and run2: 18 lines
        # each; io_uring: these files have no native entries)
        lines = [l for run in dict(self.suites)["engine"]
                 for l in results.target_lines("engine", run)]
        self.assertEqual(len(lines), 36)
        self.assertRegex(
            lines[0], r"^randread depth 1 on xfs, IOPS: imgtool io_uring "
            r"[0-9,]+ / "
            r"ceiling [0-9,]+ \(fio io_uring\), ratio [0-9]+\.[0-9]{2} "
            r"\(target \u2265 0.95\): (met|MISSED)$")
        block = "".join(
            b.split("</ul>")[0] for b in self.page.split(
                '<ul class="targets" data-suite="engine">')[1:])
        items = block.split("</li>")[:-1]
        self.assertEqual(len(items), 36)
        self.assertIn(html.escape(lines[-1], quote=True), items[-1])

    def test_snapshot_lists_its_targets(self):
        # issue 18's targets under the snapshot chart, one line each, from
        # the medians of run2's file (results.target_lines), marked met or
        # missed; the IOPS view draws only the four bench cases
        snap = dict(self.suites)["snapshot"][0]
        lines = results.target_lines("snapshot", snap)
        self.assertEqual(len(lines), 6)
        self.assertRegex(
            lines[0], r"^snapshot -c time: imgtool [0-9.]+ ms / qemu-img "
            r"[0-9.]+ ms, ratio [0-9]+\.[0-9]{2} \(target \u2264 0.8\): "
            r"(met|MISSED)$")
        self.assertRegex(
            lines[4], r"^bitmap cost in write IOPS, imgtool: [0-9,]+ with / "
            r"[0-9,]+ without, cost -?[0-9.]+% \(target < 3%\): "
            r"(met|MISSED)$")
        self.assertTrue(lines[5].endswith("(for comparison)"), lines[5])
        ours = snap.case("fs:xfs/case:delete/tool:imgtool").medians["seconds"]
        theirs = snap.case("fs:xfs/case:delete/tool:qemu-img").medians[
            "seconds"]
        self.assertIn("ratio %.2f " % (ours / theirs), lines[1])
        block = self.page.split('<ul class="targets" data-suite="snapshot">'
                                )[1].split("</ul>")[0]
        items = block.split("</li>")[:-1]
        self.assertEqual(len(items), 6)
        for item, line in zip(items, lines):
            cls = ("missed" if line.endswith("MISSED") else
                   "met" if line.endswith(": met") else "info")
            self.assertEqual(item, '<li class="%s">%s' % (
                cls, html.escape(line, quote=True)))
        self.assertRegex(self.dom.captions["chart-snapshot"],
                         r"^tool:imgtool / tool:qemu-img: create [0-9.]+, "
                         r"delete [0-9.]+, cow [0-9.]+, ")
        dom = self.switch_metric("snapshot", "IOPS")
        self.assertEqual(dom.errors, [])
        fig = dom.figures["chart-snapshot"]
        self.assertEqual((fig.get("data-metric"),
                          fig.get("data-rendered-series"),
                          fig.get("data-rendered-points")),
                         ("IOPS", "2", "8"))

    def test_bytes_from_backing_in_mib(self):
        # switched to bytes_from_backing, the subcluster axis counts MiB
        # (as report's tables), not raw bytes
        dom = self.switch_metric("subcluster", "bytes_from_backing")
        self.assertEqual(dom.errors, [])
        fig = dom.figures["chart-subcluster"]
        self.assertEqual(fig.get("data-metric"), "bytes_from_backing")
        ticks = fig.get("data-y-ticks").split("|")
        self.assertGreater(len(ticks), 2, ticks)
        self.assertEqual(ticks[0], "0 MiB")
        for t in ticks:
            self.assertRegex(t, r"^[0-9.,]+ MiB$")
        self.assertLess(float(ticks[-1].split()[0].replace(",", "")), 4096)
        self.assertIn("bytes_from_backing (MiB, lower is better)", self.page)

    def test_screenshot(self):
        out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR", self.dir)
        shot = os.path.join(out_dir, "dashboard.png")
        chromium("file://" + self.path, "--screenshot=" + shot,
                 window="1280,3000")
        with open(shot, "rb") as f:
            head = f.read(24)
        self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
        width = int.from_bytes(head[16:20], "big")
        height = int.from_bytes(head[20:24], "big")
        self.assertEqual((width, height), (1280, 3000))


def gb_entry(name, counters, aggregate=None, index=0):
    """One Google Benchmark JSON entry (2 repetitions)."""
    e = {"name": name + ("_" + aggregate if aggregate else ""),
         "run_name": name,
         "run_type": "aggregate" if aggregate else "iteration",
         "repetitions": 2, "iterations": 1, "real_time": 1.0,
         "cpu_time": 1.0, "time_unit": "ms"}
    if aggregate:
        e["aggregate_name"] = aggregate
    else:
        e["repetition_index"] = index
    e.update(counters)
    return e


class FailuresAndUnknownSuitesTest(unittest.TestCase):
    """A failed configuration is a gap plus a caption, not a zero; a suite
    the dashboard has no chart plan for still gets a bar chart."""

    def test_page(self):
        d = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        prealloc = [gb_entry("create_prealloc/fs:ext4/fmt:raw/prealloc:" + p,
                             {"seconds": 0.01 * (i + 1)}, index=r)
                    for i, p in enumerate(["off", "falloc"]) for r in (0, 1)]
        prealloc.append({
            "name": "create_prealloc/fs:ext4/fmt:raw/prealloc:full",
            "run_name": "create_prealloc/fs:ext4/fmt:raw/prealloc:full",
            "run_type": "iteration", "error_occurred": True,
            "error_message": "No space left on device"})
        other = [gb_entry("mysuite/size:%d/mode:%s" % (n, m),
                          {"widgets": float(n)}, index=0)
                 for n in (1, 2, 3) for m in ("a", "b")]
        for name, entries in (("create_prealloc-x.json", prealloc),
                              ("mysuite-x.json", other)):
            with open(os.path.join(d, name), "w") as f:
                json.dump({"context": {"machine": "x"}, "benchmarks": entries},
                          f)
        paths = results.expand(["."], d)
        page = dashboard.render_page(results.load_all(paths, d),
                                     dashboard.find_chartjs(), paths)
        path = os.path.join(d, "index.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
        dom = read_dom(path)
        self.assertEqual(dom.errors, [])
        raw = dom.figures["chart-create_prealloc"]
        self.assertEqual((raw.get("data-rendered-series"),
                          raw.get("data-rendered-points")), ("1", "2"))
        self.assertEqual(dom.captions["chart-create_prealloc"],
                         "Failed configurations: fs:ext4/fmt:raw/"
                         "prealloc:full: No space left on device")
        # that part is the red one (figcaption .failed); ratios are not
        self.assertEqual(dom.caption_failures["chart-create_prealloc"],
                         dom.captions["chart-create_prealloc"])
        self.assertNotIn("chart-mysuite", dom.caption_failures)
        mine = dom.figures["chart-mysuite"]
        # x: the last varying key (mode a/b), series: size 1/2/3
        self.assertEqual((mine.get("data-rendered-series"),
                          mine.get("data-rendered-points")), ("3", "6"))
        self.assertIn('<td class="error">ERROR</td>', page)


class NbdSuiteTest(unittest.TestCase):
    """Issue 19's suite (testdata/benchmarks/full/nbd-vm.json, the full
    run of the README): one chart per part, ratios to qemu-nbd (servers)
    and to nbdcopy (copies), the targets listed under the charts."""

    @classmethod
    def setUpClass(cls):
        render_and_read(cls, ["testdata/benchmarks/full/nbd-vm.json"])

    def test_charts_per_part(self):
        self.assertEqual(self.dom.errors, [])
        # server: qemu-nbd and imgtool over 14 cells (4k random read/write
        # at depth 1/16/64, 1 MiB sequential reads; unix and tcp); local:
        # imgtool over 2 cases; copy: nbdcopy, qemu-img, imgtool over the
        # copies out of the 2 servers
        expected = {"chart-nbd-server": ("IOPS", "2", "28"),
                    "chart-nbd-local": ("IOPS", "1", "2"),
                    "chart-nbd-copy": ("MiB_per_s", "3", "6")}
        assert_charts(self, self.dom, expected)

    def test_ratios_to_qemu_nbd_and_nbdcopy(self):
        run = dict(self.suites)["nbd"][0]
        ours = run.case("fs:xfs/part:server/case:randread_d1_unix/"
                        "tool:imgtool").metrics["IOPS"].mean
        theirs = run.case("fs:xfs/part:server/case:randread_d1_unix/"
                          "tool:qemu-nbd").metrics["IOPS"].mean
        self.assertIn("tool:imgtool / tool:qemu-nbd: randread_d1_unix %.2f" % (
            ours / theirs), self.dom.captions["chart-nbd-server"])
        self.assertRegex(self.dom.captions["chart-nbd-copy"],
                         r"tool:imgtool / tool:nbdcopy: copy_from_qemu-nbd [0-9.]+")

    def test_targets_listed(self):
        run = dict(self.suites)["nbd"][0]
        lines = results.target_lines("nbd", run)
        # 14 server cells, 4 depth-64 cells against local, 2 copies
        self.assertEqual(len(lines), 20)
        self.assertRegex(lines[0], r"^server randread_d1_unix, IOPS: imgtool "
                         r"[0-9,.]+ / qemu-nbd [0-9,.]+, ratio [0-9.]+ "
                         r"\(target ≥ 1\): (met|MISSED)$")
        self.assertRegex(lines[-1], r"^copy_from_imgtool time, imgtool "
                         r"convert against nbdcopy: imgtool .* / nbdcopy .*, "
                         r"ratio [0-9.]+ \(target ≤ 1\): (met|MISSED)$")
        block = self.page.split('<ul class="targets" data-suite="nbd">')[1]
        self.assertEqual(block.split("</ul>")[0].count("<li"), 20)


class EngineSuiteTest(unittest.TestCase):
    """Issue 20 part 1's suite as run in full (testdata/benchmarks/full/
    engine-vm.json: session 27, quiet machine, XFS and ext4): one chart
    per filesystem and op, imgtool's 3 engines and fio's 5 configurations
    over depths 1..256, and the 36 target lines (imgtool native, the
    default for O_DIRECT files, against the best fio median of each cell)
    with their exact figures."""

    @classmethod
    def setUpClass(cls):
        render_and_read(cls, ["testdata/benchmarks/full/engine-vm.json"])

    def test_charts_per_filesystem_and_op(self):
        self.assertEqual(self.dom.errors, [])
        expected = {"chart-engine-%s-%s" % (fs, op): ("IOPS", "8", "72")
                    for fs in ("xfs", "ext4")
                    for op in ("randread", "randwrite")}
        assert_charts(self, self.dom, expected)

    def test_targets_against_the_best_fio_configuration(self):
        lines = results.target_lines("engine", dict(self.suites)["engine"][0])
        self.assertEqual(len(lines), 36)
        # medians of the file's 5 repetitions, checked by hand
        self.assertEqual(
            lines[0], "randread depth 1 on xfs, IOPS: imgtool native "
            "60,582 / ceiling 57,981 (fio io_uring_sqthread_poll), ratio "
            "1.04 (target \u2265 0.95): met")
        self.assertEqual(
            lines[-1], "randwrite depth 256 on ext4, IOPS: imgtool native "
            "174,390 / ceiling 165,134 (fio io_uring_fixedbufs), ratio 1.06 "
            "(target \u2265 0.95): met")
        self.assertEqual(sum(l.endswith(": met") for l in lines), 31)
        block = self.page.split(
            '<ul class="targets" data-suite="engine">')[1].split("</ul>")[0]
        self.assertEqual(block.count("<li"), 36)


class SignificanceTest(unittest.TestCase):
    """The U test on the page: testdata/benchmarks/full/snapshot-vm.json
    has 5 repetitions per case, so every ratio to qemu-img gets its p value
    (in the chart's caption and under each table cell); run2's 2
    repetitions are too few (test_chain_shows_ratios_to_qemu_img)."""

    @classmethod
    def setUpClass(cls):
        render_and_read(cls, ["testdata/benchmarks/full/snapshot-vm.json"])

    def test_caption_gives_each_ratio_its_p_value(self):
        self.assertEqual(self.dom.errors, [])
        self.assertEqual(
            self.dom.captions["chart-snapshot"],
            "tool:imgtool / tool:qemu-img: "
            "create 1.03 (p=0.84 not significant), "
            "delete 2.63 (p=0.056 not significant), "
            "cow 0.13 (p=0.0079 significant), "
            "cow_extl2 0.14 (p=0.0079 significant), "
            "write 0.78 (p=0.0079 significant), "
            "write_bitmap 0.63 (p=0.0079 significant)")

    def test_table_cells_marked(self):
        # the seconds table (shown): each ratio with its test, a class
        # for the page's style (significant: bold; noise: faint)
        self.assertIn(
            '<td class="worse noise">2.63x<span class="utest">p=0.056 not '
            'significant</span></td>', self.page)
        self.assertIn(
            '<td class="better significant">0.13x<span class="utest">'
            'p=0.0079 significant</span></td>', self.page)
        self.assertIn("each change: Mann-Whitney U test (two-sided)",
                      self.page)


class SideBySideTest(unittest.TestCase):
    """The side-by-side scripts' result files (sbs_results.py), recorded
    by one QUICK=1 run of each script (testdata/benchmarks/sbs, 4
    repetitions per tool and cell): bars per tool next to the suites, each
    bar's ratio to qemu-img with its U test in the caption."""

    @classmethod
    def setUpClass(cls):
        render_and_read(cls, results.expand(["testdata/benchmarks/sbs"], _WS))

    def test_every_script_has_its_charts(self):
        self.assertEqual(self.dom.errors, [])
        self.assertEqual(self.dom.body.get("data-status"), "rendered")
        self.assertEqual([s for s, _ in self.suites], [
            "side_by_side", "subcluster_side_by_side",
            "prealloc_side_by_side", "chain_side_by_side",
            "startup_side_by_side", "reqcost_side_by_side"])
        assert_charts(self, self.dom, SBS_EXPECTED)
        for cid in SBS_EXPECTED:
            self.assertGreater(int(self.dom.figures[cid].get(
                "data-painted-pixels", "0")), 10000, cid)

    def test_captions_give_ratios_to_qemu_img_with_the_u_test(self):
        for cid, caption in SBS_CAPTIONS.items():
            self.assertEqual(self.dom.captions[cid], caption, cid)

    def test_targets_listed_per_cell(self):
        # issue 20: imgtool >= qemu-img in every cell, with the U test
        for suite in ("subcluster_side_by_side", "prealloc_side_by_side"):
            run = dict(self.suites)[suite][0]
            lines = results.target_lines(suite, run)
            self.assertEqual(len(lines), 4, suite)
            block = self.page.split(
                '<ul class="targets" data-suite="%s">' % suite)[1].split(
                    "</ul>")[0]
            self.assertEqual(block, "".join(
                '<li class="met">%s</li>' % html.escape(l, quote=True)
                for l in lines), suite)
        self.assertEqual(
            results.target_lines("subcluster_side_by_side", dict(
                self.suites)["subcluster_side_by_side"][0])[3],
            "cluster:2M/extended_l2:on, IOPS: imgtool 446 / qemu-img 306, "
            "ratio 1.46, p=0.029 significant (target \u2265 1): met")
        # issue 20 part 2: start to exit at most qemu-img's time (medians)
        lines = results.target_lines("startup_side_by_side", dict(
            self.suites)["startup_side_by_side"][0])
        self.assertEqual(len(lines), 5)
        self.assertEqual(
            lines[0], "cmd:info, seconds: imgtool 27.1 ms / qemu-img 51.3 ms, "
            "ratio 0.53, p=0.029 significant (target \u2264 1): met")

    def test_reqcost_targets_per_engine_and_against_the_ceiling(self):
        # issue 20 part 1: imgtool >= qemu-img with the same engine, and
        # imgtool's default engine >= 0.95 of the best fio median of the
        # cell (the ceiling, derived from the fio entries)
        run = dict(self.suites)["reqcost_side_by_side"][0]
        lines = results.target_lines("reqcost_side_by_side", run)
        # (3 engines + ceiling) x 2 depths x 2 step cases, ceiling only x
        # 2 depths x 2 random cases
        self.assertEqual(len(lines), 20)
        self.assertEqual(
            lines[4], "case:write_step12k/depth:64, engine native, IOPS: "
            "imgtool 66,972 / qemu-img 26,470, ratio 2.53, p=0.029 "
            "significant (target \u2265 1): met")
        self.assertEqual(
            lines[19], "case:randread/depth:64, IOPS: imgtool native "
            "48,346 / ceiling 56,573 (fio io_uring), ratio 0.85 (target "
            "\u2265 0.95): MISSED")
        block = self.page.split(
            '<ul class="targets" data-suite="reqcost_side_by_side">')[1]
        self.assertEqual(block.count("<li "), 20)

    def test_one_ratio_by_hand(self):
        # the caption's figures are the files' means and results.utest of
        # the 4 runs per tool
        run = dict(self.suites)["subcluster_side_by_side"][0]
        ours = run.case("fs:xfs/cluster:65536/extended_l2:on/tool:imgtool")
        theirs = run.case(
            "fs:xfs/cluster:65536/extended_l2:on/tool:qemu-img")
        self.assertEqual(len(ours.samples["IOPS"]), 4)
        self.assertIn("64k %.2f (%s)" % (
            ours.metrics["IOPS"].mean / theirs.metrics["IOPS"].mean,
            results.utest(theirs, ours, "IOPS").text()),
            self.dom.captions["chart-subcluster_side_by_side-on"])


class LogScaleBarsTest(unittest.TestCase):
    """On a logarithmic axis a bar starts at the axis' bottom: the smallest
    bar must still have a height. The full run's hint map times span
    1.7 us (xfs, 8M hint) to 24 ms; before the axis got a bottom below the
    smallest value, that bar had no height and looked missing (the page
    now counts a bar as drawn only if it has a visible height)."""

    def test_smallest_bar_is_visible(self):
        d = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        paths = ["testdata/benchmarks/full/hint-vm.json"]
        suites = results.load_all(paths, _WS)
        model = dashboard.build_model(suites)
        chart = [c for c in model["suites"][0]["charts"]
                 if c["id"] == "chart-hint-map"][0]
        seconds = chart["by_metric"]["seconds"]
        self.assertTrue(seconds["log"])
        # smallest mean 1.7e-6 s: the axis starts at 1e-6 s
        self.assertEqual(seconds["y_min"], 1e-6)
        path = os.path.join(d, "index.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(dashboard.render_page(suites, dashboard.find_chartjs(),
                                          paths))
        dom = read_dom(path)
        self.assertEqual(dom.errors, [])
        fig = dom.figures["chart-hint-map"]
        self.assertEqual((fig.get("data-expected-points"),
                          fig.get("data-rendered-points")), ("6", "6"))
        # labelled in the user's units, powers of ten without `.0`
        self.assertEqual(fig.get("data-y-ticks"),
                         "1 µs|10 µs|100 µs|1 ms|10 ms")

    def test_axis_bottom_is_below_a_power_of_ten(self):
        # extents 1 .. 100: the bottom is 0.1, not 1 (the 1 bar is seen)
        series = [{"data": [1.0, None, 100.0]}]
        self.assertEqual(dashboard._log_min(series), 0.1)
        self.assertEqual(dashboard._log_min([{"data": [3.5, 900.0]}]), 1.0)


class ModelTest(unittest.TestCase):

    def test_selector_names_what_the_charts_draw(self):
        # every IOPS NaN (0/0): the charts draw seconds, and so must the
        # selector say (it said IOPS over seconds charts)
        d = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        entries = [gb_entry("subcluster/fs:xfs/cluster:%d/extended_l2:off" % c,
                            {"IOPS": math.nan, "seconds": 0.5}, index=i)
                   for c in (65536, 131072) for i in (0, 1)]
        with open(os.path.join(d, "subcluster-x.json"), "w") as f:
            json.dump({"context": {}, "benchmarks": entries}, f)
        model = dashboard.build_model(
            results.load_all(["subcluster-x.json"], d))
        suite = model["suites"][0]
        self.assertEqual(suite["default_metric"], "seconds")
        self.assertEqual([c["default_metric"] for c in suite["charts"]],
                         ["seconds"])

    def test_engine_charts_per_filesystem_and_op(self):
        # issue 20 part 1: the engine suite on XFS and ext4 in one file:
        # one chart per (fs, op), each with imgtool io_uring and fio's two
        # engines (the ceiling) over depths 1 and 16; the fs is in the
        # chart's title, not in its series' names
        d = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        entries = [
            gb_entry("engine/fs:%s/op:%s/engine:%s/depth:%d/tool:%s" % (
                fs, op, engine, depth, tool), {"IOPS": 1000.0 * depth + i},
                index=i)
            for fs in ("xfs", "ext4") for op in ("randread", "randwrite")
            for engine, tool in (("io_uring", "imgtool"), ("io_uring", "fio"),
                                 ("libaio", "fio"))
            for depth in (1, 16) for i in (0, 1)]
        with open(os.path.join(d, "engine-x.json"), "w") as f:
            json.dump({"context": {}, "benchmarks": entries}, f)
        model = dashboard.build_model(results.load_all(["engine-x.json"], d))
        charts = model["suites"][0]["charts"]
        self.assertEqual(
            [(c["id"], c["title"]) for c in charts],
            [("chart-engine-xfs-randread", "engine: fs:xfs/op:randread"),
             ("chart-engine-xfs-randwrite", "engine: fs:xfs/op:randwrite"),
             ("chart-engine-ext4-randread", "engine: fs:ext4/op:randread"),
             ("chart-engine-ext4-randwrite", "engine: fs:ext4/op:randwrite")])
        for c in charts:
            self.assertEqual(
                [(s["label"], s["data"])
                 for s in c["by_metric"]["IOPS"]["series"]],
                [("engine:io_uring/tool:imgtool", [1000.5, 16000.5]),
                 ("engine:io_uring/tool:fio (ceiling)", [1000.5, 16000.5]),
                 ("engine:libaio/tool:fio (ceiling)", [1000.5, 16000.5])],
                c["id"])


class CommandLineTest(unittest.TestCase):

    def test_unknown_by_key_is_one_line_error(self):
        # report says the same; the page would silently lack its tables
        d = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        err = io.StringIO()
        old = os.environ.get("BUILD_WORKING_DIRECTORY")
        os.environ["BUILD_WORKING_DIRECTORY"] = _WS
        try:
            with contextlib.redirect_stderr(err):
                rc = dashboard.main(["testdata/benchmarks/run2/hint-vm.json",
                                     "--by", "clustr", "--out", d])
        finally:
            if old is None:
                del os.environ["BUILD_WORKING_DIRECTORY"]
            else:
                os.environ["BUILD_WORKING_DIRECTORY"] = old
        self.assertEqual((rc, err.getvalue()), (
            1, "dashboard: no result has the key \"clustr\" in its benchmark "
            "names (keys: fs, hint, op)\n"))
        self.assertEqual(os.listdir(d), [])


class FindChartjsTest(unittest.TestCase):

    def test_missing_explicit_file_is_one_clear_error(self):
        with self.assertRaises(dashboard.DashboardError) as cm:
            dashboard.find_chartjs("/nonexistent/chart.umd.js")
        self.assertEqual(str(cm.exception),
                         "/nonexistent/chart.umd.js: Chart.js file not found")


class AdviseTest(unittest.TestCase):
    """`imgtool advise --output=json` on XFS, ext4 and ext4 without
    extents (testdata/benchmarks/advise, benchmarks/advise_filesystems.sh):
    one chart per workload, a series per file (filesystem), a bar per
    configuration the runs measured; the create table's chart shows
    seconds (it has no IOPS)."""

    @classmethod
    def setUpClass(cls):
        render_and_read(cls, [
            "testdata/benchmarks/advise/%s/advise-vm.json" % fs
            for fs in ("xfs", "ext4", "ext4_noextents")])

    def test_one_chart_per_workload(self):
        self.assertEqual(self.dom.errors, [])
        self.assertEqual(self.dom.body.get("data-status"), "rendered")
        self.assertEqual([s for s, _ in self.suites], ["advise"])
        runs = dict(self.suites)["advise"]
        self.assertEqual(sorted(r.context["filesystems"] for r in runs),
                         ["ext4", "ext4_noextents", "xfs"])
        expected = {}
        for w in ("create", "random-4k", "sequential", "overlay"):
            configs = set()
            points = 0
            for r in runs:
                cases = [c for c in r.cases if c.value("workload") == w and
                         c.error is None]
                configs |= set(c.value("config") for c in cases)
                points += len(cases)
            expected["chart-advise-" + w] = (
                "seconds" if w == "create" else "IOPS", "3", str(points))
        assert_charts(self, self.dom, expected)


if __name__ == "__main__":
    unittest.main()
