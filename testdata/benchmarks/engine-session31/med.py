# Medians, ranges and the U test (benchmarks/results.py) of "NAME VALUE" lines: med.py FILE [REFERENCE_NAME]
import sys, statistics, collections
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../benchmarks")); from results import mann_whitney_u
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    k,v=l.split(); d[k].append(int(v))
ref=sys.argv[2] if len(sys.argv)>2 else None
for k,v in d.items():
    s='%-12s n=%d median %7d  [%d..%d]' % (k,len(v),statistics.median(v),min(v),max(v))
    if ref and k!=ref: s+='  vs %s %.2f p=%.3f' % (ref, statistics.median(v)/statistics.median(d[ref]), mann_whitney_u(v,d[ref])[1])
    print(s)
