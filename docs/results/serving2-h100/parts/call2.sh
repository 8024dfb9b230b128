#!/bin/bash
# Final call 2: the serving suite on both models (all contenders interleaved), a profile, and
# vmem.pool's sleep/wake on CUDA. Everything is packed into $OUT/call2.tgz at the end.
R="--requests 64 --new-tokens 48"
C=paged-sdpa-256-graphs,fi-paged-graphs,vmem-token-major,vmem-token-major-graphs,vmem-per-layer-graphs
BUDGET=200 bash .carry/final/suite.sh p8b --only model=llama3-8b-x8 --only contender=$C $R
BUDGET=200 bash .carry/final/suite.sh p1b --only model=llama3.2-1b --only contender=$C $R
BUDGET=60 bash .carry/final/suite.sh prof --profile vmem-token-major-graphs --only model=llama3.2-1b \
  --only trace=conv --only budget=fits --check-requests 0 $R
export PYTHONPATH=/tmp/site-final PYTHONUNBUFFERED=1
mkdir -p $OUT/pool
timeout 60 python3 python/benches/pool_sleep.py --out $OUT/pool/pool_sleep.json 2>&1 | tee $OUT/pool/pool_sleep.log
timeout 60 python3 python/benches/pool_sleep.py --layers 32 --requests 8 --tokens 8192 --repeats 3 \
  --out $OUT/pool/pool_sleep_32l.json 2>&1 | tee $OUT/pool/pool_sleep_32l.log
cd $OUT && tar czf call2.tgz --exclude=call2.tgz . && find . -mindepth 1 ! -name call2.tgz -delete
ls -la $OUT
