"""Prints benchmark results as comparison tables, one per suite and metric.

  bazel run //benchmarks:report -- [--by run|KEY] [--metric NAME]...
      RESULTS...

RESULTS are Google Benchmark JSON files written by //benchmarks:run (or
directories holding them). With two or more files of a suite (two machines,
two commits) the columns are the files, A, B, ...; with one file the columns
are the values of the suite's variant key (extended_l2, hint, ...), or of
--by KEY. Each cell is `mean ± relative standard deviation` over the
repetitions; the line under it gives each column's change against the first
column in percent, with a two-sided Mann-Whitney U test of the repetitions
(`p=0.0079 significant`, p < 0.05; at least 4 repetitions on each side,
results.UTEST_MIN_REPETITIONS). Suites with targets (SUITE_TARGETS in results.py:
snapshot) end with one line per target: the medians, the ratio or cost and
whether the target is met.
"""

import argparse
import os
import sys

from benchmarks import results


def render(suites, by=None, metrics=None):
    """The whole report as text."""
    parts = []
    for suite, runs in suites:
        if results.column_key(suite, runs, by) is None:
            parts.append("== %s: no key \"%s\" in its benchmark names\n" %
                         (suite, by))
            continue
        # suites without the chosen metrics print nothing
        for t in results.build_tables(suite, runs, by=by, metrics=metrics):
            parts.append(results.table_to_text(t))
        for run in runs:
            lines = results.target_lines(suite, run, metrics)
            if lines:
                parts.append("== %s: targets (medians; %s)\n%s\n" % (
                    suite, run.path, "".join("   %s\n" % l for l in lines)))
    return "\n".join(parts)


def main(argv):
    parser = argparse.ArgumentParser(
        prog="report",
        description="Comparison tables of benchmark result files.")
    results.add_arguments(parser)
    parser.add_argument("--metric", action="append", default=None,
                        help="only this metric (repeatable), e.g. IOPS")
    args = parser.parse_args(argv)
    base_dir = os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())
    try:
        suites = results.load_all(
            results.expand(args.results, base_dir), base_dir)
    except results.ResultError as e:
        sys.stderr.write("report: %s\n" % e)
        return 1
    problem = results.check_choices(suites, by=args.by, metrics=args.metric)
    if problem:
        sys.stderr.write("report: %s\n" % problem)
        return 1
    sys.stdout.write(render(suites, by=args.by, metrics=args.metric))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
