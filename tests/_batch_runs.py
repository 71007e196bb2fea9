"""Running requests through a BatchEngine to the end while recording each step's logits, and the NMSE the GPU tests
compare those logits by (tests/test_batch_gpu.py, tests/test_batch_vision_gpu.py)."""


def run_recording(eng, requests):
    """requests: [(prompt_ids, params, add_request's keyword arguments)] -> ([tokens per request],
    [[logits of each step] per request]), in request order."""
    eng.record_logits = True
    ids = [eng.add_request(p, params, **kw) for p, params, kw in requests]
    logits = {r: [] for r in ids}
    tokens = {}
    while eng.has_unfinished():
        outs = eng.step()
        for r, row in eng.last_logits.items():
            logits[r].append(row.float().cpu())
        tokens.update({o.request_id: o.token_ids for o in outs if o.finished})
    return [tokens[r] for r in ids], [logits[r] for r in ids]


def nmse(a, b):
    return float(((a - b) ** 2).mean() / (b ** 2).mean())
