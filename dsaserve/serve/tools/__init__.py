"""Tool calls and reasoning in chat output, as vLLM's `--tool-call-parser` / `--reasoning-parser`
read them (docs/serving.md, "Tool calling and reasoning").

    base.py       ToolCall, ChatDelta; TagSplitter (streamed text → text outside `start…end`
                  blocks and whole blocks: the one place that holds back a partial tag)
    glm.py        GLM-4.5 / 4.7 / 5 calls: <tool_call>NAME<arg_key>k</arg_key><arg_value>v…
    dsml.py       DeepSeek-V3.2 calls: <｜DSML｜function_calls><｜DSML｜invoke name="…">…
    reasoning.py  <think>…</think> → reasoning_content (thinking on or off per request)
    registry.py   the parsers by vLLM's names; ChatOutputParser: one request's text deltas →
                  reasoning, content and tool-call deltas

Every parser is incremental and split-invariant: however the text is cut into deltas, the deltas
it returns join to what the whole text gives (tests/unit/test_tool_parsers.py checks this over
random splits).
"""
