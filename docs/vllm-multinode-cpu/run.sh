#!/bin/bash
# Two vLLM "nodes" on this host: rank 0 (API server + engine core + worker 0), rank 1 (--headless, worker 1).
set -u
D=/tmp/vllm-mn
PY=$HOME/.cache/weightlift/vllm-0.32.0/bin/python
cd $D
ls /tmp | grep '^vllm_dist_' > $D/tmp-before.txt; ls /dev/shm > $D/shm-before.txt
t0=$(date +%s)
echo "make model: $(date -u +%T)"
PYTHONPATH=. $PY -m weightlift.local.llm $D/model --layers 2 --hidden 256 > $D/make-model.log 2>&1 || { echo model failed; cat $D/make-model.log; exit 1; }
read MP API < <($PY -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
echo "master port $MP api port $API"
COMMON=(serve $D/model --served-model-name llm --tensor-parallel-size 2 --distributed-executor-backend mp
  --nnodes 2 --master-addr 127.0.0.1 --master-port $MP
  --load-format auto --enforce-eager --max-model-len 256 --dtype float32)
ENVS=(VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CACHE_ROOT=$D/cache HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_LOGGING_LEVEL=INFO)
echo "start rank1 + rank0: $(date -u +%T)"
env "${ENVS[@]}" VLLM_CPU_OMP_THREADS_BIND=1 setsid $PY $D/vserve.py "${COMMON[@]}" --node-rank 1 --headless > $D/rank1.log 2>&1 &
echo $! > $D/rank1.pid
env "${ENVS[@]}" VLLM_CPU_OMP_THREADS_BIND=0 setsid $PY $D/vserve.py "${COMMON[@]}" --node-rank 0 --host 127.0.0.1 --port $API > $D/rank0.log 2>&1 &
echo $! > $D/rank0.pid
ok=0
while [ $(( $(date +%s) - t0 )) -lt 480 ]; do
  if curl -sf http://127.0.0.1:$API/health >/dev/null; then ok=1; break; fi
  kill -0 $(cat $D/rank0.pid) 2>/dev/null || { echo "rank0 exited"; break; }
  kill -0 $(cat $D/rank1.pid) 2>/dev/null || { echo "rank1 exited"; break; }
  sleep 2
done
echo "health ok=$ok after $(( $(date +%s) - t0 ))s ($(date -u +%T))"
if [ $ok = 1 ]; then
  curl -s http://127.0.0.1:$API/v1/completions -H 'content-type: application/json' \
    -d '{"model":"llm","prompt":"hello world","max_tokens":8,"temperature":0}' > $D/completion.json
  echo "completion: $(cat $D/completion.json)"
  echo "expected (transformers greedy): $(cat $D/model/probe.json)"
fi
echo "stopping: $(date -u +%T)"
for r in 0 1; do kill -TERM -- -$(cat $D/rank$r.pid) 2>/dev/null; done
sleep 15
for r in 0 1; do kill -KILL -- -$(cat $D/rank$r.pid) 2>/dev/null; done
echo "done $(( $(date +%s) - t0 ))s"
