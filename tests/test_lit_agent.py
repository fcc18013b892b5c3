"""agent=lit: an agent-lightning `LitAgent` subclass, unchanged but for its import, run as this project's agent.

Unit: the reward is what `rollout` returned (else the last `emit_reward`, never both added); None, an exception or a
time-out is a missing reward; the rollout reaches its route over a loopback port (here the SFT warm start's scripted
chat). Integration: `launch.py agent=lit` trains GRPO with the worked example (examples/lit_sql_agent.py), its
samples token-exact; a class whose rollout raises is excluded, never scored 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import agent.lit as agl
from agent.lit import LitAgentRunner, reward_of
from agent.llm import OpenAIChat
from agent.loopback import LOOPBACK
from agent.rollout import AGENT_ERROR, REWARD_ERROR, run_rollouts
from agent.scripted import ReplayChat, chat_app
from data.dbbench import DBBenchData
from data.med_qa import MedQAData
from data.spider import SpiderData, load_split
from examples.lit_sql_agent import LitSQLAgent
from foundation.errors import ConfigError
from jobs.config import build_components, build_group
from rewards.agent_reward import AgentReward
from tests.conftest import launch
from tests.test_config import compose_with

EXAMPLE = "examples.lit_sql_agent:LitSQLAgent"
SMOKE = ["experiment=smoke", "data.generate.n_train=120", "data.generate.n_dev=8", "data.generate.n_test=8"]


class Raising(agl.LitAgent[dict[str, Any]]):
    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        raise RuntimeError("the agent broke")


class RaisesEverySecondTime(LitSQLAgent):
    """The worked example, whose every second training rollout raises."""

    def __init__(self) -> None:
        super().__init__()
        self.count = itertools.count()

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        if rollout.mode == "train" and next(self.count) % 2:
            raise RuntimeError("the agent broke")
        return super().rollout(task, resources, rollout)


class ReturnsNone(agl.LitAgent[dict[str, Any]]):
    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        return None


class EmitsAndReturns(agl.LitAgent[dict[str, Any]]):
    """Emits its reward and returns it too (agent-lightning would keep two reward spans, the last one counting)."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        agl.emit_reward(1.0)
        return 1.0


class EmitsOnly(agl.LitAgent[dict[str, Any]]):
    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        agl.emit_reward(0.25)
        agl.emit_reward({"score": 0.5})
        return None


RELEASE, FINISHED = threading.Event(), threading.Event()  # Sleeps' rollout ends only once RELEASE is set


class Sleeps(agl.LitAgent[dict[str, Any]]):
    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        RELEASE.wait(60)  # bounded: the test sets it once the step has gone on without this rollout
        FINISHED.set()
        return 1.0


class AsyncAgent(agl.LitAgent[dict[str, Any]]):
    """The async form; sees its LLM and rollout as agent-lightning passes them."""

    async def rollout_async(
        self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout
    ) -> float | None:
        llm = resources["main_llm"]
        assert llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id) == llm.endpoint
        assert llm.endpoint.startswith("http://127.0.0.1:") and f"/rollouts/{rollout.rollout_id}/v1" in llm.endpoint
        assert rollout.mode == "train" and self.tracer.get_langchain_handler() is None
        return 0.75


class ScoresItsMode(agl.LitAgent[dict[str, Any]]):
    """1.0 when told it samples as in training, 0.0 when told it validates."""

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        return {"train": 1.0, "val": 0.0}.get(str(rollout.mode))


def runner(cls: str, **kwargs: Any) -> LitAgentRunner:
    return LitAgentRunner(cls=f"tests.test_lit_agent:{cls}" if ":" not in cls else cls, **kwargs)


def rollouts_of(agent: LitAgentRunner, tasks: list[dict[str, Any]]) -> list[Any]:
    chats = [ReplayChat(agent.oracle(task)) for task in tasks]
    return asyncio.run(asyncio.wait_for(run_rollouts(agent, tasks, lambda i: chats[i], AgentReward()), 60))


@pytest.fixture(scope="module")
def tasks(spider_mini_dir: Path) -> list[dict[str, Any]]:
    return load_split(spider_mini_dir, "train")[:2]


def test_the_reward_is_the_returned_number_else_the_last_emitted_one_never_both() -> None:
    assert reward_of(0.5, []) == 0.5 and reward_of(1, [1.0]) == 1.0 and reward_of(True, []) == 1.0
    assert reward_of(1.0, [1.0, 1.0]) == 1.0  # emitted and returned: counted once
    assert reward_of(None, [0.2, 0.7]) == 0.7  # agent-lightning's final reward: the last one emitted
    assert reward_of(None, []) is None and reward_of(math.nan, []) is None  # missing, never 0
    with pytest.raises(TypeError, match="float reward or None"):
        reward_of("1.0", [])


def test_the_worked_example_plays_its_oracle_over_the_loopback_port_and_scores_itself(tasks: list[dict]) -> None:
    """The SFT warm start's path: the example's OpenAI client reaches the scripted chat over TCP, its calls grow one
    conversation (write, check), and the reward is the exec-match its rollout returned."""
    for rollout in rollouts_of(runner(EXAMPLE), tasks):
        assert rollout.failure is None and rollout.reward == 1.0, rollout.error
        trajectory = rollout.trajectory
        assert trajectory.turns == 2 and trajectory.final_sql == rollout.task["query"]
        assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "user", "assistant"]
        assert trajectory.messages[-1]["content"] == "THE QUERY IS CORRECT"


def test_a_rewrite_demonstration_goes_write_check_rewrite_check(tasks: list[dict]) -> None:
    agent = runner(EXAMPLE)
    chat = ReplayChat(agent.oracle(tasks[0], wrong="SELECT 1"))
    trajectory = asyncio.run(asyncio.wait_for(agent.run(tasks[0], chat), 60))
    assert trajectory.error is None and trajectory.turns == 4 and trajectory.agent_reward == 1.0
    assert len(chat.replies) == 4 and trajectory.final_sql == tasks[0]["query"]


@pytest.mark.parametrize(
    ("cls", "reward", "failure"),
    [
        ("Raising", None, AGENT_ERROR),
        ("ReturnsNone", None, REWARD_ERROR),
        ("EmitsAndReturns", 1.0, None),
        ("EmitsOnly", 0.5, None),
        ("AsyncAgent", 0.75, None),
    ],
)
def test_what_a_rollout_returns_is_its_reward_and_a_missing_one_excludes_it(
    tasks: list[dict], cls: str, reward: float | None, failure: str | None
) -> None:
    (rollout,) = rollouts_of(runner(cls), tasks[:1])
    assert (rollout.reward, rollout.failure) == (reward, failure)
    if cls == "Raising":
        assert rollout.error == "RuntimeError: the agent broke"


def test_against_a_real_endpoint_the_calls_are_relayed_to_it(tasks: list[dict]) -> None:
    """job=eval: the client's base URL is a real one (here a scripted chat on the loopback port); the rollout's calls
    are relayed to it, so the data set's metric sees the SQL, as in validation."""
    replay = ReplayChat(runner(EXAMPLE).oracle(tasks[0]))

    async def go() -> Any:
        with LOOPBACK.route("real", chat_app(replay.answer), asyncio.get_running_loop(), strip=True):
            llm = OpenAIChat.connect(LOOPBACK.base_url("real"), "scripted")
            assert llm.app is None
            return await runner(EXAMPLE).run(tasks[0], llm)

    trajectory = asyncio.run(asyncio.wait_for(go(), 60))
    assert trajectory.error is None and trajectory.agent_reward == 1.0 and len(replay.replies) == 2
    assert trajectory.turns == 2 and trajectory.final_sql == tasks[0]["query"]


@pytest.mark.parametrize(("route", "mode_reward"), [("val3", 0.0), ("pool3", 1.0), ("7", 1.0)])
def test_the_policy_servers_route_tells_the_class_whether_it_validates(
    route: str, mode_reward: float, tasks: list[dict]
) -> None:
    """Validation's routes (`val<i>`) are validation; the pool's (`pool<i>`) and training's sample as in training: a
    class that validates greedily (the worked example's `val_temperature`) would make a pool of identical samples,
    where no task is solved only sometimes."""
    transport = httpx.ASGITransport(app=chat_app(ReplayChat([]).answer))
    llm = OpenAIChat.connect(f"http://policy/rollouts/{route}/v1", "policy", transport=transport)
    trajectory = asyncio.run(asyncio.wait_for(runner("ScoresItsMode").run(tasks[0], llm), 60))
    assert trajectory.error is None and trajectory.agent_reward == mode_reward


def test_a_rollout_past_its_time_limit_is_an_agent_error_and_does_not_hold_the_step(tasks: list[dict]) -> None:
    RELEASE.clear(), FINISHED.clear()
    try:
        (rollout,) = rollouts_of(runner("Sleeps", rollout_timeout_s=0.3), tasks[:1])
        assert not FINISHED.is_set()  # the rollout came back (timed out) while the agent still ran
    finally:
        RELEASE.set()
    assert rollout.failure == AGENT_ERROR and "rollout_timeout_s=0.3" in (rollout.error or "")


def metrics_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_grpo_trains_a_lit_agent_token_exact(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SMOKE, "agent=lit", f"agent.cls={EXAMPLE}", "algorithm.max_steps=2", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2] and "val/accuracy" in metrics[-1]
    for m in metrics[1:]:
        assert m["rollout/llm_calls_mean"] >= 2  # write + check: one growing conversation per rollout
        # token-exact: every call extended the sequence, and the trainer's log-probs are the sampler's
        assert m["rollout/discontinuous_rate"] == 0 and m["rollout/excluded_inexact_rate"] == 0
        assert m["rollout/excluded_agent_error_rate"] == 0 and m["rollout/excluded_reward_error_rate"] == 0
        assert m["train/sampling/logp_diff/max"] < 1e-4


@pytest.mark.integration
def test_the_training_rollouts_that_raise_are_excluded_and_the_rest_train(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SMOKE, "agent=lit", "agent.cls=tests.test_lit_agent:RaisesEverySecondTime", "warmstart=none"]
    args += ["algorithm.max_steps=1", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (step,) = [m for m in metrics_of(run_dir) if m.get("step") == 1]
    # 2 of the step's 4 rollouts raised: excluded (no reward, no tokens trained), never scored 0
    assert step["rollout/excluded_agent_error_rate"] == 0.5 and step["rollout/excluded_rate"] == 0.5
    assert step["rollout/excluded_inexact_rate"] == 0 and step["train/sampling/logp_diff/max"] < 1e-4
    assert step["compute/trained_tokens"] > 0


def test_the_class_and_its_constructor_arguments_come_from_the_command_line() -> None:
    cfg = compose_with("agent=lit", f"agent.cls={EXAMPLE}", "+agent.init={max_turns: 3, val_temperature: 0.5}")
    agent = build_group(cfg, "agent")
    assert isinstance(agent.agent, LitSQLAgent) and (agent.agent.max_turns, agent.agent.val_temperature) == (3, 0.5)
    assert cfg.reward.name == "agent_reward"
    with pytest.raises(ConfigError, match=r"agent\.cls=no_such_pkg\.agent:Lit cannot be loaded: ModuleNotFoundError"):
        build_group(compose_with("agent=lit", "agent.cls=no_such_pkg.agent:Lit"), "agent")


def test_a_class_for_another_kind_of_task_says_so_and_meets_that_data() -> None:
    with pytest.raises(ConfigError, match=r"agent=lit answers text_to_sql tasks; data=med_qa holds med_qa tasks"):
        build_components(compose_with("agent=lit", f"agent.cls={EXAMPLE}", "data=med_qa"))
    parts = build_components(compose_with("agent=lit", f"agent.cls={EXAMPLE}", "data=med_qa", "agent.task_kind=med_qa"))
    assert parts["agent"].task_kind == parts["data"].task_kind == "med_qa"
    assert set(agl.TASK_KINDS) == {d.task_kind for d in (SpiderData, MedQAData, DBBenchData)}
