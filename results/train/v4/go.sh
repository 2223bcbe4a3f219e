#!/usr/bin/env bash
# Every phase of run.sh in order within one call's time (BUDGET seconds); call again to go on where it stopped.
export PYTHONPATH=/root/ppd-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - SECONDS > 5 ? BUDGET - SECONDS : 5 )); }
for phase in ${PHASES:-data train replay}; do
  timeout "$(left)" bash results/train/v4/run.sh $phase > /dev/null 2>&1
done
bash results/train/v4/run.sh collect 2>&1 | tail -12
