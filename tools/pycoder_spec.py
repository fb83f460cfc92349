"""pycoder-mini with its dflash drafter: mean tau for a chain and DDTree budgets 8..64 on the held-out prompts
(tools/pycoder_heldout_prompts.json, 64 new tokens, T = 0) on the reference backend, each output checked
against AR. Writes the rows to the JSON path given (default /dev/stdout)."""
import json
import sys
import time
from pathlib import Path

import numpy as np
from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
prompts = json.load(open(Path(__file__).with_name("pycoder_heldout_prompts.json")))
engine = api.load("pycoder-mini", backend="reference")
rows = []
for label, budget, topk in [("chain", 7, 1), ("ddtree", 8, None), ("ddtree", 16, None), ("ddtree", 32, None), ("ddtree", 64, None)]:
    taus, equal, t0 = [], 0, time.time()
    for p in prompts:
        cfg = DecodeConfig(64, mode="ddtree", drafter="dflash", block_size=8, budget=budget, topk=topk)
        golden = engine.golden_for(p, cfg)
        r = engine.generate(p, cfg, golden=golden)
        taus += r.taus
        equal += int(bool(r.golden_match))
    rows.append(dict(run=label, budget=budget, topk=topk or "min(B,V)", mean_tau=float(np.mean(taus)), steps=len(taus), equal_to_ar=f"{equal}/{len(prompts)}", seconds=round(time.time()-t0, 1)))
    print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdout", "w"), indent=1)
