"""The engine suite's table (README, "The engine suite on XFS and ext4") from a
result file (argv[1]): per cell the ceiling (best fio median, by which
configuration), imgtool's io_uring, native and threads medians with their ratio to
the ceiling, the U test of native's runs against the ceiling configuration's, and
the count of cells where native reaches 0.95 of the ceiling. With a second file
(argv[2], e.g. session 29's tmpfs-full run), native's ratio there too.
Run from anywhere: python3 table.py FILE [BEFORE]"""
import collections, json, os, statistics, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from benchmarks import results


def cells_of(path):
    runs = collections.defaultdict(list)
    for b in json.load(open(path))['benchmarks']:
        if b.get('run_type') != 'iteration' or b.get('error_occurred'):
            continue
        runs[b['run_name']].append(b['IOPS'])
    cells = collections.defaultdict(dict)
    for name, v in runs.items():
        p = dict(x.split(':', 1) for x in name.split('/')[1:])
        cells[(p['fs'], p['op'], int(p['depth']))][(p['tool'], p['engine'])] = v
    return cells


def ceiling(c):
    fio = {e: v for (t, e), v in c.items() if t == 'fio'}
    best = max(fio, key=lambda e: statistics.median(fio[e]))
    return best, fio[best], statistics.median(fio[best])


cells = cells_of(sys.argv[1])
before = cells_of(sys.argv[2]) if len(sys.argv) > 2 else {}
k = lambda v: '%.1fk' % (v / 1000)
print('| fs | op | depth | ceiling (best fio, by) | imgtool io_uring | native | native vs ceiling (U test) | threads |'
      + (' native before |' if before else ''))
print('|---|---|---:|---|---:|---:|---|---:|' + ('---:|' if before else ''))
met = 0
ratios = []
for key in sorted(cells, key=lambda x: (x[0] != 'xfs', x[1], x[2])):
    c = cells[key]
    best, best_runs, ceil = ceiling(c)
    row = '| %s | %s | %d | %s (%s) |' % (key + (k(ceil), best.replace('_', ' ')))
    for eng in ('io_uring', 'native'):
        m = statistics.median(c[('imgtool', eng)])
        row += ' %s (%.2f) |' % (k(m), m / ceil)
    n = c[('imgtool', 'native')]
    r = statistics.median(n) / ceil
    ratios.append(r)
    met += r >= 0.95
    _, p = results.mann_whitney_u(n, best_runs)
    row += ' %s p=%s |' % ('ahead' if r >= 1 else 'behind', results.format_p(p))
    m = statistics.median(c[('imgtool', 'threads')])
    row += ' %s (%.2f) |' % (k(m), m / ceil)
    if before:
        b = before.get(key)
        if b:
            _, _, bc = ceiling(b)
            row += ' %.2f |' % (statistics.median(b[('imgtool', 'native')]) / bc)
        else:
            row += ' - |'
    print(row)
print('native >= 0.95 of the ceiling in %d of %d cells; median ratio %.2f; min %.2f'
      % (met, len(ratios), statistics.median(ratios), min(ratios)))
