"""Greedy continuations of held-out function headers, with transformers' own ``generate``."""
from __future__ import annotations

import torch

from .tokenizer import ByteLevelDecoder


@torch.no_grad()
def greedy_continuations(model, prompts: list[dict], new_tokens: int, eod_id: int, decoder: ByteLevelDecoder,
                         device: torch.device) -> list[dict]:
    """For each prompt ({"relpath", "line", "header", "ids"}: ids = EOD + the header's tokens), the greedy
    continuation of up to ``new_tokens`` tokens (stopping at EOD): ids and text, as generated, unedited."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for p in prompts:
            x = torch.tensor([p["ids"]], dtype=torch.long, device=device)
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=eod_id, pad_token_id=eod_id)
            new = [int(t) for t in y[0, x.shape[1]:].tolist()]
            out.append({"relpath": p["relpath"], "line": p["line"], "prompt": p["header"],
                        "prompt_ids": list(p["ids"]), "continuation_ids": new,
                        "continuation": decoder.decode(new)})
    finally:
        model.train(was_training)
    return out
