"""Per cell of an engine result file (argv[1]): the ceiling (best fio
median), each imgtool engine against it (median ratio, and the U test
against that fio configuration's runs), every fio configuration's ratio,
and the coefficient of variation of every configuration's runs,
and native against fio libaio. Also reads session 28's
engine-miss-session28/engine-vm.json. Run from anywhere: python3 cells.py FILE"""
import collections, json, os, statistics, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from benchmarks import results
d = json.load(open(sys.argv[1]))
runs = collections.defaultdict(list)
for b in d['benchmarks']:
    if b.get('run_type') != 'iteration' or b.get('error_occurred'): continue
    runs[b['run_name']].append(b['IOPS'])
cells = collections.defaultdict(dict)
for name, v in runs.items():
    p = dict(x.split(':', 1) for x in name.split('/')[1:])
    cells[(p['fs'], p['op'], p['depth'])][(p['tool'], p['engine'])] = v
cv = lambda v: 100 * statistics.pstdev(v) / statistics.mean(v)
for key, c in cells.items():
    fio = {e: v for (t, e), v in c.items() if t == 'fio'}
    best = max(fio, key=lambda e: statistics.median(fio[e]))
    ceil = statistics.median(fio[best])
    print('%s %s depth %s: ceiling %.1fk (fio %s, cv %.0f%%)' % (key + (ceil / 1000, best, cv(fio[best]))))
    for eng in ('native', 'io_uring', 'io_uring_sqpoll', 'threads'):
        v = c.get(('imgtool', eng))
        if v:
            u, p = results.mann_whitney_u(v, fio[best])
            print('  imgtool %-16s %7.1fk  %.2f  p=%.2g  cv %.0f%%' % (eng, statistics.median(v) / 1000, statistics.median(v) / ceil, p, cv(v)))
    for e, v in sorted(fio.items()):
        print('  fio     %-22s %7.1fk  %.2f  cv %.0f%%' % (e, statistics.median(v) / 1000, statistics.median(v) / ceil, cv(v)))
print('native against fio libaio (U test):')
for key, c in cells.items():
    n = c.get(('imgtool', 'native')); l = c.get(('fio', 'libaio'))
    if not n or not l: continue
    u, p = results.mann_whitney_u(n, l)
    print('  %s %s depth %s: native %.1fk, libaio %.1fk, ratio %.2f, p=%.2g' % (key + (statistics.median(n) / 1000, statistics.median(l) / 1000, statistics.median(n) / statistics.median(l), p)))
