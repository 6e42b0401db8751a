#!/bin/bash
# usage: trace3.sh NAME SERVER-ARGV0...  -> /var/tmp/s26/tr-NAME.txt: the server's syscalls in 0.5 s of depth-1 randwrite over TCP
name=$1; shift; port=$((22000 + RANDOM % 1000))
"$@" -f qcow2 --cache=none --aio=native -t -b 127.0.0.1 -p $port /var/tmp/d1/mnt/fio.qcow2 2>/dev/null & pid=$!
sleep 0.5
fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$port/" --rw=randwrite --bs=4096 --iodepth=1 --time_based --runtime=3 --randrepeat=0 --norandommap --output-format=json > /var/tmp/s26/fio-$name.json &
fpid=$!
sleep 1
perf record -q -o /var/tmp/s26/perf-$name.data -e 'raw_syscalls:sys_enter,raw_syscalls:sys_exit' -p $pid -- sleep 0.5 2>/dev/null
wait $fpid; kill $pid; wait $pid 2>/dev/null
perf script -i /var/tmp/s26/perf-$name.data -F tid,time,event,trace 2>/dev/null > /var/tmp/s26/tr-$name.txt
/usr/bin/python3 -c "import json;s=open(\"/var/tmp/s26/fio-$name.json\").read();j=json.loads(s[s.find(\"{\"):]);print(\"$name\", round(j[\"jobs\"][0][\"write\"][\"iops\"]))"
