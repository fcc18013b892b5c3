"""backend=dev: agent-lightning's `Trainer.dev` (its Baseline algorithm) against any OpenAI-compatible endpoint.

    tasks -> agent-lightning store -> runners (our agent, unchanged) -> LLM proxy -> endpoint
          -> spans in the store -> the adapter's triplets (prompt/response token ids, reward) -> <run>/dev/

The same wiring `backend=verl` trains with, minus verl: what it shows is that rollouts complete, are traced and
become triplets with token ids and rewards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

from agent.llm import Endpoint
from backends.agl import agl as wiring
from backends.agl.agl import LLM_RESOURCE, agl
from backends.agl.settings import DevSettings
from backends.setup import TrainSetup


def run_dev(backend: DevSettings, setup: TrainSetup) -> dict[str, Any]:
    if setup.warmstart is not None:
        raise ValueError(f"warmstart={setup.warmstart.name}: backend=dev has no warm start (add warmstart=none)")
    endpoint = Endpoint(base_url=backend.base_url, model=backend.model, api_key_env=backend.api_key_env)
    model = endpoint.check_reachable()
    tasks = setup.data.train_tasks()[: backend.n_tasks]
    algo = setup.algorithm
    llm_proxy = wiring.proxy([wiring.endpoint_model(backend.base_url, model, backend.api_key_env)])
    store, port = wiring.store_and_port(backend)
    trainer = agl.Trainer(
        n_runners=backend.n_runners,
        port=port,
        store=store,
        llm_proxy=llm_proxy,
        initial_resources={LLM_RESOURCE: llm_proxy.as_resource(sampling_parameters=algo.sampling(algo.temperature))},
        tracer=wiring.tracer(backend),
        runner=wiring.runner(backend, backend.poll_interval_s),
        adapter=wiring.adapter(backend),
        algorithm=agl.Baseline(n_epochs=1, polling_interval=backend.poll_interval_s, span_verbosity="none"),
    )
    start = time.monotonic()
    trainer.dev(wiring.AgentRollouts(setup.agent, setup.reward, {}), train_dataset=tasks)
    wall_s = time.monotonic() - start
    records = asyncio.run(_records(trainer.store, trainer.adapter))
    out = setup.run.path / "dev"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rewards = [r["reward"] for r in records if r["reward"] is not None]
    return {
        "dev": {
            "rollouts": len(records),
            "succeeded": sum(r["status"] == "succeeded" for r in records),
            "spans": sum(r["spans"] for r in records),
            "triplets": sum(len(r["triplets"]) for r in records),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "wall_s": wall_s,
        }
    }


async def _records(store: agl.LightningStore, adapter: agl.TraceAdapter[Any]) -> list[dict[str, Any]]:
    """One line per rollout: its status, how many spans it left and the triplets the adapter made of them."""
    records = []
    for rollout in await store.query_rollouts():
        spans = await store.query_spans(rollout.rollout_id, attempt_id="latest")
        triplets = adapter.adapt(spans)
        final = [t.reward for t in triplets if t.reward is not None]
        records.append(
            {
                "rollout_id": rollout.rollout_id,
                "task_id": rollout.input.get("id") if isinstance(rollout.input, dict) else None,
                "status": rollout.status,
                "spans": len(spans),
                "span_names": dict(Counter(s.name for s in spans)),
                "reward": final[-1] if final else None,
                "triplets": [
                    {
                        "prompt_tokens": len(t.prompt.get("token_ids") or []),
                        "response_tokens": len(t.response.get("token_ids") or []),
                        "reward": t.reward,
                        "response_id": t.metadata.get("response_id"),
                    }
                    for t in triplets
                ],
            }
        )
    return records
