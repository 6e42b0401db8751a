#!/usr/bin/env python3
"""Writes the runs of a side-by-side script as a result file of the suites'
contract (benchmarks/README.md "Result files"), so that report and dashboard
read them like a suite's.

  sbs_results.py --suite SUITE --out DIR --filesystems FS[,FS] \
      [--context KEY=VALUE]... [--min-seconds S] RECORDS

RECORDS is a text file the script appended to while it measured, one line
per measured run:

  NAME REP COUNTER=VALUE...     e.g. fs:xfs/cluster:65536/extended_l2:on/tool:imgtool 0 seconds=1.234567 IOPS=3321 writes=4096
  NAME error MESSAGE...         a configuration that failed (a command the tool lacks)

NAME is the benchmark name without the suite (`key:value/...`), REP the
repetition index (0, 1, ...). The file is DIR/<suite>-<hostname>.json:
Google Benchmark 1.7.1's layout, one `iteration` entry per run (iterations
1, real_time = the run's `seconds` in ms), and for every configuration with
more than one run its `mean`, `median`, `stddev` and `cv` aggregates, as
`--benchmark_repetitions=N --benchmark_report_aggregates_only=false` writes
them. The context has Google Benchmark's keys plus the contract's (suite,
machine, kernel, filesystems, imgtool_commit, build, quick, load_avg_start)
and whatever --context adds. The file is then checked with
check_results.py; a problem is printed and the exit status is 1.

Stdlib only: the scripts run it with the system python3, outside Bazel.
"""

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import check_results  # noqa: E402  (beside this file)


class RecordError(Exception):
    """A malformed records line; the message names the file and line."""


def read_records(path):
    """[(name, rep or None, counters or error message)] in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 3:
                raise RecordError("%s:%d: want NAME REP COUNTER=VALUE..." %
                                  (path, n))
            name, rep = parts[0], parts[1]
            if rep == "error":
                out.append((name, None, " ".join(parts[2:])))
                continue
            try:
                rep = int(rep)
                counters = {}
                for kv in parts[2:]:
                    k, sep, v = kv.partition("=")
                    if not sep or not k:
                        raise ValueError(kv)
                    counters[k] = float(v)
            except ValueError as e:
                raise RecordError("%s:%d: bad field %s" % (path, n, e))
            out.append((name, rep, counters))
    if not out:
        raise RecordError("%s: no runs recorded" % path)
    return out


def short_runs(records, min_seconds):
    """([(name, rep, seconds)] of the bench runs (the records with IOPS:
    the runs the scripts calibrate; not side_by_side.sh's map runs) shorter
    than min_seconds, number of bench runs)."""
    timed = [(n, r, c["seconds"]) for n, r, c in records
             if r is not None and "seconds" in c and "IOPS" in c]
    return [t for t in timed if t[2] < min_seconds], len(timed)


def _cpu_mhz():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]))
    except (OSError, ValueError):
        pass
    return 0


def _commit():
    """`git rev-parse --short HEAD` of this tree, `-dirty` with changes."""
    try:
        head = subprocess.run(
            ["git", "-C", _HERE, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", _HERE, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _entry(suite, name, reps, **fields):
    e = {"name": "%s/%s" % (suite, name), "family_index": 0,
         "per_family_instance_index": 0, "run_name": "%s/%s" % (suite, name),
         "repetitions": reps, "threads": 1, "iterations": 1}
    e.update(fields)
    return e


def build(suite, records, context):
    """The result file's object (context, benchmarks)."""
    order, runs, errors = [], {}, {}
    for name, rep, value in records:
        if name not in runs:
            order.append(name)
            runs[name] = []
        if rep is None:
            errors[name] = value
        else:
            runs[name].append((rep, value))
    benchmarks = []
    for family, name in enumerate(order):
        its = sorted(runs[name], key=lambda r: r[0])
        reps = max(len(its), 1)
        if name in errors:
            benchmarks.append(_entry(
                suite, name, reps, family_index=family,
                run_type="iteration", repetition_index=0,
                error_occurred=True, error_message=errors[name]))
            continue
        for rep, counters in its:
            ms = counters.get("seconds", 0.0) * 1e3
            benchmarks.append(_entry(
                suite, name, reps, family_index=family,
                run_type="iteration", repetition_index=rep, real_time=ms,
                cpu_time=ms, time_unit="ms", **counters))
        if len(its) < 2:
            continue
        keys = []
        for _, counters in its:
            keys.extend(k for k in counters if k not in keys)
        for agg in ("mean", "median", "stddev", "cv"):
            fields = {}
            for k in keys + ["real_time"]:
                vals = [c.get("seconds", 0.0) * 1e3 if k == "real_time"
                        else c[k] for _, c in its if k == "real_time" or
                        k in c]
                mean = statistics.fmean(vals)
                sd = statistics.stdev(vals)
                fields[k] = {"mean": mean, "median": statistics.median(vals),
                             "stddev": sd,
                             "cv": sd / mean if mean else math.nan}[agg]
            fields["cpu_time"] = fields["real_time"]
            e = _entry(suite, name, reps, family_index=family,
                       run_type="aggregate", aggregate_name=agg,
                       aggregate_unit="percentage" if agg == "cv" else "time",
                       time_unit="ms", **fields)
            e["name"] += "_" + agg
            benchmarks.append(e)
    return {"context": context, "benchmarks": benchmarks}


def make_context(suite, filesystems, extra):
    load = os.getloadavg()
    ctx = {
        # Google Benchmark's own keys
        "date": datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"),
        "host_name": socket.gethostname(),
        "executable": "benchmarks/%s.sh" % suite,
        "num_cpus": os.cpu_count() or 0,
        "mhz_per_cpu": _cpu_mhz(),
        "cpu_scaling_enabled": False,
        "caches": [],
        "load_avg": [round(x, 2) for x in load],
        "library_build_type": "release",
        # the contract's
        "suite": suite,
        "machine": socket.gethostname(),
        "kernel": platform.release(),
        "filesystems": filesystems,
        "imgtool_commit": _commit(),
        "build": "opt",
        "quick": "false",
        "load_avg_start": "%.2f" % load[0],
    }
    ctx.update(extra)
    return ctx


def main(argv):
    parser = argparse.ArgumentParser(prog="sbs_results.py")
    parser.add_argument("records")
    parser.add_argument("--suite", required=True)
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--filesystems", required=True)
    parser.add_argument("--context", action="append", default=[],
                        metavar="KEY=VALUE")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="the bench runs' intended shortest time: the "
                        "context key runs_below_min_seconds counts the runs "
                        "with IOPS shorter than it, and a warning names them")
    args = parser.parse_args(argv)
    extra = {}
    for kv in args.context:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            sys.stderr.write("sbs_results.py: --context %r is not KEY=VALUE\n"
                             % kv)
            return 1
        extra[k] = v
    try:
        records = read_records(args.records)
    except (OSError, RecordError) as e:
        sys.stderr.write("sbs_results.py: %s\n" % e)
        return 1
    ctx = make_context(args.suite, args.filesystems, extra)
    if args.min_seconds is not None:
        short, timed = short_runs(records, args.min_seconds)
        ctx["runs_below_min_seconds"] = "%d of %d" % (len(short), timed)
        if short:
            sys.stderr.write(
                "sbs_results.py: warning: %d of %d runs took less than %g s "
                "(the load changed after the calibration?): %s\n" % (
                    len(short), timed, args.min_seconds, ", ".join(
                        "%s #%d %.3f s" % r for r in short)))
    path = os.path.join(args.out, "%s-%s.json" % (args.suite, ctx["machine"]))
    try:
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(build(args.suite, records, ctx), f, indent=2)
            f.write("\n")
    except OSError as e:
        sys.stderr.write("sbs_results.py: %s: %s\n" % (
            e.filename or path, e.strerror or e))
        return 1
    problems = check_results.check(path)
    for p in problems:
        sys.stderr.write("sbs_results.py: %s\n" % p)
    if problems:
        return 1
    sys.stderr.write("wrote %s\n" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
