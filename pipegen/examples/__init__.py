"""Example agent harnesses for the `external` agent loop (pipegen/gateway/): written as users write them, with
nothing pipegen-specific but the `(row, base_url, api_key)` signature.

- `answer_check_retry.harness`: the `openai` SDK; answer, check against the row's ground truth, retry once
  with feedback (runs on the embedded SmolLM2);
- `agents_calculator.harness`: the OpenAI Agents SDK (`openai-agents`) with a calculator function tool.

Their SDKs are not pipegen's dependencies: `pip install '.[examples]'` in pipegen's checkout installs them (the test extra
pulls it in); without them a harness here fails its unit in one line naming the extra (gateway/harness.py).
Must never: be imported by pipegen's own code paths (they are what users write).
"""
