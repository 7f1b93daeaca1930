"""An agent harness with the `openai` SDK: answer, check, and retry once with feedback.

    ./launch.sh output_dir=runs/agent max_response_length=96 \
        actor_rollout_ref.rollout.agent.default_agent_loop=external \
        external.harness=pipegen.examples.answer_check_retry:harness

The second request holds the first exchange exactly as returned plus the feedback, so the gateway continues the
same token sequence: the unit is one trajectory (answer, feedback with mask 0, second answer). The harness scores
itself: its result's `reward` lands in rm_scores, `tries` in the row's data.
"""

from __future__ import annotations

import re
from typing import Any

from openai import OpenAI

MAX_TOKENS = 40  # per answer: two answers and the feedback fit max_response_length=96


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return numbers[-1] if numbers else None


def harness(row: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    client = OpenAI(base_url=base_url, api_key=api_key)
    truth = str(row["reward_model"]["ground_truth"]).strip()
    messages = [{"role": m["role"], "content": m["content"]} for m in row["raw_prompt"]]
    for tries in (1, 2):
        answer = client.chat.completions.create(model="pipegen", messages=messages,
                                                max_tokens=MAX_TOKENS).choices[0].message.content or ""
        if final_number(answer) == truth:
            return {"reward": 1.0, "tries": tries}
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "That is not right. Check your work and give only the number."}]
    return {"reward": 0.0, "tries": 2}
