"""Per cell: the ceiling (best fio median and its configuration), native's median, ratio, U test of native's
runs against the ceiling configuration's, every run. python3 cells.py engine-vm.json"""
import collections, json, os, statistics, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../..'))
from benchmarks import results
runs = collections.defaultdict(list)
for b in json.load(open(sys.argv[1]))['benchmarks']:
    if b.get('run_type') == 'iteration' and not b.get('error_occurred'):
        runs[b['run_name']].append(b['IOPS'])
cells = collections.defaultdict(dict)
for name, v in runs.items():
    p = dict(x.split(':', 1) for x in name.split('/')[1:])
    cells[(p['fs'], p['op'], int(p['depth']))][(p['tool'], p['engine'])] = v
for k in sorted(cells):
    c = cells[k]
    fio = {e: v for (t, e), v in c.items() if t == 'fio'}
    best = max(fio, key=lambda e: statistics.median(fio[e]))
    nat = c[('imgtool', 'native')]
    cm, nm = statistics.median(fio[best]), statistics.median(nat)
    others = ", ".join(f"{e} {statistics.median(v)/1000:.1f}k" for e, v in sorted(fio.items()))
    print(f"{k[0]} {k[1]} d{k[2]}: ceiling {cm/1000:.1f}k ({best}), native {nm/1000:.1f}k = {nm/cm:.3f}, "
          f"{results.utest_values(nat, fio[best]).text()}, n={len(nat)}/{len(fio[best])}")
    print(f"   fio: {others}")
    print(f"   native runs: {' '.join(f'{x/1000:.0f}' for x in nat)}; ceiling runs: {' '.join(f'{x/1000:.0f}' for x in fio[best])}")
