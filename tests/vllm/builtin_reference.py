"""Greedy outputs of the built-in engine, computed in the project's main virtualenv.

The built-in engine needs the transformers release of `.venv`; `.venv-vllm` holds the older one
that vLLM pins, under which the engine's KV-cache plumbing does not run. The vLLM tests therefore
run this script with `.venv/bin/python`: JSON request on stdin, JSON results to the file named
by the first argument (stdout carries the engine's logs).

    {"model": "tiny" | "/dir", "seed": 0, "prompts": [[ids]], "max_new_tokens": 24}
    -> [{"token_ids": [...], "logprobs": [...]}, ...]   (greedy, EOS ignored)
"""

from __future__ import annotations

import json
import sys

from pipelinerl.common.model import load_model
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate


def main() -> None:
    spec = json.load(sys.stdin)
    loaded = load_model(spec["model"], seed=spec["seed"])
    engine = InferenceEngine(loaded.model, loaded.tokenizer, EngineSettings(ignore_eos=True))
    sampling = SamplingParams(temperature=0, max_new_tokens=spec["max_new_tokens"])
    for i, prompt in enumerate(spec["prompts"]):
        engine.add_request(GenerationRequest(str(i), prompt, sampling))
    finals: dict[int, GenerationUpdate] = {}
    while engine.has_work:
        for update in engine.step():
            if update.finish_reason is not None:
                finals[int(update.request_id)] = update
    out = [
        {"token_ids": finals[i].tokens.token_ids, "logprobs": finals[i].tokens.logprobs}
        for i in sorted(finals)
    ]
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
