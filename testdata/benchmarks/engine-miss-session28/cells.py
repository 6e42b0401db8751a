"""Per cell of an engine result file (argv[1]): the ceiling (best fio median),
imgtool native and io_uring against it with the U test against that fio
configuration's runs, every fio configuration's ratio; then native against
fio libaio. Run from anywhere: python3 cells.py engine-vm.json"""
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
for key, c in cells.items():
    fio = {e: v for (t, e), v in c.items() if t == 'fio'}
    best = max(fio, key=lambda e: statistics.median(fio[e]))
    ceil = statistics.median(fio[best])
    line = '%s %s d%s ceiling %.1fk (%s)' % (key + (ceil / 1000, best))
    for eng in ('native', 'io_uring'):
        v = c.get(('imgtool', eng))
        if v:
            u, p = results.mann_whitney_u(v, fio[best])
            line += ' | %s %.1fk %.2f p=%.2g' % (eng, statistics.median(v) / 1000, statistics.median(v) / ceil, p)
    line += ' | fio: ' + ', '.join('%s %.2f' % (e, statistics.median(v) / ceil) for e, v in sorted(fio.items()))
    print(line)
print('native vs fio libaio:')
for key, c in cells.items():
    n = c.get(('imgtool', 'native')); l = c.get(('fio', 'libaio'))
    u, p = results.mann_whitney_u(n, l)
    print(key, 'native %.1fk libaio %.1fk ratio %.2f p=%.2g' % (statistics.median(n)/1000, statistics.median(l)/1000, statistics.median(n)/statistics.median(l), p), 'native cv %.0f%% libaio cv %.0f%%' % (100*statistics.pstdev(n)/statistics.mean(n), 100*statistics.pstdev(l)/statistics.mean(l)))
