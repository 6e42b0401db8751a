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
            "\n"
            "                            A          B\n"
            "--------------------------  ---------  --------\n"
            "cluster:64k/extended_l2:on  110 ± 9%   121 ± 2%\n"
            "                                       +10%\n"
            "cluster:4k/extended_l2:off  50.0 ± 0%  -\n"))

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


if __name__ == "__main__":
    unittest.main()
