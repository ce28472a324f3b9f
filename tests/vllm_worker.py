"""Serve checkpoints with vLLM and record what it computed (run by tests/test_vllm.py with the Python of
vLLM's own environment, `make vllm-env`; not a test module).

    python tests/vllm_worker.py JOBS.json RESULTS.json

JOBS.json: {"checkpoints": [{"name", "path", "prompts": [[token ids]], "max_tokens", "trust"?}], "engine": {...}}
(`trust`: trust_remote_code).
For each checkpoint one engine starts (the slow part: ~10 s on 2 cores with the engine core in this
process, as the tests run it), then all its prompts run in one batch: prompt logprobs of every prompt
token (the logprob of the token that follows, as `occult_ft.from_pretrained(DIR)`'s logits give it),
greedy tokens, and the plugin's routing counts
(`OCCULT_FT_VLLM_ROUTING_STATS`). A checkpoint that fails to load records its error's last line.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def run_one(job: dict, engine: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stats = job["path"].rstrip("/") + ".routing.json"
    os.environ["OCCULT_FT_VLLM_ROUTING_STATS"] = stats  # read by the engine core it spawns
    if os.path.exists(stats):
        os.remove(stats)
    try:
        llm = LLM(
            model=job["path"], dtype="float32", seed=0, trust_remote_code=job.get("trust", False), **engine
        )
    except Exception as exc:  # the refusal is the result
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}  # one line
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], prompt_logprobs=0, ignore_eos=True)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params)
    except Exception as exc:  # an engine that dies in its first step: the next checkpoint still runs
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
    result = {"prompt_logprobs": [], "tokens": []}
    for ids, out in zip(job["prompts"], outputs):
        # entry i (i >= 1) holds the logprob of prompt token i given tokens < i
        result["prompt_logprobs"].append(
            [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
        )
        result["tokens"].append(list(out.outputs[0].token_ids))
    del llm
    gc.collect()
    result["routing"] = json.load(open(stats)) if os.path.exists(stats) else None
    return result


def main() -> None:
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs["checkpoints"]:  # written after each engine, so a slow run shows its progress
        results[job["name"]] = run_one(job, jobs.get("engine", {}))
        with open(sys.argv[2] + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(sys.argv[2] + ".tmp", sys.argv[2])


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    main()
