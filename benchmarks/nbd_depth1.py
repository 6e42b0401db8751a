#!/usr/bin/python3
"""A/B of NBD servers at one fio cell (issue 19's depth-1 cells, README "Serving
images over NBD"): fio's nbd engine (RW, DEPTH, SECS s per run) against
qemu-nbd and each server in SRV, all `-f qcow2 --cache=none --aio=native -t`
on the image Q, over TR (tcp: 127.0.0.1, unix: a socket), the servers in a
rotated order each repetition. One JSON line per run: IOPS, the server's CPU
time per request (/proc/PID/stat), the load average.

Setup (root): an XFS loop mount holding a fully written qcow2, e.g.
  truncate -s 3G /var/tmp/d1/xfs.img && mkfs.xfs -q /var/tmp/d1/xfs.img
  mkdir -p /var/tmp/d1/mnt && mount -o loop /var/tmp/d1/xfs.img /var/tmp/d1/mnt
  qemu-img create -q -f qcow2 -o cluster_size=64k,extended_l2=on,extent_size_hint=1M /var/tmp/d1/mnt/fio.qcow2 1G
  qemu-img bench -q -f qcow2 -w -t none -d 16 -s 1M -S 1M -c 1024 /var/tmp/d1/mnt/fio.qcow2
Run: SRV="new=path/to/imgtool,nbd old=other/imgtool,nbd" RW=randwrite DEPTH=1 TR=tcp \
     REPS=6 SECS=3 python3 benchmarks/nbd_depth1.py > out.jsonl
Summary (median IOPS and its ratio to qemu-nbd's per server):
     python3 benchmarks/nbd_depth1.py summary out.jsonl
"""
import json, os, subprocess, sys, time, socket
import statistics

if len(sys.argv) == 3 and sys.argv[1] == 'summary':
    runs = {}
    for line in open(sys.argv[2]):
        r = json.loads(line)
        runs.setdefault(r['srv'], []).append(r)
    base = statistics.median(r['iops'] for r in runs['qemu-nbd'])
    for name, rs in runs.items():
        iops = sorted(r['iops'] for r in rs)
        med = statistics.median(iops)
        print(name, 'median', med, 'ratio %.3f' % (med / base), iops,
              'cpu_us', statistics.median(r['cpu_us'] for r in rs))
    sys.exit(0)
D='/var/tmp/d1'; Q=os.environ.get('Q', D+'/mnt/fio.qcow2'); SOCK=D+'/s.sock'
REPS=int(os.environ.get('REPS','4')); SECS=os.environ.get('SECS','3')
RW=os.environ.get('RW','randwrite'); DEPTH=os.environ.get('DEPTH','1'); TR=os.environ.get('TR','tcp')
srv={'qemu-nbd':['qemu-nbd']}
for kv in os.environ.get('SRV','').split():
    k,v=kv.split('=',1); srv[k]=v.split(',')
port=[21000]
def cpu(pid):
    f=open(f'/proc/{pid}/stat').read().rsplit(')',1)[1].split(); return (int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK')
for rep in range(REPS):
  items=list(srv.items()); items=items[rep%len(items):]+items[:rep%len(items)]
  for name,argv in items:
    port[0]+=1; p_=port[0]
    if os.path.exists(SOCK): os.unlink(SOCK)
    addr=['-k',SOCK] if TR=='unix' else ['-b','127.0.0.1','-p',str(p_)]
    p=subprocess.Popen(argv+['-f','qcow2','--cache=none','--aio=native','-t']+addr+[Q],stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            s=socket.socket(socket.AF_UNIX if TR=='unix' else socket.AF_INET); s.connect(SOCK if TR=='unix' else ('127.0.0.1',p_)); s.close(); break
        except OSError: time.sleep(0.02)
    uri=f'nbd+unix:///?socket={SOCK}' if TR=='unix' else f'nbd://127.0.0.1:{p_}/'
    c0=cpu(p.pid)
    out=subprocess.run(['fio','--name=n','--ioengine=nbd',f'--uri={uri}',f'--rw={RW}','--bs=4096',f'--iodepth={DEPTH}','--time_based',f'--runtime={SECS}','--randrepeat=0','--norandommap','--output-format=json'],capture_output=True,text=True).stdout
    j=json.loads(out[out.find('{'):])['jobs'][0]; side=j['write' if 'write' in RW else 'read']; ios=side['total_ios']; secs=j['job_runtime']/1000
    c1=cpu(p.pid); p.terminate(); p.wait()
    print(json.dumps(dict(rep=rep,srv=name,iops=round(ios/secs),cpu_us=round((c1-c0)*1e6/ios,1),load=os.getloadavg()[0])),flush=True)
