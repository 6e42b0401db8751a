import sys, re, statistics
# perf script lines: tid time: event: NR id ...
ev=[]
for l in open(sys.argv[1]):
    m = re.search(r'\s(\d+\.\d+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)', l)
    if m: ev.append((float(m.group(1)), m.group(2), int(m.group(3))))
SUB=209; GET={208, 333}  # io_submit, io_getevents, io_pgetevents (x86_64)
user=[]; dev=[]; sub=[]
last_get_exit=None; last_sub_exit=None; sub_enter=None
for t, k, nr in ev:
    if nr == SUB and k == 'enter':
        if last_get_exit is not None: user.append(t - last_get_exit)
        sub_enter = t
    elif nr == SUB and k == 'exit':
        last_sub_exit = t
        if sub_enter is not None: sub.append(t - sub_enter)
    elif nr in GET and k == 'exit':
        if last_sub_exit is not None: dev.append(t - last_sub_exit)
        last_get_exit = t; last_sub_exit = None
f = lambda v: '%.1f us (n=%d)' % (statistics.median(v) * 1e6, len(v)) if v else '-'
print(sys.argv[1], 'getevents-exit -> submit-enter', f(user), '| io_submit', f(sub), '| submit-exit -> getevents-exit', f(dev))
