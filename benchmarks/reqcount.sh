#!/usr/bin/env bash
# Counts per request (issue 20 part 1): syscalls by kind, context switches
# and task-clock CPU of imgtool bench and fio for 4 KiB O_DIRECT random reads
# and writes at one queue depth, on a raw file written in full on a fresh
# XFS (or ext4) loop mount:
#
#   imgtool   bench -f raw -t none -d DEPTH -s 4k --random=1 -c N [-w] -i E
#             (E: io_uring, native, threads)
#   fio       --rw=randread|randwrite --bs=4k --direct=1 --iodepth=DEPTH
#             --norandommap --number_ios=N --ioengine=E (E: io_uring, libaio)
#
# Counts, not IOPS: what a request costs in syscalls, sleeps and CPU, which
# depends little on the machine's load (IOPS do, a lot). Every configuration
# runs under `perf stat` twice, with N/4 and N requests; a count per request
# is (count at N - count at N/4) / (3N/4), so process start, ring and file
# set-up and fio's file checks drop out. fio's main process (status
# updates) is in its counts. ROUNDS rounds, each running every
# configuration once in the order given (binaries alternating); the table
# shows the median of the rounds and, for CPU, every round.
#
#   sudo benchmarks/reqcount.sh
#
# Environment:
#   IMGTOOL    imgtool binary (skips the build); IMGTOOLS: several, compared
#              as imgtool1, imgtool2, ... (e.g. before and after a change)
#   CONFIGS    of imgtool:io_uring imgtool:native imgtool:threads
#              fio:io_uring fio:libaio (default: all but threads)
#   OPS        of randread randwrite (default both)
#   DEPTH      queue depth (default 1)
#   COUNT      requests of the longer run (default 40000)
#   ROUNDS     (default 1)
#   FS         xfs or ext4 (default xfs)
#   FILE_MIB   size of the raw file (default 1024)
#   WORKDIR    where the backing file goes (default /var/tmp)
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIGS=${CONFIGS:-"imgtool:io_uring imgtool:native fio:io_uring fio:libaio"}
OPS=${OPS:-"randread randwrite"}
DEPTH=${DEPTH:-1}
COUNT=${COUNT:-40000}
ROUNDS=${ROUNDS:-1}
FS=${FS:-xfs}
FILE_MIB=${FILE_MIB:-1024}
[[ $FS == xfs || $FS == ext4 ]] || { echo "reqcount.sh: FS must be xfs or ext4" >&2; exit 1; }

source benchmarks/side_by_side_lib.sh
[[ -n ${IMGTOOLS:-} ]] && IMGTOOL=${IMGTOOL:-${IMGTOOLS%% *}}
sbs_setup reqcount.sh imgtool-reqcount fio perf qemu-img "mkfs.$FS"
read -r -a binaries <<< "${IMGTOOLS:-$IMGTOOL}"

EVENTS="task-clock,context-switches,raw_syscalls:sys_enter"
KINDS="io_uring_enter io_submit io_getevents io_pgetevents ppoll poll read write futex clock_gettime nanosleep clock_nanosleep"
for k in $KINDS; do EVENTS+=",syscalls:sys_enter_$k"; done

truncate -s $(((FILE_MIB + 512) * 1048576)) "$work/fs.img"
"mkfs.$FS" -q "$work/fs.img"
mount -o loop "$work/fs.img" "$mnt"
qemu-img create -q -f raw -o preallocation=full "$mnt/bench.raw" "${FILE_MIB}M"
sync

# run LABEL OP N: one perf stat of one configuration; prints "event value"
# lines (task-clock in ms).
run() {
  local label=$1 op=$2 n=$3 tool engine bin
  tool=${label%%:*} engine=${label#*:}
  local cmd
  if [[ $tool == fio ]]; then
    cmd=(fio --name=reqcount --filename="$mnt/bench.raw" --rw="$op" --bs=4k
         --direct=1 --ioengine="$engine" --iodepth="$DEPTH" --norandommap
         --randrepeat=0 --size="${FILE_MIB}M" --number_ios="$n"
         --output=/dev/null)
  else
    bin=${binaries[${tool#imgtool} - 1]}
    cmd=("$bin" bench -f raw -t none -d "$DEPTH" -s 4k --random=1 -c "$n"
         -i "$engine" "$mnt/bench.raw")
    [[ $op == randwrite ]] && cmd+=(-w)
  fi
  sbs_settle
  perf stat -x, -o "$work/perf" -e "$EVENTS" -- "${cmd[@]}" >/dev/null ||
    sbs_fail "${cmd[*]} failed"
  awk -F, '!/^#/ && NF > 2 { sub(/^syscalls:sys_enter_/, "", $3);
    sub(/^raw_syscalls:sys_enter$/, "syscalls", $3); print $3, $1 }' "$work/perf"
}

# The configurations: imgtool ones once per binary.
configs=()
for c in $CONFIGS; do
  if [[ $c == imgtool:* && ${#binaries[@]} -gt 1 ]]; then
    for i in "${!binaries[@]}"; do configs+=("imgtool$((i + 1)):${c#*:}"); done
  else
    configs+=("${c/#imgtool:/imgtool1:}")
  fi
done

n1=$((COUNT / 4))
for ((r = 1; r <= ROUNDS; r++)); do
  for op in $OPS; do
    for c in "${configs[@]}"; do
      run "$c" "$op" "$n1" > "$work/a"
      run "$c" "$op" "$COUNT" > "$work/b"
      # per request: (b - a) / (COUNT - n1); CPU in microseconds
      awk -v d=$((COUNT - n1)) -v key="$op $c" 'NR == FNR { a[$1] = $2; next }
        { v = ($2 - a[$1]) / d; if ($1 == "task-clock") v *= 1000;
          print key, $1, v }' "$work/a" "$work/b" >> "$work/counts"
    done
  done
done

# Markdown table: medians over the rounds.
echo "| op | tool:engine | CPU us/request (rounds) | context switches | syscalls | by kind (>= 0.01 per request) |"
echo "|---|---|---:|---:|---:|---|"
for op in $OPS; do
  for c in "${configs[@]}"; do
    awk -v key="$op $c" -v kinds="$KINDS" '
      $1 " " $2 == key { v[$3] = v[$3] " " $4 }
      function median(s,   a, n, i, j, t) {
        n = split(s, a, " ")
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
          if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
      }
      END {
        n = split(kinds, k, " "); by = ""
        for (i = 1; i <= n; i++) {
          m = median(v[k[i]])
          if (m >= 0.01) by = by (by == "" ? "" : ", ") sprintf("%s %.2f", k[i], m)
        }
        split(key, p, " ")
        cpu = ""; split(v["task-clock"], t, " ")
        for (i = 1; i in t; i++) cpu = cpu (cpu == "" ? "" : " ") sprintf("%.2f", t[i])
        printf "| %s | %s | %.2f (%s) | %.2f | %.2f | %s |\n", p[1], p[2],
          median(v["task-clock"]), cpu, median(v["context-switches"]),
          median(v["syscalls"]), by
      }' "$work/counts"
  done
done
[[ ${#binaries[@]} -le 1 ]] || for i in "${!binaries[@]}"; do
  echo "imgtool$((i + 1)): ${binaries[$i]}"
done
echo "depth $DEPTH, $FS, $COUNT and $n1 requests per configuration, $ROUNDS round(s); load average $(cut -d' ' -f1-3 /proc/loadavg)"
