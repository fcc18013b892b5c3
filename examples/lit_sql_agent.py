"""The Spider SQL agent as an agent-lightning user writes it: a `LitAgent` whose `rollout` writes a query, executes
it, checks it, rewrites it, and returns its exec-match reward. Written for agent-lightning, it changes only its
imports to train here (`import agentlightning as agl` -> `import agent.lit as agl`; the SQL tool and the exec-match
metric are this repository's):

    python launch.py agent=lit agent.cls=examples.lit_sql_agent:LitSQLAgent '+agent.init={max_turns: 2}'

The conversation grows call by call (each call's messages are the previous call's plus its reply and the next user
message): the trainer trains on the whole rollout as one token sequence, token in, token out. A fresh prompt per call
(agent-lightning's own Spider example) would be excluded as inexact.
"""

from __future__ import annotations

import re
from typing import Any

from openai import OpenAI

import agent.lit as agl  # was: import agentlightning as agl
from agent.sql_tool import run_query, schema_text
from rewards.exec_match import execution_match

SYSTEM = "Answer with one SQLite query in a ```sql block."
CHECK = "Result: {result}\nEnd with THE QUERY IS CORRECT or THE QUERY IS INCORRECT."
REWRITE = "Write a corrected query."
_SQL = re.compile(r"```(?:sql)?\s*\n?(.*?)```", re.DOTALL)


def parse_query(text: str) -> str | None:
    blocks = [b.strip() for b in _SQL.findall(text) if b.strip()]
    return blocks[-1] if blocks else None


class LitSQLAgent(agl.LitAgent[dict[str, Any]]):
    def __init__(self, max_turns: int = 2, val_temperature: float | None = 0.0, sql_timeout_s: float = 2.0) -> None:
        super().__init__()
        self.max_turns = max_turns
        self.val_temperature = val_temperature
        self.sql_timeout_s = sql_timeout_s

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float | None:
        llm: agl.LLM = resources["main_llm"]
        client = OpenAI(
            base_url=llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),
            api_key="dummy",
            max_retries=0,
            timeout=300.0,
        )
        sampling = dict(llm.sampling_parameters)
        if rollout.mode != "train" and self.val_temperature is not None:
            sampling["temperature"] = self.val_temperature

        def ask(messages: list[dict[str, str]]) -> str:
            response = client.chat.completions.create(model=llm.model, messages=messages, **sampling)
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            return reply

        schema = schema_text(task["db_path"])[:2000]  # its CREATE TABLE statements, as LangChain's get_table_info
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{schema}\nQuestion: {task['question']}"},
        ]
        query = parse_query(ask(messages))  # write
        for turn in range(1, self.max_turns + 1):
            if query is None:
                result = "Error: no query found."
            else:  # execute
                result = run_query(task["db_path"], query, timeout_s=self.sql_timeout_s, max_rows=10).to_text(300)
            messages.append({"role": "user", "content": CHECK.format(result=result)})
            verdict = ask(messages)  # check
            correct = verdict.rfind("THE QUERY IS CORRECT") > verdict.rfind("THE QUERY IS INCORRECT")
            if correct or turn == self.max_turns:
                break
            messages.append({"role": "user", "content": REWRITE})
            query = parse_query(ask(messages)) or query  # rewrite
        if query is None:
            return 0.0
        return execution_match(query, task["query"], task["db_path"], timeout_s=self.sql_timeout_s)
