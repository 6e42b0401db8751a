import sys, statistics as st
# per request: recv of data (exit, >=4096) -> io_submit enter; io_submit; io_submit exit -> send enter; send exit -> next recv-data exit
RECV={45,47,0}; SEND={44,46,1}
ev=[]
for line in open(sys.argv[1]):
    f=line.split()
    if len(f)<5: continue
    t=float(f[1].rstrip(':'))*1e6; kind='in' if 'enter' in f[2] else 'out'; nr=int(f[4])
    ret=int(f[-1]) if kind=='out' and f[-1].lstrip('-').isdigit() else None
    ev.append((t,kind,nr,ret))
rows=[];cur=None;last_send=None;nsys=0
for t,k,nr,ret in ev:
    if k=='in': nsys+=1
    if k=='out' and nr in (45,47) and ret is not None and ret>=4096:
        if cur and 'send_out' in cur: rows.append(cur)
        cur={'recv':t,'prev_send':last_send,'n0':nsys}
    elif cur is None: continue
    elif k=='in' and nr==209: cur['ios_in']=t
    elif k=='out' and nr==209: cur['ios_out']=t
    elif k=='in' and nr in (44,46) and 'ios_out' in cur and 'send_in' not in cur: cur['send_in']=t
    elif k=='out' and nr in (44,46) and 'send_in' in cur and 'send_out' not in cur: cur['send_out']=t; last_send=t; cur['n1']=nsys
rows=[r for r in rows if 'ios_in' in r and 'send_out' in r]
def q(v): return (round(st.median(v),1), round(st.mean(v),1))
print(sys.argv[1], 'n', len(rows))
print(' recv->io_submit', q([r['ios_in']-r['recv'] for r in rows]))
print(' io_submit', q([r['ios_out']-r['ios_in'] for r in rows]))
print(' io_submit->send', q([r['send_in']-r['ios_out'] for r in rows]))
print(' send', q([r['send_out']-r['send_in'] for r in rows]))
nx=[r['recv']-r['prev_send'] for r in rows if r['prev_send']]
print(' send->next recv', q(nx))
print(' cycle', q([b['recv']-a['recv'] for a,b in zip(rows,rows[1:])]))
print(' syscalls/req', round(st.mean([b['n0']-a['n0'] for a,b in zip(rows,rows[1:])]),1))
