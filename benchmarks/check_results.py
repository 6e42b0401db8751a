#!/usr/bin/env python3
"""Checks benchmark result files against the contract in benchmarks/README.md
("Result files"): file name, context keys, benchmark names (labels per suite),
counters per suite, repetitions and aggregates.

Usage: check_results.py FILE.json...   (exit 0 if all follow it; else one line
per problem on stderr, naming the file, and exit 1). Files that follow it and
belong to a suite with targets (results.SUITE_TARGETS: snapshot) then get one
line per target on stdout, e.g. "FILE: snapshot -c time: imgtool 52.0 ms /
qemu-img 81.0 ms, ratio 0.64 (target <= 0.8): met"; targets never fail it.
"""
import json
import math
import os
import sys

CONTEXT_KEYS = ["suite", "machine", "kernel", "filesystems", "imgtool_commit",
                "build", "quick", "load_avg_start"]
# (advise runs on any directory: also tmpfs, btrfs and other)
FILESYSTEMS = {"xfs", "ext4", "ext4_noextents", "tmpfs", "btrfs", "other"}
# suite -> (label keys in order, function(labels) -> required counters)
SUITES = {
    "hint": (["fs", "hint", "op"],
             lambda l: {"seconds", "MiB_per_s", "extents"} if l["op"] == "write"
             else {"seconds", "extents", "answers"}),
    "create_prealloc": (["fs", "fmt", "prealloc"],
                        lambda l: {"seconds", "syscalls", "allocated_bytes"}),
    "prealloc_filter": (["fs", "filter", "write"],
                        lambda l: {"seconds", "MiB_per_s", "IOPS", "extents"}),
    "subcluster": (["fs", "cluster", "extended_l2"],
                   lambda l: {"seconds", "IOPS", "bytes_from_backing"}),
    "engine": (["fs", "op", "engine", "depth", "tool"],
               lambda l: {"seconds", "IOPS", "MiB_per_s"}),
    "chain": (["fs", "case", "tool"],
              lambda l: {"seconds", "max_rss_bytes", "bytes_read"}),
    "snapshot": (["fs", "case", "tool"],
                 lambda l: {"seconds", "cpu_seconds", "bytes_written",
                            "max_rss_bytes"} |
                 ({"IOPS"} if l["case"] not in ("create", "delete")
                  else set())),
    "nbd": (["fs", "part", "case", "tool"],
            lambda l: {"seconds", "MiB_per_s"} |
            ({"IOPS"} if l["part"] != "copy" else set())),
    # the side-by-side scripts (sbs_results.py): imgtool against qemu-img
    # (and fio where a script has it) on the same mount, tools alternating
    "side_by_side": (["fs", "case", "tool"],
                     lambda l: {"seconds"} |
                     ({"IOPS"} if not l["case"].startswith("map") else
                      set())),
    "subcluster_side_by_side": (["fs", "cluster", "extended_l2", "tool"],
                                lambda l: {"seconds", "IOPS", "writes"}),
    "prealloc_side_by_side": (["fs", "write", "filter", "tool"],
                              lambda l: {"seconds", "IOPS", "writes"}),
    "chain_side_by_side": (["fs", "case", "tool"],
                           lambda l: {"seconds", "max_rss_bytes",
                                      "bytes_read"}),
    "startup_side_by_side": (["fs", "cmd", "tool"],
                             lambda l: {"seconds", "peak_rss_kib",
                                        "min_address_space_mib"}),
    # `imgtool advise DIR --output=json` (issue 20 part 4): the create
    # table and the bench workloads' configurations on DIR's filesystem
    "advise": (["fs", "workload", "config"],
               lambda l: {"seconds", "extents", "allocated_bytes"} |
               (set() if l["workload"] == "create" else
                {"IOPS", "MiB_per_s", "create_seconds", "writes"})),
    # issue 20 part 1: per-request cost, imgtool / qemu-img / fio per engine
    "reqcost_side_by_side": (["fs", "case", "depth", "engine", "tool"],
                             lambda l: {"seconds", "IOPS", "requests"}),
}
AGGREGATES = {"mean", "median", "stddev", "cv"}
GB_FIELDS = {"name", "family_index", "per_family_instance_index", "run_name",
             "run_type", "repetitions", "repetition_index", "threads",
             "aggregate_name", "aggregate_unit", "iterations", "real_time",
             "cpu_time", "time_unit", "error_occurred", "error_message",
             "label", "bytes_per_second", "items_per_second"}


def check(path):
    problems = []

    def bad(msg):
        problems.append(f"{path}: {msg}")

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{path}: not readable JSON: {e}"]
    ctx = data.get("context")
    benches = data.get("benchmarks")
    if not isinstance(ctx, dict) or not isinstance(benches, list):
        return [f"{path}: needs a 'context' object and a 'benchmarks' list"]
    for key in CONTEXT_KEYS:
        if not isinstance(ctx.get(key), str) or not ctx.get(key):
            bad(f"context key '{key}' missing or not a non-empty string")
    suite = ctx.get("suite")
    if suite not in SUITES:
        return problems + [f"{path}: unknown suite {suite!r}"]
    base = os.path.basename(path)
    if base != f"{suite}-{ctx.get('machine')}.json":
        bad(f"file name should be {suite}-{ctx.get('machine')}.json")
    filesystems = str(ctx.get("filesystems", "")).split(",")
    for fs in filesystems:
        if fs not in FILESYSTEMS:
            bad(f"context filesystems: unknown filesystem {fs!r}")
    if ctx.get("build") not in ("opt", "fastbuild"):
        bad("context build must be opt or fastbuild")
    if ctx.get("quick") not in ("true", "false"):
        bad("context quick must be true or false")
    if not benches:
        bad("no benchmarks")
    keys, counters_for = SUITES[suite]
    runs = {}  # run_name -> [iterations, set of aggregates, repetitions]
    for b in benches:
        name, run_name = b.get("name", ""), b.get("run_name", "")
        parts = run_name.split("/")
        if parts[0] != suite:
            bad(f"{name}: does not start with '{suite}/'")
            continue
        labels = {}
        for p in parts[1:]:
            k, sep, v = p.partition(":")
            if not sep or not k or not v:
                bad(f"{name}: part {p!r} is not key:value")
            labels[k] = v
        if [p.partition(":")[0] for p in parts[1:]] != keys:
            bad(f"{name}: labels should be {'/'.join(keys)}")
            continue
        if "fs" in labels and labels["fs"] not in filesystems:
            bad(f"{name}: fs:{labels['fs']} is not in context filesystems "
                f"{ctx.get('filesystems')!r}")
        r = runs.setdefault(run_name, [0, set(), b.get("repetitions"), False])
        if b.get("run_type") == "iteration":
            r[0] += 1
            if name != run_name:
                bad(f"{name}: iteration name differs from run_name")
        elif b.get("run_type") == "aggregate":
            agg = b.get("aggregate_name")
            r[1].add(agg)
            if name != f"{run_name}_{agg}":
                bad(f"{name}: aggregate name should be {run_name}_{agg}")
            want_unit = "percentage" if agg == "cv" else "time"
            if b.get("aggregate_unit") != want_unit:
                bad(f"{name}: aggregate_unit should be {want_unit}")
        else:
            bad(f"{name}: run_type {b.get('run_type')!r}")
        if b.get("error_occurred"):
            r[3] = True
            if not b.get("error_message"):
                bad(f"{name}: error without error_message")
            continue
        counters = {k: v for k, v in b.items() if k not in GB_FIELDS}
        cv = b.get("aggregate_name") == "cv"
        for c in counters_for(labels):
            v = counters.get(c)
            if cv and isinstance(v, float) and math.isnan(v):
                continue  # 0 / 0: the counter's mean is 0
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name}: counter '{c}' missing or not a finite number")
            elif v < 0:
                bad(f"{name}: counter '{c}' is negative")
        for c, v in counters.items():
            if not isinstance(v, (int, float)):
                bad(f"{name}: field '{c}' is not a number")
    for run_name, (iters, aggs, reps, error) in runs.items():
        if error:
            continue  # Google Benchmark stops repeating after an error
        if reps is not None and iters and iters != reps:
            bad(f"{run_name}: {iters} iteration entries, repetitions {reps}")
        if reps is not None and reps > 1 and aggs != AGGREGATES:
            bad(f"{run_name}: aggregates {sorted(aggs)}, want {sorted(AGGREGATES)}")
    return problems


def print_targets(path):
    """Prints the targets of a file's suite (results.SUITE_TARGETS: ratios
    and costs against their bounds, on stdout); they are information, not
    part of the contract, so a missed target is no problem."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    from benchmarks import results  # beside this file (runfiles too)
    try:
        runs = results.load(path)
    except results.ResultError:
        return
    for run in runs:
        for line in results.target_lines(run.suite, run):
            print("%s: %s" % (path, line))


def main(argv):
    if len(argv) < 2:
        print("usage: check_results.py FILE.json...", file=sys.stderr)
        return 2
    problems = [p for path in argv[1:] for p in check(path)]
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        for path in argv[1:]:
            print_targets(path)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
