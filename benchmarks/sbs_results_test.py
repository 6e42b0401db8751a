"""Tests of benchmarks/sbs_results.py, the side-by-side scripts' writer of
result files: exact entries and aggregates from a records file, the
contract check (check_results.py), and one-line errors for bad records."""

import contextlib
import io
import json
import math
import os
import tempfile
import unittest

from benchmarks import results
from benchmarks import sbs_results


def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = sbs_results.main(argv)
    return rc, err.getvalue()


class SbsResultsTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        self.records = os.path.join(self.dir, "records")

    def write(self, text):
        with open(self.records, "w", encoding="utf-8") as f:
            f.write(text)

    def test_runs_and_aggregates_in_the_contract(self):
        name = "fs:xfs/cluster:65536/extended_l2:on/tool:"
        self.write(
            name + "imgtool 0 seconds=1.25 IOPS=3200 writes=4000\n" +
            name + "qemu-img 0 seconds=2.0 IOPS=2000 writes=4000\n" +
            name + "qemu-img 1 seconds=1.0 IOPS=4000 writes=4000\n" +
            name + "imgtool 1 seconds=1.0 IOPS=4000 writes=4000\n" +
            "fs:xfs/cluster:2097152/extended_l2:on/tool:imgtool error "
            "bench failed: no space\n")
        out = os.path.join(self.dir, "out")
        rc, err = run(["--suite", "subcluster_side_by_side", "--out", out,
                       "--filesystems", "xfs", "--context", "quick=true",
                       "--context", "load_avg_end=3.5", self.records])
        files = os.listdir(out)
        self.assertEqual((rc, err), (0, "wrote %s\n" % os.path.join(
            out, files[0])))
        self.assertRegex(files[0], r"^subcluster_side_by_side-.+\.json$")
        with open(os.path.join(out, files[0]), encoding="utf-8") as f:
            data = json.load(f)
        ctx = data["context"]
        self.assertEqual((ctx["suite"], ctx["filesystems"], ctx["quick"],
                          ctx["build"], ctx["load_avg_end"]),
                         ("subcluster_side_by_side", "xfs", "true", "opt",
                          "3.5"))
        b = data["benchmarks"]
        # imgtool: 2 runs + 4 aggregates, qemu-img the same, then the error
        self.assertEqual([(e["name"].split("/")[-1], e["run_type"],
                           e.get("repetition_index")) for e in b], [
            ("tool:imgtool", "iteration", 0),
            ("tool:imgtool", "iteration", 1),
            ("tool:imgtool_mean", "aggregate", None),
            ("tool:imgtool_median", "aggregate", None),
            ("tool:imgtool_stddev", "aggregate", None),
            ("tool:imgtool_cv", "aggregate", None),
            ("tool:qemu-img", "iteration", 0),
            ("tool:qemu-img", "iteration", 1),
            ("tool:qemu-img_mean", "aggregate", None),
            ("tool:qemu-img_median", "aggregate", None),
            ("tool:qemu-img_stddev", "aggregate", None),
            ("tool:qemu-img_cv", "aggregate", None),
            ("tool:imgtool", "iteration", 0)])
        self.assertEqual((b[0]["seconds"], b[0]["IOPS"], b[0]["real_time"],
                          b[0]["time_unit"], b[0]["repetitions"]),
                         (1.25, 3200.0, 1250.0, "ms", 2))
        # qemu-img's IOPS 2000, 4000: mean 3000, median 3000, sample
        # stddev 1414.21, cv 0.4714
        agg = {e["aggregate_name"]: e["IOPS"] for e in b[8:12]}
        self.assertEqual(agg["mean"], 3000.0)
        self.assertEqual(agg["median"], 3000.0)
        self.assertAlmostEqual(agg["stddev"], math.sqrt(2) * 1000, places=9)
        self.assertAlmostEqual(agg["cv"], math.sqrt(2) / 3, places=12)
        self.assertEqual(b[12]["error_message"], "bench failed: no space")
        # report reads it: the runs are the U test's samples
        run_ = results.load(os.path.join(out, files[0]))[0]
        case = run_.case("fs:xfs/cluster:65536/extended_l2:on/tool:qemu-img")
        self.assertEqual(case.samples["IOPS"], [2000.0, 4000.0])

    def test_runs_below_min_seconds_are_counted_and_named(self):
        # bench runs (with IOPS) only: the map run is not calibrated
        self.write("fs:xfs/case:write/tool:imgtool 0 seconds=1.5 IOPS=1\n"
                   "fs:xfs/case:write/tool:qemu-img 0 seconds=0.25 IOPS=1\n"
                   "fs:xfs/case:map/tool:imgtool 0 seconds=0.125\n")
        out = os.path.join(self.dir, "out")
        rc, err = run(["--suite", "side_by_side", "--out", out,
                       "--filesystems", "xfs", "--min-seconds", "1",
                       self.records])
        self.assertEqual(rc, 0)
        self.assertTrue(err.startswith(
            "sbs_results.py: warning: 1 of 2 runs took less than 1 s (the "
            "load changed after the calibration?): fs:xfs/case:write/"
            "tool:qemu-img #0 0.250 s\nwrote "), err)
        with open(os.path.join(out, os.listdir(out)[0]),
                  encoding="utf-8") as f:
            self.assertEqual(json.load(f)["context"][
                "runs_below_min_seconds"], "1 of 2")

    def test_a_contract_problem_fails(self):
        # a suite check_results does not know
        self.write("fs:xfs/case:x/tool:imgtool 0 seconds=1\n")
        rc, err = run(["--suite", "nosuch", "--out", self.dir,
                       "--filesystems", "xfs", self.records])
        self.assertEqual(rc, 1)
        self.assertIn("unknown suite 'nosuch'", err)

    def test_an_fs_label_outside_the_context_filesystems_fails(self):
        # check_results: a file whose names measure a filesystem its
        # context does not list (the engine suite runs xfs and ext4)
        self.write("fs:xfs/case:map/tool:imgtool 0 seconds=1\n"
                   "fs:ext4/case:map/tool:imgtool 0 seconds=1\n")
        rc, err = run(["--suite", "side_by_side", "--out", self.dir,
                       "--filesystems", "xfs", self.records])
        self.assertEqual(rc, 1)
        self.assertIn("side_by_side/fs:ext4/case:map/tool:imgtool: "
                      "fs:ext4 is not in context filesystems 'xfs'", err)
        rc, err = run(["--suite", "side_by_side", "--out", self.dir,
                       "--filesystems", "xfs,ext4", self.records])
        self.assertEqual(rc, 0, err)

    def test_bad_records_are_one_line_errors(self):
        for text, message in (
                ("fs:xfs/case:x/tool:a 0\n",
                 "%s:1: want NAME REP COUNTER=VALUE...\n"),
                ("fs:xfs/case:x/tool:a zero seconds=1\n",
                 "%s:1: bad field invalid literal for int() with base 10: "
                 "'zero'\n"),
                ("fs:xfs/case:x/tool:a 0 seconds=fast\n",
                 "%s:1: bad field could not convert string to float: "
                 "'fast'\n"),
                ("\n", "%s: no runs recorded\n")):
            self.write(text)
            rc, err = run(["--suite", "side_by_side", "--out", self.dir,
                           "--filesystems", "xfs", self.records])
            self.assertEqual((rc, err), (1, "sbs_results.py: " + message %
                                         self.records), text)


if __name__ == "__main__":
    unittest.main()
