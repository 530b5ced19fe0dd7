#!/usr/bin/env bash
# The cost of zero padding on one GPU: each model shape whose H or I the SM90 kernels zero-pad (to multiples of
# kernels.sm90.K_MULTIPLE) against the padded shape itself run as the model's sizes (no padding: same kernel work,
# no pad / slice copies), at the model's expert count (EP1) and at one rank's share of EP8; both recipes, the Mega MoE
# kernel and the staged SM90 path. Every point is checked; receipts in $OUT.
#   scripts/padding_cost.sh            (OUT=bench/results/padding, TOKENS=1,8,128,512,2048,8192)
# Compare the "us" of the same tokens/rank, path and recipe between a model row and its "native" row. gpt-oss-120b
# (2880, run as 2944; recipe 128's Mega MoE runs H as 3072: its native row pads H too) is the one preset padded;
# Qwen3-30B-A3B (H 2048, I 768) runs as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/padding}
tokens=${TOKENS:-1,8,128,512,2048,8192}
mkdir -p "$out"
run() {  # name, recipe, paths, extra bench args...
  local name=$1 recipe=$2 paths=$3
  shift 3
  NPROC=1 scripts/ep.sh megamoe.bench --tokens "$tokens" --recipe "$recipe" --paths "$paths" --routings 2 \
    --json "$out/$name-r$recipe.json" "$@"
}
for experts in 128 16; do
  for recipe in 32 128; do
    paths=mega,sm90
    run "gpt-oss-120b-e$experts" "$recipe" "$paths" --preset gpt-oss-120b --experts "$experts"
    run "gpt-oss-120b-e$experts-native2944" "$recipe" "$paths" --preset gpt-oss-120b --experts "$experts" \
      --hidden 2944 --intermediate 2944
  done
done
