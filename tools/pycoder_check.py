"""pycoder-mini AR against its float64 golden on held-out prompts, token for token, with max |dlogit|.

    python3 tools/pycoder_check.py OUT.json [BACKEND=cuda] [NEW_TOKENS=256]

The prompts: the first 8 of engine/model/presets/pycoder-mini/heldout_prompts.json (tools/pycoder_prompts.py: the
first 32 tokens of held-out files longer than 64 tokens, in the held-out stream's order; docs/pycoder-mini.md).
A divergence prints the golden's top-1/top-2 margin there (a near-tie below 1e-4 is not a bug).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
from kdspec.engine.decode import api
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.model.checkpoint import model_directory

prompts = json.loads((Path(model_directory("pycoder-mini")) / "heldout_prompts.json").read_text())["prompts"][:8]
t = time.time()
engine = api.load("pycoder-mini", backend=sys.argv[2] if len(sys.argv) > 2 else "cuda")
print("load", round(time.time() - t, 1), "s", flush=True)
rows = []
for i, prompt in enumerate(prompts):
    config = DecodeConfig(int(sys.argv[3]) if len(sys.argv) > 3 else 256, mode="ar")
    golden = engine.golden_for(prompt, config)
    records = []
    result = engine.generate(prompt, config, golden=golden, on_step=records.append)
    out = np.asarray(result.tokens)
    gold = np.asarray(golden.tokens[:len(out)])
    diverge = np.flatnonzero(out != gold)
    dl = np.concatenate([np.asarray(r["logit_max_abs_diff"], float) for r in records])
    lg = np.asarray(golden.logits)
    top2 = np.sort(lg, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    first = int(diverge[0]) if len(diverge) else -1
    rows.append(dict(prompt=i, tokens=len(out), equal=int(len(diverge) == 0), first_divergence=first,
                     margin_at_divergence=float(margins[first]) if first >= 0 else None,
                     max_dlogit=float(np.nanmax(dl[:first] if first > 0 else dl))))
    print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("ALL EQUAL" if all(r["equal"] for r in rows) else "DIVERGENCES", "worst |dlogit|",
      max(r["max_dlogit"] for r in rows))
