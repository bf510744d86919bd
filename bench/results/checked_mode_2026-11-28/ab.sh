#!/bin/bash
# A/B: 057ee32 (base) vs HEAD (new), interleaved, same machine state. Prints the relevant lines.
. /work/venv/bin/activate
for round in 1 2; do
  for v in /tmp/wt_base /tmp/wt; do
    for b in ddp fsdp; do
      echo "== round $round $v $b $(uptime | sed 's/.*load average/load/')"
      (cd $v && PYTHONPATH=$v timeout 900 python bench/$b.py --checked --steps 30 2>&1 | grep -E "s/step")
    done
    [ $round = 1 ] || continue; echo "== round $round $v overhead"
    (cd $v && PYTHONPATH=$v timeout 900 python bench/overhead.py --steps 20 2>&1 | grep -E "fshard|torch|ratio" | head -8)
  done
done
