"""Print the scaling curve of a train-drafter run: held-out τ per checkpoint vs tokens.

  python scripts/scaling_table.py /work/train-data/smollm2/dspark-train-log.jsonl
"""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if '"heldout"' in line]
print("| step | tokens seen | tokens labelled | epoch | held-out τ | chat | code | math | p1 | train τ est |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    h = r["heldout"]
    print(f"| {r['step']} | {r['seen_tokens']:,} | {r['data_tokens']:,} | {r['epoch']} | {h['tau']:.3f} | "
          f"{h.get('tau_chat', float('nan')):.2f} | {h.get('tau_code', float('nan')):.2f} | "
          f"{h.get('tau_math', float('nan')):.2f} | {h['p1']:.3f} | {r['tau_est']:.2f} |")
