#!/usr/bin/env python3
"""The ceiling of this machine for issue 19's "served >= 0.8 of local at
depth 64" (README, "Serving images over NBD: benchmarks"): fio's nbd engine,
4 KiB randread/randwrite at depth 64, unix socket and TCP, against nbdkit
null 1G and memory 1G (no storage cost), imgtool nbd and qemu-nbd serving a
raw file in tmpfs and the qcow2 image, then `imgtool bench` locally (the
commands of benchmarks/nbd_bench.cc). Every cell once per repetition,
interleaved. One JSON line per run: IOPS, the server's CPU time per request
(/proc/PID/stat utime + stime, threads that ended included), fio's own CPU
time per request (getrusage of the child), the server's context switches
per request (its live threads) and the load average.

Setup (root), DIR=/var/tmp/srvperf by default:
  qemu-img create -q -f qcow2 -o cluster_size=64k,extended_l2=on,extent_size_hint=1M DIR/fio.qcow2 1G
  qemu-img bench -q -f qcow2 -w -t none -d 16 -s 1M -S 1M --pattern=170 -c 1024 DIR/fio.qcow2
  dd if=/dev/zero of=/dev/shm/srvperf.raw bs=1M count=1024
  cp bazel-bin/imgtool/imgtool DIR/imgtool-base   # the binary to compare with
Run: IMGTOOL=path/to/imgtool REPS=3 SECS=4 python3 benchmarks/nbd_ceiling.py > out.jsonl
(ONLY=name,name,local limits the servers.)"""
import json, os, subprocess, sys, time, socket
D = os.environ.get('DIR', '/var/tmp/srvperf')
IMG = os.environ.get('IMGTOOL', D + '/imgtool-base')
REPS = int(os.environ.get('REPS', '3'))
SECS = os.environ.get('SECS', '4')
ONLY = os.environ.get('ONLY', '')
SOCK = D + '/s.sock'
port = [20809]
RAW = '/dev/shm/srvperf.raw'
Q = D + '/fio.qcow2'
def servers():
    return {
      'nbdkit-null': lambda a: ['nbdkit', '-f'] + a + ['null', '1G'],
      'nbdkit-memory': lambda a: ['nbdkit', '-f'] + a + ['memory', '1G'],
      'imgtool-raw': lambda a: [IMG, 'nbd', '-f', 'raw', '-t'] + a + [RAW],
      'qemu-nbd-raw': lambda a: ['qemu-nbd', '-f', 'raw', '-t'] + a + [RAW],
      'imgtool-qcow2': lambda a: [IMG, 'nbd', '-f', 'qcow2', '--cache=none', '--aio=native', '-t'] + a + [Q],
      'imgtool-qcow2-main': lambda a: [D + '/imgtool-base', 'nbd', '-f', 'qcow2', '--cache=none', '--aio=native', '-t'] + a + [Q],
      'qemu-nbd-qcow2': lambda a: ['qemu-nbd', '-f', 'qcow2', '--cache=none', '--aio=native', '-t'] + a + [Q],
    }
def cpu(pid):
    # The process's own counters include threads that have ended.
    f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')
def ctx(pid):
    v = n = 0
    for t in os.listdir(f'/proc/{pid}/task'):
        for line in open(f'/proc/{pid}/task/{t}/status'):
            if line.startswith('voluntary_ctxt'): v += int(line.split()[1])
            if line.startswith('nonvoluntary_ctxt'): n += int(line.split()[1])
    return v + n
def wait_listen(tr, p):
    for _ in range(500):
        try:
            s = socket.socket(socket.AF_UNIX if tr == 'unix' else socket.AF_INET)
            s.connect(SOCK if tr == 'unix' else ('127.0.0.1', p)); s.close(); return
        except OSError: time.sleep(0.02)
    raise RuntimeError('no listen')
def run_server(name, tr):
    p = port[0]; port[0] += 1
    if os.path.exists(SOCK): os.unlink(SOCK)
    if name.startswith('nbdkit'):
        a = ['-U', SOCK] if tr == 'unix' else ['-i', '127.0.0.1', '-p', str(p)]
    else:
        a = ['-k', SOCK] if tr == 'unix' else ['-b', '127.0.0.1', '-p', str(p)]
    pr = subprocess.Popen(servers()[name](a), stdout=subprocess.DEVNULL, stderr=open(D + '/server.err', 'w'))
    wait_listen(tr, p)
    uri = f'nbd+unix:///?socket={SOCK}' if tr == 'unix' else f'nbd://127.0.0.1:{p}/'
    return pr, uri
import resource
def fio(uri, rw):
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(['fio', '--name=nbd', '--ioengine=nbd', '--uri=' + uri, '--rw=' + rw, '--bs=4096',
        '--iodepth=64', '--time_based', f'--runtime={SECS}', '--randrepeat=0', '--norandommap',
        '--output-format=json'], capture_output=True, text=True).stdout
    j = json.loads(out[out.find('{'):])['jobs'][0]
    side = j['write' if rw == 'randwrite' else 'read']
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    fio_cpu[0] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return side['total_ios'], j['job_runtime'] / 1000
fio_cpu = [0.0]
def local(rw):
    c = '200000' if rw == 'randread' else '100000'
    argv = [IMG, 'bench', '-f', 'qcow2', '-t', 'none', '-i', 'native', '-d', '64', '-s', '4k', '-S', '4182016', '-c', c]
    if rw == 'randwrite': argv.append('-w')
    t0 = time.time(); r = subprocess.run(argv + [Q], capture_output=True, text=True, cwd=D)
    import re
    m = re.search(r'Run completed in ([\d.]+) seconds', r.stdout)
    return int(c) / float(m.group(1))
res = []
for rep in range(REPS):
    for name in servers():
        if ONLY and name not in ONLY.split(','): continue
        for tr in ('unix', 'tcp'):
            for rw in ('randread', 'randwrite'):
                pr, uri = run_server(name, tr)
                c0, x0 = cpu(pr.pid), ctx(pr.pid)
                ios, secs = fio(uri, rw)
                time.sleep(0.1)
                c1, x1 = cpu(pr.pid), ctx(pr.pid)
                pr.terminate(); pr.wait()
                r = dict(rep=rep, server=name, tr=tr, rw=rw, iops=round(ios / secs),
                         cpu_us_per_req=round((c1 - c0) * 1e6 / ios, 1), client_us_per_req=round(fio_cpu[0] * 1e6 / ios, 1), ctxsw_per_req=round((x1 - x0) / ios, 2),
                         load=os.getloadavg()[0])
                print(json.dumps(r), flush=True); res.append(r)
    if not ONLY or 'local' in ONLY:
        for rw in ('randread', 'randwrite'):
            r = dict(rep=rep, server='local-imgtool-bench', tr='-', rw=rw, iops=round(local(rw)), load=os.getloadavg()[0])
            print(json.dumps(r), flush=True); res.append(r)
