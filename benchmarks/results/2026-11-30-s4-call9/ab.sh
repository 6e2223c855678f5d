set -u
R=$OUT/run; mkdir -p $R
B="--backends cuda_ptx --batches 4,16 --kv 65536,131072 --layouts contig,paged16 --peers= --varlen= --iters 25"
python3 benchmarks/bench_decode.py --out $R/new.json $B > $R/new.log 2>&1
cp -r backends/cuda_ptx /tmp/cuda_ptx_new && rm -rf backends/cuda_ptx && cp -r .snap/old/backends/cuda_ptx backends/cuda_ptx
python3 benchmarks/bench_decode.py --out $R/old.json $B > $R/old.log 2>&1
rm -rf backends/cuda_ptx && cp -r /tmp/cuda_ptx_new backends/cuda_ptx
python3 benchmarks/bench_decode.py --out $R/new2.json $B > $R/new2.log 2>&1
for f in new old new2; do echo "== $f"; grep -E "^32/8" $R/$f.log; done
