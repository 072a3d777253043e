#!/usr/bin/env bash
# The commands behind each result file of docs/benchmarks.md, in the order of its tables (GPU
# machine, repository root; DeepSpeed and torchao rows: pip install -e ".[peers]").
#   bash benchmarks/reproduce.sh            # print the commands
#   bash benchmarks/reproduce.sh run        # run them all (hours)
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -d '' COMMANDS <<'END' || true
bash benchmarks/run_gpu.sh bench            # transfer.py, then fsdp_offload.py (default rows) at bs 4, 8, 16
S="--steps 4 --warmup 2" B="coherent(early;host;next-fwd;last=0.5;keep=1;ac;depth=1;units=2)"
python benchmarks/fsdp_offload.py --batch-sizes 4 $S \
    --rows "resident,resident;ac,stock_cpu_offload+fused_cpu_adamw,stock_cpu_offload+fused_cpu_adamw;ac,coherent(early;host;next-fwd),coherent(early;split=0.5;next-fwd),coherent(stream),coherent(early;host;next-fwd;modules=0.5),coherent(early;split=0.4;next-fwd;last=0.625;keep=5;ac;depth=1),${B%)};cast=device),$B,coherent(early;host;next-fwd;cast=device)" \
    --out benchmarks/results/fsdp_offload_bs4_default_rows.json
F="coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;units=2;cast=device" D="coherent(default" C=",$D;clip),$D;user-clip)"
python benchmarks/fsdp_offload.py --batch-sizes 4 --steps 3 --warmup 2 --out benchmarks/results/fsdp_offload_contract_bs4.json \
    --rows "resident,$D)$C,$F),$F;clip),$F;user-clip),$D;accum=4)"   # its default rows: S, as resolved then
python benchmarks/fsdp_offload.py --batch-sizes 4,16 --steps 3 --warmup 2 --rows "$D)$C" --out benchmarks/results/fsdp_offload_default_clip.json
G="coherent(host;next-fwd;last=0.75;ac;depth=1" && python benchmarks/fsdp_offload.py --batch-sizes 16 --steps 2 --warmup 2 \
    --rows "resident,$D)$C,$G),$G;clip),$G;user-clip)" --out benchmarks/results/fsdp_offload_contract_bs16.json
python benchmarks/models.py --max-seconds 520   # three models; capped: --batch-sizes none --max-seconds 510 --row-timeout 110
python benchmarks/models.py --batch-sizes none --models llama-1b-hf --only default,planned --steps 6 --max-seconds 110 --row-timeout 90
python benchmarks/activations.py --repeats 3 --steps 5 --warmup 2 --skip-rows "fsdp2,fsdp2+act(all),fsdp2+act(fraction)" --out benchmarks/results/activations_default_rows.json
python benchmarks/planner_validate.py --offline --out benchmarks/results/planner_validate.json --plot docs/img/planner_validate.png  # CPU: reads the files above
python benchmarks/plot_results.py           # the plots under docs/img/ (bs 16: --batch-sizes 16, the first five rows)
python benchmarks/user_loop.py --out benchmarks/results/user_loop.json   # DeepSpeed: pip install -e ".[peers]"
python benchmarks/user_loop.py --rows "resident,every;cap=24,every;cap=24;compile,resident;compile" --out benchmarks/results/user_loop_compiled.json
python benchmarks/user_loop.py --rows "resident,fsdp1;cap=24;offload_optimizer,every;cap=24,fsdp1;cap=24" --out benchmarks/results/user_loop_fsdp1.json
# user_loop_40gib_accum.json: the row once as is (it ran out of memory), once more with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and --steps 2 --warmup 1; the file holds both rows
python benchmarks/user_loop.py --rows "plan;cap=40;accum=4" --out /tmp/user_loop_40gib.json
python benchmarks/user_loop.py --rows "plan;cap=40;accum=4,plan;cap=40,plan;cap=40;clip,plan;cap=24,plan;cap=24;clip,plan;cap=24;accum=4" --out benchmarks/results/user_loop_headroom.json
python benchmarks/user_loop.py --rows "plan;cap=24;clip,plan;cap=24,plan;cap=40;clip,plan;cap=40" --out benchmarks/results/user_loop_clip.json
python benchmarks/user_loop.py --layers 10 --model-dir /tmp/user_loop_1b --steps 4 --warmup 2 --rows "resident,every;memory=pinned,every;memory=managed,every;memory=managed;platform=coherent,every;memory=pinned;platform=unified,every;memory=managed;platform=unified" --out benchmarks/results/user_loop_shard_memory.json
python benchmarks/shard_memory_link.py --out benchmarks/results/shard_memory_link.json
python benchmarks/peers.py --batch-sizes 4,16 --out benchmarks/results/peers.json   # DeepSpeed, torchao: pip install -e ".[peers]"
python benchmarks/peers.py --batch-sizes none --capacity --caps 16,24,40 --seed-from benchmarks/results/peers.json --resume-from benchmarks/results/peers_capacity.json --max-seconds 540 --out benchmarks/results/peers_capacity.json  # each run resumes the last (written after every probe); --capacity-systems, --caps narrow it
END
if [ "${1:-}" = run ]; then
  eval "$COMMANDS"
else
  printf '%s\n' "$COMMANDS"
fi
