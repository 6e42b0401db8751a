"""Tests of //benchmarks:report: exact text on the real result files in
testdata/benchmarks (run1: commit bad69fb, run2: commit c18ac46), and exact
figures on small hand-made files.

report_test_expected.txt holds commands (`$ report ARGS`, run from the
workspace root as `bazel run //benchmarks:report -- ARGS`), each followed by
its exact output (checked by hand against the JSON files).
"""

import contextlib
import difflib
import io
import json
import os
import shlex
import tempfile
import unittest

from benchmarks import report
from benchmarks import results

_WS = os.path.join(os.environ.get("TEST_SRCDIR", ""),
                   os.environ.get("TEST_WORKSPACE", ""))


def run_report(argv, cwd):
    """Runs report.main with BUILD_WORKING_DIRECTORY=cwd: (rc, out, err)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("BUILD_WORKING_DIRECTORY")
    os.environ["BUILD_WORKING_DIRECTORY"] = cwd
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = report.main(argv)
    finally:
        if old is None:
            del os.environ["BUILD_WORKING_DIRECTORY"]
        else:
            os.environ["BUILD_WORKING_DIRECTORY"] = old
    return rc, out.getvalue(), err.getvalue()


def gb_entry(name, counters, run_type="iteration", aggregate=None, reps=3,
             index=0):
    """One Google Benchmark 1.7.1 JSON entry with user counters."""
    e = {"name": name + ("_" + aggregate if aggregate else ""),
         "run_name": name, "run_type": run_type, "repetitions": reps,
         "threads": 1, "iterations": 1, "real_time": 5.0, "cpu_time": 1.0,
         "time_unit": "ms"}
    if aggregate:
        e["aggregate_name"] = aggregate
        e["aggregate_unit"] = "percentage" if aggregate == "cv" else "time"
    else:
        e["repetition_index"] = index
    e.update(counters)
    return e


class ReportTextTest(unittest.TestCase):

    def test_exact_text_on_testdata(self):
        with open(os.path.join(_WS, "benchmarks",
                               "report_test_expected.txt"),
                  encoding="utf-8") as f:
            expected = f.read()
        commands = [l[len("$ report "):] for l in expected.splitlines()
                    if l.startswith("$ report ")]
        self.assertGreaterEqual(len(commands), 3)
        got = ""
        for args in commands:
            rc, out, err = run_report(shlex.split(args), _WS)
            self.assertEqual((rc, err), (0, ""), args)
            got += "$ report %s\n%s" % (args, out)
        if got != expected:
            diff = "".join(difflib.unified_diff(
                expected.splitlines(True), got.splitlines(True),
                "report_test_expected.txt", "report output"))
            self.fail("report text differs:\n" + diff)


class ReportFiguresTest(unittest.TestCase):
    maxDiff = None

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

    def write(self, name, benchmarks, **context):
        ctx = {"host_name": "vm", "date": "2026-12-01T10:00:00+00:00"}
        ctx.update(context)
        with open(os.path.join(self.dir, name), "w") as f:
            json.dump({"context": ctx, "benchmarks": benchmarks}, f)
        return name

    def test_mean_rsd_from_iterations_and_change_against_first(self):
        # A: iterations only (no aggregates): 100, 110, 120 -> mean 110,
        # sample stddev 10 (9.09 %); 50, 50 -> 50.0 ± 0 %.
        # B: aggregates mean 121, stddev 2.42 (2 %); no 4k case.
        on = "subcluster/fs:xfs/cluster:65536/extended_l2:on"
        off = "subcluster/fs:xfs/cluster:4096/extended_l2:off"
        a = self.write("subcluster-a.json", [
            gb_entry(on, {"IOPS": v}, index=i)
            for i, v in enumerate([100.0, 110.0, 120.0])] + [
            gb_entry(off, {"IOPS": 50.0}, index=i, reps=2) for i in (0, 1)],
            machine="a", imgtool_commit="1111111")
        b = self.write("subcluster-b.json", [
            gb_entry(on, {"IOPS": 121.0}, "aggregate", "mean"),
            gb_entry(on, {"IOPS": 2.42}, "aggregate", "stddev")],
            machine="b", imgtool_commit="2222222")
        rc, out, err = run_report([a, b], self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, (
            "== subcluster: IOPS (higher is better)\n"
            "   A: subcluster-a.json (a, commit 1111111, "
            "2026-12-01T10:00:00+00:00)\n"
            "   B: subcluster-b.json (b, commit 2222222, "
            "2026-12-01T10:00:00+00:00)\n"
            "   every row: fs:xfs\n"
            # B has aggregates only: no repetitions for the U test
            "   U test: too few repetitions to decide (3 vs 0; at least 4 "
            "on each side needed)\n"
            "\n"
            "                            A          B\n"
            "--------------------------  ---------  --------\n"
            "cluster:64k/extended_l2:on  110 ± 9%   121 ± 2%\n"
            "                                       +10%\n"
            "cluster:4k/extended_l2:off  50.0 ± 0%  -\n"))

    def test_engine_ceiling_is_the_best_fio_entry_per_fs_op_and_depth(self):
        # xfs depth 1: fio io_uring 100, libaio 200, sqthread_poll failed
        # (an error entry is no ceiling): ceiling 200 (libaio), imgtool
        # native (the default for O_DIRECT files) 190 -> 0.95 met;
        # io_uring's 500 is not the default engine.
        # xfs depth 2: no imgtool native entry -> not measured.
        # ext4 depth 1: its own ceiling (fio io_uring 400; xfs's libaio 200
        # is another filesystem's), imgtool 300 -> 0.75 missed.
        base = "engine/fs:%s/op:randread/engine:%s/depth:%d/tool:%s"
        err = gb_entry(base % ("xfs", "io_uring_sqthread_poll", 1, "fio"), {})
        err["error_occurred"] = True
        err["error_message"] = "fio: job failed"
        entries = [
            gb_entry(base % ("xfs", "native", 1, "imgtool"), {"IOPS": 190.0}),
            gb_entry(base % ("xfs", "io_uring", 1, "imgtool"), {"IOPS": 500.0}),
            gb_entry(base % ("xfs", "io_uring", 1, "fio"), {"IOPS": 100.0}),
            gb_entry(base % ("xfs", "libaio", 1, "fio"), {"IOPS": 200.0}),
            err,
            gb_entry(base % ("xfs", "io_uring_fixedbufs", 2, "fio"),
                     {"IOPS": 300.0}),
            gb_entry(base % ("xfs", "io_uring", 2, "imgtool"),
                     {"IOPS": 300.0}),
            gb_entry(base % ("ext4", "native", 1, "imgtool"),
                     {"IOPS": 300.0}),
            gb_entry(base % ("ext4", "io_uring", 1, "fio"), {"IOPS": 400.0}),
            gb_entry(base % ("ext4", "libaio", 1, "fio"), {"IOPS": 150.0})]
        name = self.write("engine-vm.json", entries)
        run = results.load_all([os.path.join(self.dir, name)], self.dir)
        self.assertEqual(results.target_lines("engine", run[0][1][0]), [
            "randread depth 1 on xfs, IOPS: imgtool native 190 / ceiling "
            "200 (fio libaio), ratio 0.95 (target \u2265 0.95): met",
            "randread depth 2 on xfs, IOPS: imgtool native - / ceiling 300 "
            "(fio io_uring_fixedbufs), ratio - (target \u2265 0.95): "
            "not measured",
            "randread depth 1 on ext4, IOPS: imgtool native 300 / ceiling "
            "400 (fio io_uring), ratio 0.75 (target \u2265 0.95): MISSED"])
        self.assertEqual(
            results.target_lines("engine", run[0][1][0], ["seconds"]), [])
        # A file without imgtool native entries (before the native engine
        # was measured): io_uring, the default then.
        old = self.write("engine-old.json", [
            e for e in entries if "engine:native" not in e["name"]])
        run = results.load_all([os.path.join(self.dir, old)], self.dir)
        self.assertEqual(results.target_lines("engine", run[0][1][0])[:2], [
            "randread depth 1 on xfs, IOPS: imgtool io_uring 500 / ceiling "
            "200 (fio libaio), ratio 2.50 (target \u2265 0.95): met",
            "randread depth 2 on xfs, IOPS: imgtool io_uring 300 / ceiling "
            "300 (fio io_uring_fixedbufs), ratio 1.00 (target \u2265 0.95): "
            "met"])

    def test_columns_by_key_with_errors_and_missing_cells(self):
        name = self.write("create_prealloc-vm.json", [
            gb_entry("create_prealloc/fs:xfs/prealloc:off",
                     {"seconds": 0.002}, reps=1),
            gb_entry("create_prealloc/fs:xfs/prealloc:full",
                     {"seconds": 0.5}, reps=1),
            gb_entry("create_prealloc/fs:ext4/prealloc:off",
                     {"seconds": 0.004}, reps=1),
            {"name": "create_prealloc/fs:ext4/prealloc:full",
             "run_name": "create_prealloc/fs:ext4/prealloc:full",
             "run_type": "iteration", "error_occurred": True,
             "error_message": "No space left on device"},
        ])
        rc, out, _ = run_report([name, "--by", "prealloc"], self.dir)
        self.assertEqual(rc, 0)
        self.assertEqual(out, (
            "== create_prealloc: seconds (s, lower is better)\n"
            "   create_prealloc-vm.json (vm, 2026-12-01T10:00:00+00:00)\n"
            "   U test: too few repetitions to decide (1 vs 1; at least 4 "
            "on each side needed)\n"
            "\n"
            "         prealloc:off  prealloc:full\n"
            "-------  ------------  -------------\n"
            "fs:xfs   2 ms          500 ms\n"
            "                       +24900%\n"
            "fs:ext4  4 ms          ERROR\n"))

    def test_nan_counters_read_as_no_value(self):
        # Google Benchmark writes a bare NaN for 0/0 (e.g. the cv of a zero
        # mean). A NaN stddev gives no ± part; a metric whose only value is
        # a NaN mean gets no table.
        name = "subcluster/fs:xfs/cluster:65536/extended_l2:on"
        text = json.dumps({"context": {}, "benchmarks": [
            gb_entry(name, {"IOPS": 5.0, "odd": "NaN"}, "aggregate", "mean"),
            gb_entry(name, {"IOPS": "NaN", "odd": 1.0}, "aggregate",
                     "stddev")]})
        with open(os.path.join(self.dir, "nan.json"), "w") as f:
            f.write(text.replace('"NaN"', "NaN"))
        rc, out, err = run_report(["nan.json", "--by", "extended_l2"],
                                  self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, (
            "== subcluster: IOPS (higher is better)\n"
            "   nan.json (?)\n"
            "\n"
            "                    extended_l2:on\n"
            "------------------  --------------\n"
            "fs:xfs/cluster:64k  5\n"))

    def test_percent_change_keeps_small_fractions(self):
        self.assertEqual(results.percent_change(3.37e-6, 1.43e-3), "-99.8%")
        self.assertEqual(results.percent_change(1.0, 100000.0), "-100.00%")
        self.assertEqual(results.percent_change(0.0, 5.0), "-100%")
        self.assertEqual(results.percent_change(5.0, 0.0), "--")
        self.assertEqual(results.percent_change(105.0, 100.0), "+5%")

    def test_bad_files_fail_with_one_line_naming_the_file(self):
        with open(os.path.join(self.dir, "broken.json"), "w") as f:
            f.write("{not json")
        self.write("empty.json", [])
        with open(os.path.join(self.dir, "list.json"), "w") as f:
            f.write("[1, 2]")
        cases = {
            "broken.json": "report: broken.json: not JSON: ",
            "empty.json": "report: empty.json: no benchmarks in the file\n",
            "list.json": "report: list.json: not Google Benchmark JSON "
                         "(no \"benchmarks\" list)\n",
            "missing.json": "report: missing.json: cannot read: "
                            "No such file or directory\n",
        }
        for name, message in cases.items():
            rc, out, err = run_report([name], self.dir)
            self.assertEqual((rc, out), (1, ""), name)
            self.assertTrue(err.startswith(message), err)
            self.assertEqual(err.count("\n"), 1, err)

    def test_unknown_by_key_says_so(self):
        name = self.write("hint-vm.json", [
            gb_entry("hint/fs:xfs/hint:0/op:write", {"seconds": 1.0})])
        rc, out, err = run_report([name, "--by", "cluster"], self.dir)
        self.assertEqual((rc, out, err), (
            1, "", "report: no result has the key \"cluster\" in its "
            "benchmark names (keys: fs, hint, op)\n"))
        # a key of some suites only: the others say so in the output
        other = self.write("subcluster-vm.json", [
            gb_entry("subcluster/fs:xfs/cluster:65536", {"IOPS": 1.0})])
        rc, out, err = run_report([name, other, "--by", "cluster"],
                                  self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertTrue(out.startswith(
            "== hint: no key \"cluster\" in its benchmark names\n"), out)

    def test_legend_keeps_a_dirty_commit_whole(self):
        # the runner writes `abc1234-dirty` for a tree with changes; a full
        # hash is shortened to 12 digits
        for commit, shown in (("abc1234-dirty", "abc1234-dirty"),
                              ("0123456789abcdef0123", "0123456789ab")):
            name = self.write("hint-vm.json", [
                gb_entry("hint/fs:xfs/hint:0/op:write", {"seconds": 1.0})],
                imgtool_commit=commit)
            rc, out, _ = run_report([name], self.dir)
            self.assertEqual(rc, 0)
            self.assertIn("   hint-vm.json (vm, commit %s, 2026-12-01" % shown,
                          out)

    def test_legend_marks_quick_and_fastbuild_runs(self):
        # a --quick run's figures (small sizes) do not compare with a full
        # run's: the legend says which column is one
        name = self.write("hint-vm.json", [
            gb_entry("hint/fs:xfs/hint:0/op:write", {"seconds": 1.0})],
            quick="true", build="fastbuild", imgtool_commit="abc1234")
        rc, out, _ = run_report([name], self.dir)
        self.assertEqual(rc, 0)
        self.assertIn("   hint-vm.json (vm, commit abc1234, "
                      "2026-12-01T10:00:00+00:00, --quick, fastbuild)\n", out)

    def test_bytes_from_backing_in_mib(self):
        # the copy-on-write bytes read from the backing file, in MiB
        name = self.write("subcluster-vm.json", [
            gb_entry("subcluster/fs:xfs/cluster:65536/extended_l2:" + x,
                     {"bytes_from_backing": float(b)}, index=i)
            for x, b in (("off", 3 << 20), ("on", 1 << 19)) for i in (0, 1)])
        rc, out, err = run_report([name, "--metric", "bytes_from_backing"],
                                  self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, (
            "== subcluster: bytes_from_backing (MiB, lower is better)\n"
            "   subcluster-vm.json (vm, 2026-12-01T10:00:00+00:00)\n"
            "   every row: fs:xfs/cluster:64k\n"
            "   U test: too few repetitions to decide (2 vs 2; at least 4 "
            "on each side needed)\n"
            "\n"
            "       extended_l2:off  extended_l2:on\n"
            "-----  ---------------  --------------\n"
            "(all)  3 ± 0%           0.5 ± 0%\n"
            "                        -83%\n"))

    def test_unknown_metric_says_so(self):
        # a typo (iops for IOPS) printed nothing and exited 0
        name = self.write("hint-vm.json", [
            gb_entry("hint/fs:xfs/hint:0/op:write", {"seconds": 1.0,
                                                     "extents": 3.0})])
        rc, out, err = run_report([name, "--metric", "iops"], self.dir)
        self.assertEqual((rc, out, err), (
            1, "", "report: no result has the metric \"iops\" (metrics: "
            "seconds, extents)\n"))

    def test_infinite_values_are_no_value(self):
        # Google Benchmark writes Infinity for x/0 (e.g. IOPS of a phase
        # that took no measurable time); Python's json reads it. An
        # infinite stddev gives no ± part, an infinite run no value.
        a = "subcluster/fs:xfs/cluster:65536/extended_l2:off"
        b = "subcluster/fs:xfs/cluster:65536/extended_l2:on"
        text = json.dumps({"context": {}, "benchmarks": [
            gb_entry(a, {"IOPS": 5.0}, "aggregate", "mean"),
            gb_entry(a, {"IOPS": "Infinity"}, "aggregate", "stddev"),
            gb_entry(b, {"IOPS": "Infinity"}, index=0),
            gb_entry(b, {"IOPS": 7.0}, index=1)]})
        with open(os.path.join(self.dir, "inf.json"), "w") as f:
            f.write(text.replace('"Infinity"', "Infinity"))
        rc, out, err = run_report(["inf.json"], self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, (
            "== subcluster: IOPS (higher is better)\n"
            "   inf.json (?)\n"
            "   every row: fs:xfs/cluster:64k\n"
            "\n"
            "       extended_l2:off  extended_l2:on\n"
            "-----  ---------------  --------------\n"
            "(all)  5                -\n"))

    def test_corrupt_entries_and_mixed_suites_fail_naming_the_file(self):
        name = "hint/fs:xfs/hint:0/op:write"
        good = gb_entry(name, {"seconds": 1.0})
        cases = {
            "runname.json": ([dict(good, run_name=5)],
                             "report: runname.json: benchmark \"%s\": "
                             "run_name is not a string\n" % name),
            "aggname.json": ([dict(gb_entry(name, {"seconds": 1.0},
                                            "aggregate", "mean"),
                                   aggregate_name=["mean"])],
                             "report: aggname.json: benchmark \"%s_mean\": "
                             "aggregate_name is not a string\n" % name),
            "entry.json": ([good, 7],
                           "report: entry.json: benchmark entry 2 is not "
                           "an object\n"),
            "noname.json": ([dict(good, name="/fs:xfs", run_name="")],
                            "report: noname.json: a benchmark entry has no "
                            "name\n"),
        }
        for fname, (entries, message) in cases.items():
            self.write(fname, entries)
            rc, out, err = run_report([fname], self.dir)
            self.assertEqual((rc, out, err), (1, "", message), fname)
        # one file per suite: a hint file with engine entries merged in
        with open(os.path.join(self.dir, "hint-m.json"), "w") as f:
            json.dump({"context": {"suite": "hint"}, "benchmarks": [
                good, gb_entry("engine/op:randread", {"IOPS": 1.0})]}, f)
        rc, out, err = run_report(["hint-m.json"], self.dir)
        self.assertEqual((rc, out, err), (
            1, "", "report: hint-m.json: context suite \"hint\" but "
            "benchmarks of suite \"engine\"\n"))
        with open(os.path.join(self.dir, "deep.json"), "w") as f:
            f.write("[" * 100000 + "]" * 100000)
        rc, out, err = run_report(["deep.json"], self.dir)
        self.assertEqual((rc, out, err), (
            1, "", "report: deep.json: not JSON: nested too deeply\n"))


class MannWhitneyTest(unittest.TestCase):
    """results.mann_whitney_u against scipy.stats.mannwhitneyu's documented
    values and hand-computed cases (scipy is not installed here)."""

    def test_scipy_documentation_example(self):
        # scipy.stats.mannwhitneyu docs (1.7+): males [19, 22, 16, 29, 24],
        # females [20, 11, 17, 12]: U1 = 17.0, exact two-sided p =
        # 0.1111111111111111 (14 of the 126 orderings are as extreme);
        # method="asymptotic": p = 0.11134688653314041 (ours differs in the
        # 16th digit: erfc against scipy's normal survival function).
        males, females = [19, 22, 16, 29, 24], [20, 11, 17, 12]
        self.assertEqual(results.mann_whitney_u(males, females),
                         (17.0, 0.1111111111111111))
        u, p = results.mann_whitney_u(males, females, "asymptotic")
        self.assertEqual(u, 17.0)
        self.assertAlmostEqual(p, 0.11134688653314041, places=14)

    def test_exact_smallest_p_values(self):
        # completely separated samples: U = 0, p = 2 / C(n1 + n2, n1)
        self.assertEqual(results.mann_whitney_u([1, 2, 3], [4, 5, 6]),
                         (0.0, 0.1))  # 2/20: never below 0.05
        self.assertEqual(results.mann_whitney_u([1, 2, 3, 4], [5, 6, 7, 8]),
                         (0.0, 2 / 70))
        self.assertEqual(results.mann_whitney_u([6, 7, 8, 9, 10],
                                                [1, 2, 3, 4, 5]),
                         (25.0, 2 / 252))
        # one inversion among 5 vs 5: U = 24 (or 1); 2 of the 252
        # orderings have U >= 24, so p = 4/252
        self.assertEqual(results.mann_whitney_u([1, 2, 3, 4, 6],
                                                [5, 7, 8, 9, 10]),
                         (1.0, 4 / 252))
        # the exact null distribution of U for 2 vs 2: 1 1 2 1 1
        self.assertEqual(results._exact_u_counts(2, 2), [1, 1, 2, 1, 1])

    def test_ties_use_the_normal_approximation(self):
        # x = [1, 2, 2, 3], y = [2, 3, 4, 5]. Pooled ranks: 1 -> 1, the
        # three 2s -> 3, the two 3s -> 5.5, 4 -> 7, 5 -> 8; R1 = 1 + 3 + 3
        # + 5.5 = 12.5, U1 = 12.5 - 4*5/2 = 2.5, U2 = 13.5. Tie term
        # ((27-3) + (8-2)) / (8*7) = 30/56; variance 16/12 * (9 - 30/56) =
        # 11.285714; z = (13.5 - 8 - 0.5) / sqrt(11.285714) = 1.488351;
        # p = 2 * (1 - Phi(1.488351)) = 0.136658.
        u, p = results.mann_whitney_u([1, 2, 2, 3], [2, 3, 4, 5])
        self.assertEqual(u, 2.5)
        self.assertAlmostEqual(p, 0.136658, places=6)
        # all equal: no difference at all
        self.assertEqual(results.mann_whitney_u([5, 5, 5, 5], [5, 5, 5, 5]),
                         (8.0, 1.0))

    def test_more_than_eight_each_is_asymptotic(self):
        # 9 vs 9 separated: U = 0; mean 40.5, variance 81 * 19 / 12 =
        # 128.25, z = (81 - 40.5 - 0.5) / 11.3248 = 3.532056, p =
        # 0.000412295
        u, p = results.mann_whitney_u(list(range(1, 10)),
                                      list(range(10, 19)))
        self.assertEqual(u, 0.0)
        self.assertAlmostEqual(p, 0.000412295, places=9)

    def test_too_few_repetitions(self):
        # at least UTEST_MIN_REPETITIONS (4) on each side: with 3 vs 3 the
        # smallest p is 0.1 (above), so the test is not run
        a, b = results.Case([]), results.Case([])
        a.samples["IOPS"] = [1.0, 2.0, 3.0]
        b.samples["IOPS"] = [4.0, 5.0, 6.0, 7.0]
        u = results.utest(a, b, "IOPS")
        self.assertEqual((u.n1, u.n2, u.p, u.significant(), u.text()),
                         (3, 4, None, False, "too few reps (3 vs 4)"))
        a.samples["IOPS"].append(0.5)
        u = results.utest(a, b, "IOPS")
        self.assertEqual((u.p, u.significant(), u.text()),
                         (2 / 70, True, "p=0.029 significant"))
        b.samples["IOPS"][0] = float("nan")
        self.assertIsNone(results.utest(a, b, "IOPS").p)
        self.assertEqual(results.format_p(0.6905), "0.69")
        self.assertEqual(results.format_p(1.0), "1")
        self.assertEqual(results.format_p(0.000412295), "0.00041")
        self.assertEqual(results.format_p(3.2e-7), "3.2e-07")

    def test_values_and_mean_rsd(self):
        # the side-by-side scripts' tables: lists of values, not Cases
        self.assertEqual(results.utest_values([1, 2, 3], [4, 5, 6]).text(),
                         "too few reps (3 vs 3)")
        self.assertEqual(
            results.utest_values([1, 2, 3, 4], [5, 6, 7, 8]).text(),
            "p=0.029 significant")
        # mean 2,000, sample stddev 1,000: 50 %
        self.assertEqual(results.mean_rsd([1000, 2000, 3000]), "2,000 ± 50%")
        self.assertEqual(results.mean_rsd([1.5, 2.5], "{:.2f}"), "2.00 ± 35%")
        self.assertEqual(results.mean_rsd([7]), "7 ± 0%")


class ReportSignificanceTest(unittest.TestCase):
    maxDiff = None

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

    def test_each_change_marked_significant_or_not(self):
        # two runs, 5 repetitions each: 64k on separates completely
        # (p = 2/252), 4k off overlaps (U = 13 of 25: p = 1); a third
        # row with 3 repetitions in B is too few to decide
        def file(name, rows, commit):
            entries = []
            for cfg, vals in rows:
                entries += [gb_entry("subcluster/fs:xfs/" + cfg,
                                     {"IOPS": v}, index=i, reps=len(vals))
                            for i, v in enumerate(vals)]
            with open(os.path.join(self.dir, name), "w") as f:
                json.dump({"context": {"machine": "vm",
                                       "imgtool_commit": commit},
                           "benchmarks": entries}, f)
            return name
        a = file("a.json", [
            ("cluster:65536/extended_l2:on", [100, 101, 102, 103, 104]),
            ("cluster:4096/extended_l2:off", [10, 20, 30, 40, 50]),
            ("cluster:16384/extended_l2:off", [1, 2, 3, 4, 5])], "aaaaaaa")
        b = file("b.json", [
            ("cluster:65536/extended_l2:on", [110, 111, 112, 113, 114]),
            ("cluster:4096/extended_l2:off", [15, 25, 35, 36, 45]),
            ("cluster:16384/extended_l2:off", [6, 7, 8])], "bbbbbbb")
        rc, out, err = run_report([a, b], self.dir)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual(out, (
            "== subcluster: IOPS (higher is better)\n"
            "   A: a.json (vm, commit aaaaaaa)\n"
            "   B: b.json (vm, commit bbbbbbb)\n"
            "   every row: fs:xfs\n"
            "   each change: Mann-Whitney U test (two-sided) of the "
            "repetitions against the compared value's, significant if "
            "p < 0.05; at least 4 repetitions on each side\n"
            "\n"
            "                             A           B\n"
            "---------------------------  ----------  "
            "----------------------------\n"
            "cluster:64k/extended_l2:on   102 ± 2%    112 ± 1%\n"
            "                                         +10%, p=0.0079 "
            "significant\n"
            "cluster:4k/extended_l2:off   30.0 ± 53%  31.2 ± 37%\n"
            "                                         +4%, p=1 not "
            "significant\n"
            "cluster:16k/extended_l2:off  3 ± 53%     7 ± 14%\n"
            "                                         +133%, too few reps "
            "(5 vs 3)\n"))


if __name__ == "__main__":
    unittest.main()
