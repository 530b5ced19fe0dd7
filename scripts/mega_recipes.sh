#!/usr/bin/env bash
# The Mega MoE kernel under both FP8 x FP4 recipes on one GPU (EP1): flash and pro at $TOKENS tokens/rank, recipe
# (1, 1, 32) against (1, 1, 128) (each point checked against its recipe's reference first); receipts in $OUT.
#   scripts/mega_recipes.sh            (OUT=bench/results/mega-recipes, TOKENS=8,512,2048,8192)
# Compare the "us" of the same preset and tokens/rank between the r32 and r128 receipts.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/mega-recipes}
tokens=${TOKENS:-8,512,2048,8192}
mkdir -p "$out"
for preset in flash pro; do
  for recipe in 32 128; do
    NPROC=1 scripts/ep.sh megamoe.bench --preset "$preset" --tokens "$tokens" --recipe "$recipe" --paths mega \
      --json "$out/$preset-r$recipe.json"
  done
done
